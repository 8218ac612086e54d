"""The output collector: what one request's reader has not taken yet, merged.

The Frontend fills it (:meth:`OutputCollector.put_delta`, ``put_finish``, ``put_error``);
the reader (an HTTP response, ``LLM.generate``) takes from it (``get``, ``take``) or
leaves (``discard``). The writer never waits: deltas for a choice fold into one pending
item with :meth:`Merged.add`, so a slow reader costs O(1) items per choice.

Its life, written once in ``MOVES`` (an event a phase does not list raises
:class:`IllegalMove`)::

    OPEN --end--> ENDED --close--> CLOSED        (every choice finished; the reader read it)
    OPEN --fail--> FAILED --close--> CLOSED      (an error; the reader was given it)
    OPEN --leave--> LEFT --end|fail--> CLOSED    (the reader went first; the engine ends)
    ENDED|FAILED --leave--> CLOSED

``delta`` and ``finish`` (a choice's output, a finish that is not the last) keep a phase
that takes them; ``fail`` after an error or in CLOSED keeps the first error.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable

import trio

from actorllm.clock import now
from actorllm.wire.messages import TokenLogprob
from actorllm.wire.outputs import CompletionOutput, EndOfOutput, Merged, RequestError, RequestOutput


class Phase(enum.Enum):
    OPEN = "open"  # the engine produces and the reader reads
    ENDED = "ended"  # every choice has finished; the reader has not taken the end yet
    FAILED = "failed"  # an error came; the reader has not been given it yet
    LEFT = "left"  # the reader went away while the engine still produced: nothing is kept
    CLOSED = "closed"  # the engine is done and the reader has all it will ever get


P = Phase
MOVES: dict[Phase, dict[str, Phase]] = {
    P.OPEN: {"delta": P.OPEN, "finish": P.OPEN, "end": P.ENDED, "fail": P.FAILED,
             "leave": P.LEFT},
    P.ENDED: {"close": P.CLOSED, "leave": P.CLOSED},
    P.FAILED: {"fail": P.FAILED, "close": P.CLOSED, "leave": P.CLOSED},
    P.LEFT: {"delta": P.LEFT, "finish": P.LEFT, "end": P.CLOSED, "fail": P.CLOSED,
             "leave": P.LEFT},
    P.CLOSED: {"fail": P.CLOSED, "leave": P.CLOSED},
}
ENGINE_DONE = frozenset({P.ENDED, P.FAILED, P.CLOSED})


class IllegalMove(Exception):
    """An event the collector's phase does not take (``MOVES``): a bug in its writer."""

    def __init__(self, rid: str, phase: Phase, event: str) -> None:
        self.rid, self.phase, self.event = rid, phase, event
        super().__init__(f"collector of {rid!r}: event {event!r} is illegal in {phase.name}")


def output_bytes(text: str, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...],
                 prompt_logprobs: tuple[TokenLogprob | None, ...] = ()) -> int:
    """What a delta costs while it waits for its reader: an estimate, in bytes, of the text
    (UTF-8), the token ids and the logprob entries (with their alternatives)."""
    n = len(text.encode("utf-8", "surrogatepass")) + 4 * len(token_ids)
    for lp in (*logprobs, *prompt_logprobs):
        n += 16 if lp is None else 16 + 12 * len(lp.top)
    return n


