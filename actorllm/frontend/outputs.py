"""What a request gives back: outputs, errors, and the one way deltas are merged.

The engine produces a request's output in pieces (one ``CompletionOutput`` delta per
choice per step). Three readers put pieces together: the :class:`OutputCollector`, which
holds what a slow reader has not taken yet; ``llm.collect``, which builds whole results;
and the server's renderers, which build whole responses. All three fold with
:meth:`Merged.add`, so "what a delta means" is written once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import attrs
import trio

from actorllm.clock import now
from actorllm.wire.messages import TokenLogprob


@attrs.frozen
class FlowLimits:
    """How far a reader may fall behind (``--max-pending-bytes-per-request``,
    ``--max-pending-bytes``, ``--stream-timeout``); the Frontend applies them.

    Over its own mark, or over a share of it while the total is over the global mark, a
    request is paused (its leaves leave the batch, keeping their KV) until its reader takes
    what is pending; a request whose reader takes nothing for ``stream_timeout`` seconds
    while the engine still works on it is cancelled with an error. None turns a limit off.
    """

    max_bytes_per_request: int | None = 256 << 10
    max_bytes: int | None = 64 << 20
    stream_timeout: float | None = 30.0

    def __attrs_post_init__(self) -> None:
        for name in ("max_bytes_per_request", "max_bytes"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be at least 1, got {v}")
        if self.stream_timeout is not None and not self.stream_timeout > 0:
            raise ValueError(f"stream_timeout must be positive, got {self.stream_timeout}")

    def behind(self, pending: int, total: int) -> bool:
        """A request with ``pending`` bytes unread (``total`` over all) should pause."""
        own = self.max_bytes_per_request
        if own is not None and pending > own:
            return True
        # Over the global mark, only readers that are behind pause (never everyone): more
        # than an eighth of their own mark, or than 4 KiB without one.
        share = (own // 8) if own is not None else 4096
        return self.max_bytes is not None and total > self.max_bytes and pending > share


UNLIMITED = FlowLimits(None, None, None)


def output_bytes(text: str, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...],
                 prompt_logprobs: tuple[TokenLogprob | None, ...] = ()) -> int:
    """What a delta costs while it waits for its reader: an estimate, in bytes, of the text
    (UTF-8), the token ids and the logprob entries (with their alternatives)."""
    n = len(text.encode("utf-8", "surrogatepass")) + 4 * len(token_ids)
    for lp in (*logprobs, *prompt_logprobs):
        n += 16 if lp is None else 16 + 12 * len(lp.top)
    return n




class RequestError(Exception):
    """A request ended with an error; ``code`` is ``invalid_request``, ``internal``, ..."""

    def __init__(self, message: str, code: str = "internal", param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


class EndOfOutput(Exception):
    """The final output of a request has already been read."""


@attrs.frozen
class CompletionOutput:
    """One choice's news since the last read (or, in LLM results, its whole output)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # With params.prompt_logprobs: one entry per prompt position (the first None), and
    # the prompt's token ids (in the output that carries the first entry).
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()


@attrs.frozen
class RequestOutput:
    rid: str
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    num_prompt_tokens: int = 0


@attrs.define
class Merged:
    """One choice's deltas folded together; appends only, so a long fold stays linear."""

    text: list[str] = attrs.Factory(list)
    token_ids: list[int] = attrs.Factory(list)
    logprobs: list[TokenLogprob] = attrs.Factory(list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob | None] = attrs.Factory(list)
    prompt_token_ids: tuple[int, ...] = ()

    def add(self, out: CompletionOutput) -> None:
        """Fold a later delta in: text and tokens concatenate, a finish is kept."""
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.prompt_logprobs.extend(out.prompt_logprobs)
        self.prompt_token_ids = self.prompt_token_ids or out.prompt_token_ids
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason

    def output(self, index: int) -> CompletionOutput:
        """Everything folded so far, as one output."""
        return CompletionOutput(index, "".join(self.text), tuple(self.token_ids),
                                tuple(self.logprobs), self.finish_reason, self.stop_reason,
                                tuple(self.prompt_logprobs), self.prompt_token_ids)


def merge_all(outputs: dict[int, Merged], out: RequestOutput) -> None:
    """Fold every choice of ``out`` into ``outputs`` (index -> merged so far)."""
    for o in out.outputs:
        outputs.setdefault(o.index, Merged()).add(o)


