"""A StepPlan's columns while the Scheduler fills them, one row per scheduled sequence.

``Sequence.schedule_into`` (scheduler/sequence.py) appends its row; the Scheduler then
freezes the lists into a ``StepPlan``. No object per row is built on the way.
"""

from __future__ import annotations

from actorllm.wire.messages import NewSeqData, StepPlan


class PlanColumns:
    """The growing columns of one StepPlan (see ``StepPlan`` for what each holds)."""

    __slots__ = ("lp_from", "lp_rows", "new", "new_blocks", "new_rows", "num_drafts",
                 "num_new_blocks", "num_tokens", "rids", "sample", "start_pos", "token_ids")

    def __init__(self) -> None:
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

    def freeze(self, step_id: int, drop: tuple[str, ...]) -> StepPlan:
        """The finished plan."""
        if self.num_drafts:  # rows after the last speculating one draft nothing
            self.num_drafts.extend([0] * (len(self.rids) - len(self.num_drafts)))
        return StepPlan(step_id, tuple(self.rids), tuple(self.num_tokens),
                        tuple(self.token_ids), tuple(self.start_pos), tuple(self.sample),
                        tuple(self.num_new_blocks), tuple(self.new_blocks),
                        tuple(self.new_rows), tuple(self.new), tuple(self.lp_rows),
                        tuple(self.lp_from), drop, tuple(self.num_drafts))
