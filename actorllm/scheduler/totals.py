"""The Scheduler's running totals of its steps, sent in every ``SchedulerStats``: how many
steps and sequence-steps ran, and the seconds each phase of them took (the per-step
breakdown of issue 28: one ``perf_counter`` pair per step and phase, never per token)."""

from __future__ import annotations

from typing import Any

import attrs

from actorllm.wire.steps import StepResult

# A Worker "waited" for a step's plan (SchedulerStats.worker_waited, which the write
# pacing reads) when it sat idle for more than this share of the step's own time. Without
# overlap scheduling (offline, or while requests arrive: Scheduler.quiet_s) every plan is
# made after the last result, so a short wait is the Scheduler's commit and plan, not a
# loop that starves the Worker; holding writes could win back at most the wait, not worth
# a step of latency.
WAITED_SHARE = 0.25


@attrs.define
class StepTotals:
    steps: int = 0
    seq_steps: int = 0  # the rows of every step: a sequence in one step is one
    forward_s: float = 0.0
    sample_s: float = 0.0
    pack_s: float = 0.0  # the Worker's three, from each StepResult
    plan_s: float = 0.0
    commit_s: float = 0.0  # the Scheduler's own two
    plan_wait_s: float = 0.0  # the Worker idle between steps, waiting for a plan
    worker_waited: int = 0  # 1: it waited long for the latest step's plan (not a total)

    def add_result(self, result: StepResult, rows: int) -> None:
        """A step of ``rows`` sequences came back."""
        self.steps += 1
        self.seq_steps += rows
        self.forward_s += result.forward_s
        self.sample_s += result.sample_s
        self.pack_s += result.pack_s
        self.plan_wait_s += result.plan_wait_s
        busy = result.pack_s + result.forward_s + result.sample_s
        self.worker_waited = int(result.plan_wait_s > WAITED_SHARE * busy)

    def fields(self) -> dict[str, Any]:
        """As ``SchedulerStats`` keyword arguments."""
        return attrs.asdict(self)