class OutputCollector:
    """Merges outputs for a reader that may be slow: O(1) pending items per choice.

    Deltas for a choice are folded with :meth:`Merged.add`; a finish is kept; an error is
    raised to the reader once everything before it has been read. The writer never waits.

    It also counts what waits for the reader (``pending_bytes``, ``pending_tokens``, since
    when: ``oldest``) and when the reader last took something (``last_read``); the
    Frontend, which fills it, reads these to pace the request and sets ``on_read`` to
    hear of each take (and of :meth:`discard`). ``engine_done`` is set once the engine
    has given its last output (or an error), read or not.
    """

    merged_type: type[Merged] = Merged  # the fold; the simulation plants a faulty one

    def __init__(self, rid: str, n: int, *, final_only: bool = False) -> None:
        self.rid, self.n = rid, n
        # The reader wants the whole result, not a stream (``LLM.generate``, a non-streaming
        # HTTP request): it is woken once, at the end or on an error, not for every step's
        # delta. Its output is a result being built rather than a backlog, so it is not
        # counted as pending and never paces the request.
        self.final_only = final_only
        self._pending: dict[int, Merged] = {}
        self._done: set[int] = set()
        self._error: RequestError | None = None
        self._closed = False  # the final output has been read
        self._discarded = False  # the reader left: nothing more is kept
        self.num_prompt_tokens = 0
        # Prompt tokens the prefix cache served; with n > 1 the fewest any choice got.
        self.num_cached_tokens: int | None = None
        self.pooled: tuple[float, ...] = ()  # an embedding request's pooled hidden state
        self._event = trio.Event()
        self.engine_done = trio.Event()
        self.pending_bytes = 0
        self.pending_tokens = 0
        self.tokens_read = 0
        self.oldest: float | None = None  # when the oldest unread output arrived
        self.last_read = now()
        self.paused = False  # the Frontend asked the engine to pause its leaves
        # Called after each take (and discard) with (self, bytes, tokens) taken.
        self.on_read: Callable[[OutputCollector, int, int], None] | None = None

    @property
    def finished(self) -> bool:
        return self._error is not None or len(self._done) == self.n

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _arrived(self, cost: int, tokens: int) -> None:
        if self.final_only:
            if len(self._done) == self.n:
                self._event.set()
            return
        self.pending_bytes += cost
        self.pending_tokens += tokens
        if self.oldest is None:
            self.oldest = now()
        self._event.set()

    def _merged(self, index: int) -> Merged:
        p = self._pending.get(index)
        if p is None:
            p = self._pending[index] = self.merged_type()
        return p

    def put_delta(self, index: int, text: str, token_ids: tuple[int, ...],
                  logprobs: tuple[TokenLogprob, ...],
                  prompt_logprobs: tuple[TokenLogprob | None, ...] = (),
                  prompt_token_ids: tuple[int, ...] = ()) -> None:
        if self._discarded:
            return
        self._merged(index).add(CompletionOutput(index, text, token_ids, logprobs,
                                                 prompt_logprobs=prompt_logprobs,
                                                 prompt_token_ids=prompt_token_ids))
        self._arrived(output_bytes(text, token_ids, logprobs, prompt_logprobs),
                      len(token_ids))

    def put_finish(self, index: int, reason: str, stop_reason: str | int | None) -> None:
        self._done.add(index)
        if not self._discarded:
            self._merged(index).add(CompletionOutput(index, "", (), finish_reason=reason,
                                                     stop_reason=stop_reason))
            self._arrived(0, 0)
        if len(self._done) == self.n:
            self.engine_done.set()

    def put_error(self, error: RequestError) -> None:
        if self._error is None:
            self._error = error
        self._event.set()
        self.engine_done.set()

    def pending_items(self) -> int:
        return len(self._pending) + (self._error is not None)

    def take(self) -> RequestOutput | None:
        """What has arrived since the last take, merged; None if nothing."""
        if not self._pending:
            return None
        outs = tuple(p.output(i) for i, p in sorted(self._pending.items()))
        self._pending = {}
        finished = len(self._done) == self.n and self._error is None
        self._read()
        return RequestOutput(self.rid, outs, finished, self.num_prompt_tokens)

    def _read(self) -> None:
        cost, tokens = self.pending_bytes, self.pending_tokens
        self.tokens_read += tokens
        self.pending_bytes = self.pending_tokens = 0
        self.oldest = None
        self.last_read = now()
        if self.on_read is not None:
            self.on_read(self, cost, tokens)

    def discard(self) -> None:
        """The reader is gone: what it did not read is dropped (and no longer counted)."""
        self._pending = {}
        self._closed = self._discarded = True
        self._read()

    def age(self, t: float) -> float:
        """How long the oldest unread output has waited at ``t`` (0 when nothing waits)."""
        return 0.0 if self.oldest is None else max(t - self.oldest, 0.0)

    def stalled_for(self, t: float) -> float:
        """How long output has waited while the reader took nothing (0 if none waits: a
        reader waiting for the engine is not behind). Counted from the later of the last
        take and the oldest arrival, so a reader that waited long for a slow engine is not
        called stalled the moment output comes."""
        if self.oldest is None:
            return 0.0
        return max(t - max(self.last_read, self.oldest), 0.0)

    async def get(self) -> RequestOutput:
        """Wait for news. Raises RequestError after an error, EndOfOutput after the end."""
        while True:
            if self._closed:
                raise EndOfOutput(self.rid)
            out = self.take()
            if out is not None:
                self._closed = out.finished
                return out
            if self._error is not None:
                self._closed = True
                raise self._error
            await self._event.wait()
            self._event = trio.Event()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            try:
                yield await self.get()
            except EndOfOutput:
                return
