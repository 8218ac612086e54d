"""What the Scheduler has decided to tell the Detokenizer since its last ``TokenBatch``.

Decisions are synchronous and sending is not (see actorllm/scheduler/actor.py), so what a
decision produces waits here until the sender takes it as one batch. The batch is columns
(``TokenBatch``): a plain token appends to three lists and builds no object; only what is
rare (a rid's ``DetokSetup``, logprobs, prompt logprobs, a finish) gets a ``TokenOut``.
A finish decided right after its rid's token shares that token's row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from actorllm.scheduler.sequence import Sequence
from actorllm.wire.messages import SchedulerStats, TokenBatch, TokenLogprob, TokenOut


class Outgoing:
    """Token outputs (as columns), freed rids and whether the stats changed, not yet sent."""

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.num_tokens: list[int] = []
        self.token_ids: list[int] = []
        self.rare_rows: list[int] = []
        self.rare: list[TokenOut] = []
        self.freed: list[str] = []
        self.stats_changed = False

    def token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None,
              piece: dict[str, Any] | None = None) -> None:
        """A sampled token for ``seq`` (with the step's prompt logprobs ``piece``, if any).
        The hot path: a plain token of a rid already set up builds nothing."""
        self.rids.append(seq.rid)
        self.num_tokens.append(1)
        self.token_ids.append(token)
        if logprob is not None or piece or not seq.detok_spec_sent:
            self._rare(seq, (logprob,) if logprob is not None else (), piece)

    def tokens(self, seq: Sequence, tokens: tuple[int, ...], logprob: TokenLogprob | None,
               piece: dict[str, Any] | None = None) -> None:
        """A speculating row's tokens, in order (the Detokenizer sees each)."""
        self.rids.append(seq.rid)
        self.num_tokens.append(len(tokens))
        self.token_ids.extend(tokens)
        if logprob is not None or piece or not seq.detok_spec_sent:
            self._rare(seq, (logprob,) if logprob is not None else (), piece)

    def piece(self, seq: Sequence, piece: dict[str, Any]) -> None:
        """Prompt logprobs from a prefill chunk that sampled nothing."""
        self.rids.append(seq.rid)
        self.num_tokens.append(0)
        self._rare(seq, (), piece)

    def _rare(self, seq: Sequence, logprobs: tuple[TokenLogprob, ...],
              piece: dict[str, Any] | None) -> None:
        """What the last row carries besides its tokens."""
        self.rare_rows.append(len(self.rids) - 1)
        self.rare.append(TokenOut(seq.rid, logprobs=logprobs,
                                  **{**seq.first_output_fields(), **(piece or {})}))

    def final(self, seq: Sequence, reason: str, stop_reason: Any, error: str | None) -> None:
        """``seq``'s last output, in the row of this batch's token for it if that came last."""
        last = len(self.rids) - 1
        if last >= 0 and self.rids[last] == seq.rid:
            if not (self.rare_rows and self.rare_rows[-1] == last):
                self.rare_rows.append(last)
                self.rare.append(seq.final_output(reason, stop_reason, error))
                return
            if self.rare[-1].finish_reason is None:
                self.rare[-1] = seq.final_output(reason, stop_reason, error, self.rare[-1])
                return
        self.rids.append(seq.rid)
        self.num_tokens.append(0)
        self.rare_rows.append(last + 1)
        self.rare.append(seq.final_output(reason, stop_reason, error))

    def take(self, stats: Callable[[], SchedulerStats]) -> TokenBatch | None:
        """The batch of everything noted since the last call, if anything was."""
        if not (self.rids or self.freed or self.stats_changed):
            return None
        batch = TokenBatch(tuple(self.rids), tuple(self.num_tokens), tuple(self.token_ids),
                           tuple(self.rare_rows), tuple(self.rare), tuple(self.freed), stats())
        self.rids, self.num_tokens, self.token_ids = [], [], []
        self.rare_rows, self.rare, self.freed = [], [], []
        self.stats_changed = False
        return batch

