"""What a request gives back: outputs, errors, and the one way deltas are merged.

Shared ground: the Frontend fills these, the engine hands them on, and the server and
``llm.py`` read them; none of them owns the types.

The engine produces a request's output in pieces (one ``CompletionOutput`` delta per
choice per step). Three readers put pieces together: the Frontend's ``OutputCollector``,
which holds what a slow reader has not taken yet; ``llm.collect``, which builds whole
results; and the server's renderers, which build whole responses. All three fold with
:meth:`Merged.add`, so "what a delta means" is written once.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from actorllm.wire.messages import TokenLogprob


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

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sampled tokens' logprobs summed; None unless logprobs were asked."""
        return sum(lp.logprob for lp in self.logprobs) if self.logprobs else None


@attrs.frozen
class RequestOutput:
    rid: str
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    num_prompt_tokens: int = 0
    pooled: tuple[float, ...] = ()  # a pooling request's vector, in its finished output


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

    def add_text(self, text: str, token_ids: tuple[int, ...]) -> None:
        """Fold in a delta of text and tokens only (as ``add`` would, without the object)."""
        self.text.append(text)
        self.token_ids.extend(token_ids)

    def output(self, index: int) -> CompletionOutput:
        """Everything folded so far, as one output."""
        return CompletionOutput(index, "".join(self.text), tuple(self.token_ids),
                                tuple(self.logprobs), self.finish_reason, self.stop_reason,
                                tuple(self.prompt_logprobs), self.prompt_token_ids)


def prompt_ids_of(choices: Iterable[Merged | CompletionOutput]) -> tuple[int, ...]:
    """The prompt's token ids, from whichever choice (merged or one output) brought them
    (every choice has the same prompt); () if none did."""
    return next((m.prompt_token_ids for m in choices if m.prompt_token_ids), ())


def merge_all(outputs: dict[int, Merged], out: RequestOutput) -> None:
    """Fold every choice of ``out`` into ``outputs`` (index -> merged so far)."""
    for o in out.outputs:
        outputs.setdefault(o.index, Merged()).add(o)