class OutputCollector:
    """Merges outputs for a reader that may be slow: O(1) pending items per choice.

    Deltas for a choice are folded with :meth:`Merged.add`; a finish is kept; an error is
    raised to the reader once everything before it has been read. The writer never waits.

    It also counts what waits for the reader (``pending_bytes``, ``pending_tokens``, since
    when: ``oldest``) and when the reader last took something (``last_read``); the
    Frontend's reader pacing reads these and sets ``on_read`` to hear of each take (and of
    :meth:`discard`). ``engine_done`` is set once the engine has given its last output (or
    an error), read or not.
    """

    def __init__(self, rid: str, n: int, *, final_only: bool = False) -> None:
        self.rid, self.n = rid, n
        # The reader wants the whole result, not a stream (``LLM.generate``, a non-streaming
        # HTTP request): it is woken once, at the end or on an error, not for every step's
        # delta. Its output is a result being built rather than a backlog, so it is not
        # counted as pending and never paces the request.
        self.final_only = final_only
        self.phase = Phase.OPEN
        self._pending: dict[int, Merged] = {}
        self._done: set[int] = set()  # the choices that have finished
        self._error: RequestError | None = None  # the first error, raised to the reader
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
        # Called after each take (and discard) with (self, bytes, tokens) taken.
        self.on_read: Callable[[OutputCollector, int, int], None] | None = None

    def note_finish(self, num_prompt_tokens: int, cached_tokens: int | None,
                    pooled: tuple[float, ...]) -> None:
        """What a choice's finish says of the whole request: the prompt's length, the
        cached prefix (with n > 1 the fewest any choice got), an embedding's vector."""
        self.num_prompt_tokens = num_prompt_tokens
        self.pooled = pooled
        if cached_tokens is not None:
            c = self.num_cached_tokens
            self.num_cached_tokens = cached_tokens if c is None else min(c, cached_tokens)

    def _move(self, event: str) -> None:
        to = MOVES[self.phase].get(event)
        if to is None:
            raise IllegalMove(self.rid, self.phase, event)
        self.phase = to

    @property
    def finished(self) -> bool:
        """The engine has given its last output or an error (read or not)."""
        return self.phase in ENGINE_DONE

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _arrived(self, cost: int, tokens: int) -> None:
        if self.final_only:
            if self.phase is Phase.ENDED:
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
            p = self._pending[index] = Merged()
        return p

    def put_delta(self, index: int, text: str, token_ids: tuple[int, ...],
                  logprobs: tuple[TokenLogprob, ...] = (),
                  prompt_logprobs: tuple[TokenLogprob | None, ...] = (),
                  prompt_token_ids: tuple[int, ...] = ()) -> None:
        """Fold one delta of choice ``index`` into what waits for the reader."""
        self._move("delta")
        if self.phase is Phase.LEFT:
            return
        if logprobs or prompt_logprobs or prompt_token_ids:
            self._merged(index).add(CompletionOutput(index, text, token_ids, logprobs,
                                                     prompt_logprobs=prompt_logprobs,
                                                     prompt_token_ids=prompt_token_ids))
        else:  # the common delta: text and tokens only, folded without an object
            self._merged(index).add_text(text, token_ids)
        if self.final_only:  # nothing is counted as pending: no need to size it
            self._arrived(0, 0)
        else:
            self._arrived(output_bytes(text, token_ids, logprobs, prompt_logprobs),
                          len(token_ids))

    def put_finish(self, index: int, reason: str, stop_reason: str | int | None) -> None:
        """Choice ``index`` has finished; the last one ends the collector."""
        self._done.add(index)
        kept = self.phase is Phase.OPEN  # (once the reader has left, nothing is kept)
        self._move("end" if len(self._done) == self.n else "finish")
        if kept:
            self._merged(index).add(CompletionOutput(index, "", (), finish_reason=reason,
                                                     stop_reason=stop_reason))
            self._arrived(0, 0)
        if self.finished:
            self.engine_done.set()

    def put_error(self, error: RequestError) -> None:
        """The request failed: the reader gets ``error`` (the first one) after what waits."""
        if self._error is None:
            self._error = error
        self._move("fail")
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
        finished = self.phase is Phase.ENDED
        self._read()
        return RequestOutput(self.rid, outs, finished, self.num_prompt_tokens,
                             self.pooled if finished else ())

    def reader_progressed(self, t: float) -> None:
        """The reader made progress at ``t`` without taking (its socket took bytes of an
        earlier take): for the stall rule that is a read."""
        self.last_read = max(self.last_read, t)

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
        self._move("leave")
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
            if self.phase in (Phase.LEFT, Phase.CLOSED):
                raise EndOfOutput(self.rid)
            out = self.take()
            if out is not None:
                if out.finished:
                    self._move("close")
                return out
            if self.phase is Phase.FAILED:
                assert self._error is not None
                self._move("close")
                raise self._error
            await self._event.wait()
            self._event = trio.Event()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            try:
                yield await self.get()
            except EndOfOutput:
                return
