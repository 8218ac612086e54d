"""Each invariant's check can fail: plant a deliberately wrong variant through a test-only
seam, and the simulation must find a counterexample that names that invariant.

A property test that cannot fail proves nothing; these show that the harness of
tests/test_simulation.py would catch each kind of bug DESIGN.md §3 rules out:

==========================================  =====  ==============================================
seam                                        inv.   the wrong variant
==========================================  =====  ==============================================
frontend.bug_register_after_dispatch        1      TokenizeRequest sent before the rid exists
detokenizer.bug_emit_after_stop             2      text delivered after the stop string matched
frontend.bug_reuse_live_rid                 2      a rid accepted while it is still live
scheduler.bug_free_before_fence             3      an aborted sequence's blocks freed while a
                                                   step that uses them is still in flight
worker.bug_ignore_forget                    4      the Worker keeps state for freed rids
frontend.bug_skip_child_abort               5      aborting a n>1 parent misses a child
frontend.bug_end_parent_early               6      a n>1 parent gathered at its first child's end
collector.bug_drop_merged                   7      a slow reader's merged text loses a delta
scheduler.bug_rereport_prompt_logprobs      7      a recompute after preemption reports prompt
                                                   logprobs the client already has
==========================================  =====  ==============================================

Each run stops at the first counterexample (no shrinking: only finding it matters here).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from sim import InvariantViolation, SimConfig, TextModel, World, make_machine

from actorllm.outputs import OutputCollector

PLANTED = [
    ("frontend.bug_register_after_dispatch", "1"),
    ("detokenizer.bug_emit_after_stop", "2"),
    ("frontend.bug_reuse_live_rid", "2"),
    ("scheduler.bug_free_before_fence", "3"),
    ("worker.bug_ignore_forget", "4"),
    ("frontend.bug_skip_child_abort", "5"),
    ("frontend.bug_end_parent_early", "6"),
    ("collector.bug_drop_merged", "7"),
    ("scheduler.bug_rereport_prompt_logprobs", "7"),
]

FIND = settings(
    max_examples=3000,  # a ceiling: each is found in well under a few hundred
    stateful_step_count=30,
    phases=[Phase.generate],
    database=None,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize(("seam", "invariant"), PLANTED, ids=[s for s, _ in PLANTED])
def test_planted_bug_is_caught(tiny_tokenizer: Any, seam: str, invariant: str) -> None:
    machine = make_machine(tiny_tokenizer, SimConfig(bugs=frozenset({seam})),
                           name=f"Planted_{seam.replace('.', '_')}")
    with pytest.raises(InvariantViolation) as found:
        run_state_machine_as_test(machine, settings=FIND)
    assert found.value.invariant == invariant, str(found.value)


def test_every_seam_exists_and_is_off_by_default(tiny_tokenizer: Any) -> None:
    world = World(tiny_tokenizer, TextModel(tiny_tokenizer))
    try:
        owners = {**world.actors, "collector": OutputCollector("probe", 1)}
        for seam, _ in PLANTED:
            actor, flag = seam.split(".")
            assert getattr(owners[actor], flag) is False, seam
    finally:
        world.close()
