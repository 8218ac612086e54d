"""A StepPlan's columns while the Scheduler fills them, one row per scheduled sequence.

``Sequence.schedule_into`` (scheduler/sequence.py) appends its row; the Scheduler then
freezes the lists into a ``StepPlan``. No object per row is built on the way.
"""

from __future__ import annotations

from typing import Any

from actorllm.wire.messages import FEED_LAST_SAMPLE, AheadRows, NewSeqData, StepPlan


class PlanColumns:
    """The growing columns of one StepPlan (see ``StepPlan`` for what each holds)."""

    __slots__ = ("ahead_caps", "ahead_rows", "hist_from", "hist_num", "hist_tokens", "lookup",
                 "lp_from", "lp_rows", "new", "new_blocks", "new_rows", "num_drafts",
                 "num_new_blocks", "num_tokens", "rids", "sample", "start_pos", "token_ids")

    def __init__(self, lookup: tuple[int, int] = (1, 1)) -> None:
        """``lookup``: the n-gram lengths (min, max) the Worker's lookups for rows planned
        ahead try (AheadRows)."""
        self.rids: list[str] = []
        self.num_tokens: list[int] = []
        self.token_ids: list[int] = []
        self.start_pos: list[int] = []
        self.sample: list[bool] = []
        self.num_new_blocks: list[int] = []
        self.new_blocks: list[int] = []
        self.new_rows: list[int] = []
        self.new: list[NewSeqData] = []
        self.lp_rows: list[int] = []
        self.lp_from: list[int] = []
        self.num_drafts: list[int] = []  # filled only once a row speculates
        self.lookup = lookup
        # AheadRows' columns (see there), filled only once such a row is planned
        self.ahead_rows: list[int] = []
        self.ahead_caps: list[int] = []
        self.hist_from: list[int] = []
        self.hist_num: list[int] = []
        self.hist_tokens: list[int] = []

    @property
    def kinds(self) -> int:
        """How many kinds of n-gram match an ahead row's caps cover."""
        return self.lookup[1] - self.lookup[0] + 1

    def fill(self, planned: list[tuple[Any, int]]) -> None:
        """Append each planned (Sequence, tokens) row, as ``Sequence.schedule_into`` does
        (sequence.py imports this module: hence ``Any``).

        A plain decode row (one token, no drafts, known to the Worker, no prompt logprobs
        owed: nearly every row of a busy step) is written here in one go; any other goes
        through ``schedule_into``. Why: at 256 rows a step, the general method's checks
        and calls were about a third of planning (issue 28). Both must write the same
        row (the simulation and scheduler tests drive both)."""
        rids, num_tokens, token_ids = self.rids, self.num_tokens, self.token_ids
        start_pos, sample, num_new, new_blocks = (
            self.start_pos, self.sample, self.num_new_blocks, self.new_blocks)
        for seq, n in planned:
            if n != 1 or seq.drafts or not seq.worker_knows \
                    or seq.params.prompt_logprobs is not None or seq.drafts_in_flight:
                seq.schedule_into(self, n)
                continue
            start = seq.num_scheduled
            prompt = seq.prompt_ids
            p = len(prompt)
            known = p + len(seq.output_ids)
            if start < known:
                token_ids.append(prompt[start] if start < p else seq.output_ids[start - p])
            else:  # the token a step in flight samples (planned ahead)
                assert start == known and seq.samples_in_flight, seq
                token_ids.append(FEED_LAST_SAMPLE)
            flies = seq.samples_in_flight
            sampled = start + 1 == known + flies and seq.max_tokens > 0
            seq.num_scheduled = start + 1
            seq.in_flight += 1
            seq.samples_in_flight = flies + sampled
            rids.append(seq.rid)
            num_tokens.append(1)
            start_pos.append(start)
            sample.append(sampled)
            table, sent = seq.block_table, seq.blocks_sent
            num_new.append(len(table) - sent)
            if len(table) > sent:
                new_blocks.extend(table[sent:])
                seq.blocks_sent = len(table)

    def freeze(self, step_id: int, drop: tuple[str, ...]) -> StepPlan:
        """The finished plan."""
        if self.num_drafts:  # rows after the last speculating one draft nothing
            self.num_drafts.extend([0] * (len(self.rids) - len(self.num_drafts)))
        ahead = AheadRows(tuple(self.ahead_rows), tuple(self.ahead_caps), tuple(self.hist_from),
                          tuple(self.hist_num), tuple(self.hist_tokens),
                          *self.lookup) if self.ahead_rows else None
        return StepPlan(step_id, tuple(self.rids), tuple(self.num_tokens),
                        tuple(self.token_ids), tuple(self.start_pos), tuple(self.sample),
                        tuple(self.num_new_blocks), tuple(self.new_blocks),
                        tuple(self.new_rows), tuple(self.new), tuple(self.lp_rows),
                        tuple(self.lp_from), drop, tuple(self.num_drafts), ahead)
