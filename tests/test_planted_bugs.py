"""Each invariant's check can fail: plant a deliberately wrong variant of one actor (a
subclass in tests/sim/bugs.py; production code has no switches for it), and the
simulation must find a counterexample that names that invariant.

A property test that cannot fail proves nothing; these show that the harness of
tests/test_simulation.py would catch each kind of bug DESIGN.md §3 rules out:

==========================================  =====  ==============================================
bug                                         inv.   the wrong variant
==========================================  =====  ==============================================
frontend.bug_register_after_dispatch        1      GenerateRequest sent before the rid exists
detokenizer.bug_emit_after_stop             2      text delivered after the stop string matched
frontend.bug_reuse_live_rid                 2      a rid accepted while it is still live
scheduler.bug_free_before_fence             3      an aborted sequence's blocks freed while a
                                                   step that uses them is still in flight
scheduler.bug_fence_one_step                3      with two steps in flight, blocks freed when
                                                   the first step naming them returns, while
                                                   the step planned ahead still reads them
worker.bug_ignore_forget                    4      the Worker keeps state for freed rids
worker.bug_stale_block_row                  9      a block-table row let go is reused by the
                                                   next rid without being emptied
frontend.bug_skip_child_abort               5      aborting a n>1 parent misses a child
frontend.bug_end_parent_early               6      a n>1 parent gathered at its first child's end
collector.bug_drop_merged                   7      a slow reader's merged text loses a delta
scheduler.bug_rereport_prompt_logprobs      7      a recompute after preemption reports prompt
                                                   logprobs the client already has
scheduler.bug_cache_shared_block            8      a shared cached block turns evictable when
                                                   one of its holders lets go
scheduler.bug_keep_evicted_hash             9      an evicted block is reused while its old
                                                   hash still finds it
scheduler.bug_share_without_reference       10     a prefix-cache hit on a block in use takes
                                                   no reference
scheduler.bug_pause_keeps_slot              11      a paused sequence keeps its running slot
frontend.bug_never_resume                   11      a reader that catches up is never resumed
frontend.bug_drop_on_pause                  7      a pause drops what the reader had not read
tokenizer.bug_tokenize_big_aside            5      a big prompt tokenized aside: the abort that
                                                   came behind it reaches the Scheduler first
frontend.bug_lose_skips_answered            4      after the engine died, an answered request
                                                   not yet freed stays registered for ever
frontend.bug_timeout_without_abort          5      a stream timeout fails the reader but never
                                                   aborts the request
scheduler.bug_preempt_ahead                 3      priority, two steps in flight: an urgent
                                                   arrival preempts a sequence a step still reads
scheduler.bug_commit_rejected_draft         7      speculation: a rejected draft token is
                                                   committed and reaches the output
scheduler.bug_free_draft_blocks_early       3      speculation: blocks holding only draft
                                                   positions freed while the draft step runs
scheduler.bug_hash_rejected_draft           9      speculation: a block hashed over a position
                                                   whose K/V a rejected draft wrote
worker.bug_unfilled_placeholder             9      draft model: the target runs the Scheduler's
                                                   placeholders, the verdict accepts the draft's
                                                   tokens (K/V over the wrong tokens)
worker.bug_draft_skips_last_pass            9      draft model: d_K's K/V is never written in
                                                   the draft's cache, read once all K accepted
==========================================  =====  ==============================================

The three after bug_pause_keeps_slot run with flow control on (``SimConfig.flow``,
tests/test_simulation.py's FLOW); the last four each in the configuration that enables
what they break (``EXTRA`` below: big prompts through the Tokenizer's thread hop, engine
death, a stream timeout, the priority policy).

Each run stops at the first counterexample (no shrinking: only finding it matters here).
The searches run on the simulation's pinned constants (``sim.profiles``), derandomized
under every profile (``FIND``), so they explore the same examples whatever else the
process has imported and whichever profile runs; a control shows that, with the
checks silenced, the examples that caught a bug pass.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from sim import InvariantViolation, SimConfig, TextModel, World, make_machine
from sim.bugs import COLLECTOR_BUGS
from sim.bugs import PLANTED as PLANTED_BUGS
from sim.profiles import examples_independent_of_loaded_modules

from actorllm.frontend.collector import OutputCollector
from actorllm.frontend.readers import FlowLimits
from actorllm.wire.outputs import Merged

PLANTED = [
    ("frontend.bug_register_after_dispatch", "1"),
    ("detokenizer.bug_emit_after_stop", "2"),
    ("frontend.bug_reuse_live_rid", "2"),
    ("scheduler.bug_free_before_fence", "3"),
    ("scheduler.bug_fence_one_step", "3"),
    ("worker.bug_ignore_forget", "4"),
    ("worker.bug_stale_block_row", "9"),
    ("frontend.bug_skip_child_abort", "5"),
    ("frontend.bug_end_parent_early", "6"),
    ("collector.bug_drop_merged", "7"),
    ("scheduler.bug_rereport_prompt_logprobs", "7"),
    ("scheduler.bug_cache_shared_block", "8"),
    ("scheduler.bug_keep_evicted_hash", "9"),
    ("scheduler.bug_share_without_reference", "10"),
    ("scheduler.bug_pause_keeps_slot", "11"),
    ("frontend.bug_never_resume", "11"),
    ("frontend.bug_drop_on_pause", "7"),
    ("tokenizer.bug_tokenize_big_aside", "5"),
    ("frontend.bug_lose_skips_answered", "4"),
    ("frontend.bug_timeout_without_abort", "5"),
    ("scheduler.bug_preempt_ahead", "3"),
    ("scheduler.bug_commit_rejected_draft", "7"),
    ("scheduler.bug_free_draft_blocks_early", "3"),
    ("scheduler.bug_hash_rejected_draft", "9"),
    ("worker.bug_unfilled_placeholder", "9"),
    ("worker.bug_draft_skips_last_pass", "9"),
]
FLOW_BUGS = {"scheduler.bug_pause_keeps_slot", "frontend.bug_never_resume",
             "frontend.bug_drop_on_pause"}
FLOW = FlowLimits(max_bytes_per_request=12, max_bytes=None, stream_timeout=None)
# What each newer bug needs switched on to be reachable at all.
EXTRA: dict[str, dict[str, Any]] = {
    "tokenizer.bug_tokenize_big_aside": {"inline_chars": 14},
    "frontend.bug_lose_skips_answered": {"engine_death": True},
    # (No byte marks: a paused request left paused would be found as 11 first.)
    "frontend.bug_timeout_without_abort": {"flow": FlowLimits(
        max_bytes_per_request=None, max_bytes=None, stream_timeout=5.0)},
    "scheduler.bug_preempt_ahead": {"scheduling_policy": "priority", "max_num_seqs": 2},
    "scheduler.bug_commit_rejected_draft": {"speculative": True},
    "scheduler.bug_free_draft_blocks_early": {"speculative": True},
    "scheduler.bug_hash_rejected_draft": {"speculative": True},
    "worker.bug_unfilled_placeholder": {"speculative": True, "draft_model": True},
    "worker.bug_draft_skips_last_pass": {"speculative": True, "draft_model": True},
}

# Derandomized under every profile. These searches show that each check can fail, which
# a fixed search shows as well as a new one; under `long`'s new examples a planted bug's
# damage sometimes trips another invariant first (a paused sequence kept in the batch: its
# blocks freed while a step in flight used them, 3) or an assertion of the actor it
# corrupted (`Sequence`'s own; 6 of 14 runs there ended in such an assertion).
FIND = settings(
    derandomize=True,
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
    flow = FLOW if seam in FLOW_BUGS else None
    config = SimConfig(bugs=frozenset({seam}), **{"flow": flow, **EXTRA.get(seam, {})})
    machine = make_machine(tiny_tokenizer, config, name=f"Planted_{seam.replace('.', '_')}")
    with pytest.raises(InvariantViolation) as found, examples_independent_of_loaded_modules():
        run_state_machine_as_test(machine, settings=FIND)
    assert found.value.invariant == invariant, str(found.value)


def test_every_bug_is_planted_and_only_where_asked(tiny_tokenizer: Any) -> None:
    """Each name swaps in its variant for its actor alone; by default every actor is real."""
    assert {s for s, _ in PLANTED} == PLANTED_BUGS.keys() | COLLECTOR_BUGS.keys()
    world = World(tiny_tokenizer, TextModel(tiny_tokenizer))
    try:
        for actor in world.actors.values():
            assert not isinstance(actor, tuple(PLANTED_BUGS.values())), actor
            assert not [a for a in dir(actor) if a.startswith("bug_")], actor
    finally:
        world.close()
    assert type(OutputCollector("probe", 1)._merged(0)) is Merged
    for seam, variant in PLANTED_BUGS.items():
        world = World(tiny_tokenizer, TextModel(tiny_tokenizer), SimConfig(bugs=frozenset({seam})))
        try:
            buggy = [name for name, a in world.actors.items()
                     if isinstance(a, tuple(PLANTED_BUGS.values()))]
            assert buggy == [seam.split(".")[0]], seam
            assert isinstance(world.actors[buggy[0]], variant), seam
        finally:
            world.close()
    with pytest.raises(ValueError, match="no planted bug"):
        World(tiny_tokenizer, TextModel(tiny_tokenizer), SimConfig(bugs=frozenset({"x.bug_y"})))


def test_a_planted_bug_escapes_when_nothing_checks(
        tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: every check reports through ``World.report``; silence it, and the very
    examples that caught a planted bug pass, so what catches the bugs above is the checks
    (not a crash the bug happens to cause)."""
    seam, invariant = "frontend.bug_reuse_live_rid", "2"
    config = SimConfig(bugs=frozenset({seam}))
    machine = make_machine(tiny_tokenizer, config, name=f"Planted_{seam.replace('.', '_')}")
    with pytest.raises(InvariantViolation) as found, examples_independent_of_loaded_modules():
        run_state_machine_as_test(machine, settings=FIND)
    assert found.value.invariant == invariant, str(found.value)
    needed = machine.reached["examples"] + 1  # those that passed, then the one that failed
    monkeypatch.setattr(World, "report", lambda self, invariant, message: None)
    machine = make_machine(tiny_tokenizer, config, name=f"Planted_{seam.replace('.', '_')}")
    with examples_independent_of_loaded_modules():
        run_state_machine_as_test(machine, settings=settings(FIND, max_examples=needed))
    assert machine.reached["examples"] == needed  # the same examples ran, and passed
