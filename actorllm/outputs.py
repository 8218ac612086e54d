"""What a request gives back: outputs, errors, and the one way deltas are merged.

The engine produces a request's output in pieces (one ``CompletionOutput`` delta per
choice per step). Three readers put pieces together: the :class:`OutputCollector`, which
holds what a slow reader has not taken yet; ``llm.collect``, which builds whole results;
and the server's renderers, which build whole responses. All three fold with
:meth:`Merged.add`, so "what a delta means" is written once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import attrs
import trio

from actorllm.messages import TokenLogprob


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
    """

    merged_type: type[Merged] = Merged  # the fold; the simulation plants a faulty one

    def __init__(self, rid: str, n: int) -> None:
        self.rid, self.n = rid, n
        self._pending: dict[int, Merged] = {}
        self._done: set[int] = set()
        self._error: RequestError | None = None
        self._closed = False  # the final output has been read
        self.num_prompt_tokens = 0
        # Prompt tokens the prefix cache served; with n > 1 the fewest any choice got.
        self.num_cached_tokens: int | None = None
        self._event = trio.Event()

    @property
    def finished(self) -> bool:
        return self._error is not None or len(self._done) == self.n

    def _merged(self, index: int) -> Merged:
        p = self._pending.get(index)
        if p is None:
            p = self._pending[index] = self.merged_type()
        return p

    def put_delta(self, index: int, text: str, token_ids: tuple[int, ...],
                  logprobs: tuple[TokenLogprob, ...],
                  prompt_logprobs: tuple[TokenLogprob | None, ...] = (),
                  prompt_token_ids: tuple[int, ...] = ()) -> None:
        self._merged(index).add(CompletionOutput(index, text, token_ids, logprobs,
                                                 prompt_logprobs=prompt_logprobs,
                                                 prompt_token_ids=prompt_token_ids))
        self._event.set()

    def put_finish(self, index: int, reason: str, stop_reason: str | int | None) -> None:
        self._merged(index).add(CompletionOutput(index, "", (), finish_reason=reason,
                                                 stop_reason=stop_reason))
        self._done.add(index)
        self._event.set()

    def put_error(self, error: RequestError) -> None:
        if self._error is None:
            self._error = error
        self._event.set()

    def pending_items(self) -> int:
        return len(self._pending) + (self._error is not None)

    def take(self) -> RequestOutput | None:
        """What has arrived since the last take, merged; None if nothing."""
        if not self._pending:
            return None
        outs = tuple(p.output(i) for i, p in sorted(self._pending.items()))
        self._pending = {}
        finished = len(self._done) == self.n and self._error is None
        return RequestOutput(self.rid, outs, finished, self.num_prompt_tokens)

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
