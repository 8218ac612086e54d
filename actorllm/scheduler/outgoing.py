"""What the Scheduler has decided to tell the Detokenizer since its last ``TokenBatch``.

Decisions are synchronous and sending is not (see actorllm/scheduler/actor.py), so what a
decision produces waits here until the sender takes it as one batch: one ``TokenOut`` per
rid per batch at most where a token and the finish meet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from actorllm.scheduler.sequence import Sequence
from actorllm.wire.messages import SchedulerStats, TokenBatch, TokenLogprob, TokenOut


class Outgoing:
    """Token outputs, freed rids and whether the stats changed, not yet sent."""

    def __init__(self) -> None:
        self.outputs: list[TokenOut] = []
        self.freed: list[str] = []
        self.stats_changed = False

    def token(self, seq: Sequence, token: int | tuple[int, ...], logprob: TokenLogprob | None,
              piece: dict[str, Any] | None = None) -> None:
        """A sampled token for ``seq`` (with the step's prompt logprobs ``piece``, if any);
        a tuple: a speculating row's tokens, in order (the Detokenizer sees each)."""
        self.outputs.append(TokenOut(
            rid=seq.rid,
            token_ids=token if isinstance(token, tuple) else (token,),
            logprobs=(logprob,) if logprob is not None else (),
            spec=seq.detok_spec_once(),
            **(piece or {}),
        ))

    def piece(self, seq: Sequence, piece: dict[str, Any]) -> None:
        """Prompt logprobs from a prefill chunk that sampled nothing."""
        self.outputs.append(TokenOut(seq.rid, spec=seq.detok_spec_once(), **piece))

    def final(self, seq: Sequence, reason: str, stop_reason: Any, error: str | None) -> None:
        """``seq``'s last output, merged with this batch's token for it if that came last."""
        last = self.outputs[-1] if self.outputs else None
        if last is not None and last.rid == seq.rid and last.finish_reason is None:
            self.outputs.pop()
        else:
            last = None
        self.outputs.append(seq.final_output(reason, stop_reason, error, last))

    def take(self, stats: Callable[[], SchedulerStats]) -> TokenBatch | None:
        """The batch of everything noted since the last call, if anything was."""
        if not (self.outputs or self.freed or self.stats_changed):
            return None
        batch = TokenBatch(tuple(self.outputs), tuple(self.freed), stats())
        self.outputs, self.freed, self.stats_changed = [], [], False
        return batch
