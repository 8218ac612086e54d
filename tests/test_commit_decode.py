"""A plain decode step's result is committed by a path of its own (issue 28).

``Scheduler._commit_decode`` (scheduler/commit.py) does in one pass what ``on_result``
and ``_commit`` do for any step. The Scheduler is driven by hand through decode steps
(with a step planned ahead, aborts while steps run, sequences ending on EOS, on a stop
token and on ``max_tokens``), once as it runs and once with the plain path turned off,
and the two must agree on everything they say and keep: every ``TokenBatch``, every
sequence's counters, the fence, the pool and the counts of dropped rows.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples

import actorllm.scheduler.commit as commit
from actorllm.scheduler.actor import Scheduler
from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import (
    SamplingParams,
    SchedulerInput,
    SequenceRequest,
    StepPlan,
    StepResult,
    TokenBatch,
)

EOS = 1


@st.composite
def runs(draw: st.DrawFn) -> dict[str, Any]:
    """Requests, whether a step is planned ahead, and per step: the tokens drawn (EOS and
    stop tokens among them) and the rids aborted before it."""
    n = draw(st.integers(1, 6))
    reqs = []
    for i in range(n):
        prompt = draw(st.lists(st.integers(2, 60), min_size=1, max_size=7))
        max_tokens = draw(st.integers(1, 5))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=draw(st.booleans()),
                                min_tokens=draw(st.integers(0, 1)),
                                stop_token_ids=draw(st.sampled_from([(), (7,)])))
        reqs.append(SequenceRequest(f"r{i}", tuple(prompt), params, max_tokens, (EOS,)))
    steps = draw(st.integers(1, 7))
    return {"reqs": reqs, "ahead": draw(st.booleans()),
            "tokens": [draw(st.lists(st.sampled_from([EOS, 7, 9, 11, 12]), min_size=n,
                                     max_size=n)) for _ in range(steps)],
            "aborts": [draw(st.lists(st.integers(0, n - 1), max_size=2)) for _ in range(steps)]}


def _drive(case: dict[str, Any]) -> tuple[list[Any], list[int]]:
    """Run ``case`` on a fresh Scheduler: what it said and kept after each result, and
    how many results the plain decode path committed."""
    sched = Scheduler(Mailbox("s", SchedulerInput, 8), Mailbox("w", StepPlan, 2),
                      Mailbox("d", TokenBatch, 8), num_blocks=64, block_size=4,
                      max_num_seqs=8, max_num_batched_tokens=64,
                      max_steps_in_flight=2 if case["ahead"] else 1)
    plain: list[int] = []
    real = sched._commit_decode

    def counted(plan: StepPlan, tokens: tuple[int, ...]) -> None:
        plain.append(plan.step_id)
        real(plan, tokens)

    sched._commit_decode = counted  # type: ignore[method-assign]
    for req in case["reqs"]:
        sched.handle(req)
    log: list[Any] = []
    for tokens, aborts in zip(case["tokens"], case["aborts"], strict=True):
        while len(sched.in_flight) < sched.max_steps_in_flight and sched.schedule():
            pass
        for i in aborts:
            sched.finish_early(f"r{i}", "abort")
        if not sched.in_flight:
            break
        plan = sched.in_flight[0]
        sampled = sum(plan.sample)
        sched.handle(StepResult(plan.step_id, tuple(tokens[:sampled]) + (EOS,) * max(
            0, sampled - len(tokens))))
        batch = sched.take_batch()
        log.append((attrs.evolve(batch, stats=None) if batch is not None else None,
                    sorted((s.rid, s.status.name, s.num_computed, s.num_scheduled,
                            s.in_flight, s.samples_in_flight, tuple(s.output_ids),
                            s.num_registered, tuple(s.block_table))
                           for s in sched.seqs.values()),
                    sorted(s.rid for s in sched.fenced), sched.pool.num_used,
                    sched.late_results_dropped, sched.ahead_tokens_dropped))
    return log, plain


@settings(max_examples=examples(200), deadline=None)
@given(runs())
def test_a_plain_decode_step_commits_as_any_step_does(case: dict[str, Any]) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(commit, "plain_decode", lambda *a: False)
        general, none = _drive(case)
    assert not none
    plain, _ = _drive(case)
    assert plain == general


def test_the_plain_path_takes_the_decode_steps() -> None:
    """A prefill step goes the general way, the decode steps after it the plain one."""
    reqs = [SequenceRequest(f"r{i}", (5, 6, 7), SamplingParams(max_tokens=3), 3, (EOS,))
            for i in range(3)]
    _, plain = _drive({"reqs": reqs, "ahead": False, "tokens": [[9, 9, 9]] * 3,
                       "aborts": [[]] * 3})
    assert plain == [1, 2]
