"""Hand-written steps for the tests that play the Scheduler or the Worker.

Tests write a step's rows with each sequence's whole block table (``ScheduledSeq``'s
``new_blocks`` field holding the table); :class:`Plans` sends them as the diffs a
``StepPlan`` carries, tracking what the Worker has seen exactly as the Scheduler does:
a ``NewSeqData`` row sends its whole table, a dropped rid starts over. :class:`Ran` is a
result read with its plan, so ``.tokens`` names each sampled token's rid again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from actorllm.wire.messages import SampledToken, ScheduledSeq, StepPlan, StepResult


class Plans:
    """StepPlans from rows with whole block tables, as diffs against what was sent."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}  # rid -> how many of its blocks the Worker has

    def plan(self, step_id: int, rows: Iterable[ScheduledSeq],
             drop: tuple[str, ...] = ()) -> StepPlan:
        diffs = []
        for r in rows:
            seen = 0 if r.new is not None else self.sent.get(r.rid, 0)
            diffs.append(attrs.evolve(r, new_blocks=r.new_blocks[seen:]))
            self.sent[r.rid] = len(r.new_blocks)
        for rid in drop:
            self.sent.pop(rid, None)
        return StepPlan.of_rows(step_id, diffs, drop)


@attrs.frozen
class Ran:
    """A StepResult with the plan it answers: ``tokens`` has the rids, the rest is the
    result's."""

    plan: StepPlan
    result: StepResult

    @property
    def tokens(self) -> tuple[SampledToken, ...]:
        if self.result.error is not None:
            return ()
        return self.result.sampled(self.plan)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.result, name)


def execute(runner: Any, step_id: int, rows: Iterable[ScheduledSeq] = (),
            drop: tuple[str, ...] = (), plans: Plans | None = None) -> Ran:
    """Run one hand-written step on ``runner`` (a fresh ``Plans``: every table whole)."""
    plan = (plans or Plans()).plan(step_id, rows, drop)
    return Ran(plan, runner.execute(plan))


def answer(plan: StepPlan, tokens: Iterable[SampledToken], **fields: Any) -> StepResult:
    """The result that samples ``tokens`` (by rid) for ``plan``'s sampling rows."""
    return StepResult.of_tokens(plan, tokens, **fields)


class Tables:
    """Every rid's whole block table as the Worker holds it, rebuilt from the plans'
    diffs (apply each plan once, in order)."""

    def __init__(self) -> None:
        self.held: dict[str, list[int]] = {}

    def apply(self, plan: StepPlan) -> dict[str, tuple[int, ...]]:
        """Apply ``plan``; returns the whole table of each of its rows."""
        rows = plan.seqs
        last = {r.rid for r in rows if r.new is None}  # dropped after this step
        for rid in plan.drop:
            if rid not in last:
                self.held.pop(rid, None)
        out = {}
        for r in rows:
            if r.new is not None:
                self.held[r.rid] = []
            table = self.held.setdefault(r.rid, [])
            table.extend(r.new_blocks)
            out[r.rid] = tuple(table)
        for rid in plan.drop:
            if rid in last:
                self.held.pop(rid, None)
        return out
