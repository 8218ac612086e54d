"""The Scheduler's decisions, driven by hand: no threads, no model, no event loop.

Each test plays the Worker: it takes the plan, checks it, and hands back a result.
"""

from __future__ import annotations

import pytest
from sim.bugs import FreeBeforeFence

from actorllm.lifecycle.table import State
from actorllm.scheduler.actor import Scheduler
from actorllm.scheduler.kv_pool import BlockPool
from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import (
    AbortRequest,
    FlowControl,
    SampledToken,
    SamplingParams,
    SchedulerInput,
    SequenceRequest,
    StepPlan,
    StepResult,
    StopMatched,
    TokenBatch,
)

EOS = 1


def make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
         budget: int = 64, **kw: object) -> Scheduler:
    return Scheduler(Mailbox("s", SchedulerInput, 8), Mailbox("w", StepPlan, 2),
                     Mailbox("d", TokenBatch, 8), num_blocks=num_blocks,
                     block_size=block_size, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, **kw)  # type: ignore[arg-type]


def request(rid: str, prompt_len: int, max_tokens: int = 4, **params: object) -> SequenceRequest:
    return SequenceRequest(rid, tuple(range(10, 10 + prompt_len)),
                           SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
                           max_tokens, (EOS,))


def answer(plan: StepPlan, token: int = 7) -> StepResult:
    """Sample ``token`` for every sequence the plan asks to sample."""
    return StepResult.of_tokens(plan, (SampledToken(s.rid, token) for s in plan.seqs
                                       if s.sample))


def run_to_end(s: Scheduler, limit: int = 200) -> list[TokenBatch]:
    batches = []
    for _ in range(limit):
        plan = s.schedule()
        if plan is None:
            break
        s.handle(answer(plan))
        if (b := s.take_batch()) is not None:
            batches.append(b)
    return batches


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end() -> None:
    s = make(budget=8)
    s.handle(request("a", 20, max_tokens=2))
    plans = []
    for _ in range(3):
        plan = s.schedule()
        assert plan is not None
        plans.append(plan)
        s.handle(answer(plan))
    assert [len(p.seqs[0].token_ids) for p in plans] == [8, 8, 4]
    assert [p.seqs[0].start_pos for p in plans] == [0, 8, 16]
    assert [p.seqs[0].sample for p in plans] == [False, False, True]
    assert plans[0].seqs[0].new is not None and plans[1].seqs[0].new is None


def test_decode_and_prefill_mix_in_one_step_and_budget_holds() -> None:
    s = make(budget=10)
    s.handle(request("a", 3, max_tokens=5))
    s.handle(answer(s.schedule()))  # a is decoding now
    s.handle(request("b", 30))
    plan = s.schedule()
    assert [(x.rid, len(x.token_ids)) for x in plan.seqs] == [("a", 1), ("b", 9)]
    assert sum(len(x.token_ids) for x in plan.seqs) <= 10


def test_finish_reasons_eos_stop_token_length_and_min_tokens() -> None:
    s = make()
    s.handle(request("eos", 2, max_tokens=10))
    s.handle(request("min", 2, max_tokens=10, min_tokens=3))
    s.handle(request("stoptok", 2, max_tokens=10, stop_token_ids=(9,)))
    s.handle(request("ign", 2, max_tokens=3, ignore_eos=True))
    reasons: dict[str, tuple[str, object, int]] = {}
    for _ in range(10):
        plan = s.schedule()
        if plan is None:
            break
        toks = []
        for x in plan.seqs:
            toks.append(SampledToken(x.rid, 9 if x.rid == "stoptok" else EOS))
        s.handle(StepResult.of_tokens(plan, toks))
        for out in s.take_batch().outputs:
            if out.finish_reason:
                reasons[out.rid] = (out.finish_reason, out.stop_reason, len(out.token_ids))
    assert reasons["eos"][:2] == ("stop", None)
    assert reasons["stoptok"][:2] == ("stop", 9)
    assert reasons["ign"][:2] == ("length", None)
    assert reasons["min"][:2] == ("stop", None)
    assert not s.drain_problems()


def test_min_tokens_delays_eos() -> None:
    s = make()
    s.handle(request("m", 2, max_tokens=10, min_tokens=3))
    n_out = 0
    for _ in range(5):
        plan = s.schedule()
        if plan is None or not plan.seqs:
            break
        s.handle(StepResult.of_tokens(plan, (SampledToken("m", EOS),)))
        n_out += 1
    assert n_out == 3


def test_preemption_by_recompute_never_drops_a_request() -> None:
    # 6 blocks of 4 tokens; three prompts of 5 tokens growing to 12: they cannot all fit.
    s = make(num_blocks=6, block_size=4)
    for rid in "abc":
        s.handle(request(rid, 5, max_tokens=7, ignore_eos=True))
    batches = run_to_end(s)
    assert s.num_preemptions > 0
    tokens: dict[str, list[int]] = {}
    finished = {}
    for b in batches:
        for out in b.outputs:
            tokens.setdefault(out.rid, []).extend(out.token_ids)
            if out.finish_reason:
                finished[out.rid] = out.finish_reason
    assert finished == {"a": "length", "b": "length", "c": "length"}
    assert all(len(v) == 7 for v in tokens.values())
    assert not s.drain_problems()


@pytest.mark.parametrize("caching", [False, True])
def test_preempted_sequence_is_recomputed_with_its_outputs(caching: bool) -> None:
    s = make(num_blocks=3, block_size=4, enable_prefix_caching=caching)
    s.handle(request("a", 4, max_tokens=6, ignore_eos=True))
    s.handle(request("b", 4, max_tokens=6, ignore_eos=True))
    seen_new = []
    for _ in range(40):
        plan = s.schedule()
        if plan is None:
            break
        seen_new += [x for x in plan.seqs if x.new is not None and x.new.output_token_ids]
        s.handle(answer(plan))
    assert seen_new, "a preempted sequence comes back with its outputs for the Worker"
    again = seen_new[0]
    # With the cache its full prompt block is a hit (it stayed cached while preempted).
    start = 4 if caching else 0
    assert again.start_pos == start
    assert len(again.token_ids) == 4 + len(again.new.output_token_ids) - start
    assert not s.drain_problems()


def test_abort_of_a_waiting_request_frees_at_once() -> None:
    s = make(max_num_seqs=1)
    s.handle(request("a", 4))
    s.handle(request("b", 4))
    plan = s.schedule()
    assert [x.rid for x in plan.seqs] == ["a"]
    s.handle(AbortRequest("b"))
    batch = s.take_batch()
    assert [(o.rid, o.finish_reason) for o in batch.outputs] == [("b", "abort")]
    assert batch.freed == ("b",)


def test_abort_with_a_step_in_flight_frees_only_after_the_fence() -> None:
    s = make()
    s.handle(request("a", 8))
    plan = s.schedule()
    used = s.pool.num_used
    assert used > 0
    s.handle(AbortRequest("a"))
    batch = s.take_batch()
    assert [(o.rid, o.finish_reason) for o in batch.outputs] == [("a", "abort")]
    assert batch.freed == ()  # the step in flight still reads a's blocks
    assert s.pool.num_used == used
    s.handle(answer(plan))  # the fence: the step returns; its token for a is late
    batch = s.take_batch()
    assert batch.freed == ("a",) and batch.outputs == ()
    assert s.pool.num_used == 0
    assert s.late_results_dropped == 1
    # Double abort and abort after the end are no-ops.
    s.handle(AbortRequest("a"))
    s.handle(AbortRequest("a"))
    assert s.take_batch().outputs == ()
    s.handle(StepResult(s.schedule().step_id))  # the empty step that tells the Worker to forget
    assert not s.drain_problems()


def test_planted_bug_free_before_fence_is_visible() -> None:
    s = FreeBeforeFence(Mailbox("s", SchedulerInput, 8), Mailbox("w", StepPlan, 2),
                        Mailbox("d", TokenBatch, 8), num_blocks=64, block_size=4)
    s.handle(request("a", 8))
    s.schedule()
    s.handle(AbortRequest("a"))
    assert s.pool.num_used == 0  # blocks back while a step still uses them: the bug


def test_stale_and_duplicate_results_are_dropped_and_counted() -> None:
    s = make()
    s.handle(request("a", 2, max_tokens=3))
    plan = s.schedule()
    s.handle(answer(plan))
    s.handle(answer(plan))  # duplicate
    s.handle(StepResult(999))  # unknown
    assert s.late_results_dropped == 2


def test_stop_matched_finishes_a_running_sequence() -> None:
    s = make()
    s.handle(request("a", 2, max_tokens=10))
    s.handle(answer(s.schedule()))
    s.take_batch()
    s.handle(StopMatched("a", "xy"))
    batch = s.take_batch()
    assert [(o.rid, o.finish_reason, o.stop_reason) for o in batch.outputs] == [
        ("a", "stop", "xy")]
    s.handle(StopMatched("a", "xy"))  # late: the sequence is gone
    assert s.late_stops_dropped == 1


def test_stop_matched_finishes_a_preempted_sequence() -> None:
    # The Detokenizer may match a stop string in tokens made before a preemption: the
    # StopMatched then finds the sequence PREEMPTED (found by tests/test_simulation.py).
    s = make(num_blocks=3, block_size=4)
    s.handle(request("a", 4, max_tokens=6, ignore_eos=True))
    s.handle(request("b", 4, max_tokens=6, ignore_eos=True))
    for _ in range(40):
        plan = s.schedule()
        assert plan is not None
        s.handle(answer(plan))
        if s.num_preemptions:
            break
    victim = next(q for q in s.seqs.values() if q.status == "PREEMPTED")
    assert victim.output_ids, "it had made tokens before it was preempted"
    s.take_batch()
    s.handle(StopMatched(victim.rid, "xy", victim.incarnation))
    batch = s.take_batch()
    assert [(o.rid, o.finish_reason, o.stop_reason) for o in batch.outputs] == [
        (victim.rid, "stop", "xy")]
    run_to_end(s)
    assert not s.drain_problems() and s.pool.num_used == 0


def test_stop_matched_for_an_ended_request_spares_a_new_one_with_its_rid() -> None:
    s = make()
    s.handle(request("a", 2, max_tokens=1))
    s.handle(answer(s.schedule()))  # "a" ends by length...
    first = s.take_batch()
    assert first is not None and first.outputs[-1].finish_reason == "length"
    assert first.outputs[-1].spec is not None
    old_incarnation = first.outputs[-1].spec.incarnation
    run_to_end(s)  # ... and is freed
    s.handle(request("a", 2, max_tokens=10))  # a new request reuses the rid
    s.handle(answer(s.schedule()))
    s.take_batch()
    # ... while a stop the Detokenizer found in the old one's last token arrives late.
    s.handle(StopMatched("a", "xy", old_incarnation))
    assert s.take_batch().outputs == ()
    assert s.seqs["a"].status == "RUNNING" and s.late_stops_dropped == 1
    s.handle(StopMatched("a", "xy", s.seqs["a"].incarnation))  # its own stop still works
    assert [o.finish_reason for o in s.take_batch().outputs] == ["stop"]


def test_failed_step_fails_its_sequences_with_error() -> None:
    s = make()
    s.handle(request("a", 2))
    plan = s.schedule()
    s.handle(StepResult(plan.step_id, error="boom"))
    batch = s.take_batch()
    assert [(o.rid, o.finish_reason, o.error) for o in batch.outputs] == [("a", "error", "boom")]
    assert batch.freed == ("a",)
    assert not s.drain_problems()


def test_freed_rids_reach_the_worker_as_forget() -> None:
    s = make()
    s.handle(request("a", 2, max_tokens=1))
    s.handle(answer(s.schedule()))
    plan = s.schedule()  # nothing to run, but the Worker must let go of "a"
    assert plan is not None and plan.seqs == () and plan.drop == ("a",)
    s.handle(StepResult(plan.step_id))
    assert s.schedule() is None


def test_duplicate_live_rid_is_a_bug() -> None:
    s = make()
    s.handle(request("a", 2))
    with pytest.raises(AssertionError):
        s.handle(request("a", 2))


def test_a_pool_given_to_the_scheduler_is_the_one_it_plans_with() -> None:
    pool = BlockPool(64, 4)
    s = make(pool=pool)
    s.handle(request("a", 8))
    s.schedule()
    assert s.pool is pool and pool.num_used == 2  # 8 prompt tokens in blocks of 4
    with pytest.raises(ValueError, match="a pool of 64 x 4 given for 32 x 4"):
        make(num_blocks=32, pool=BlockPool(64, 4))


def test_paused_kv_goes_before_a_running_sequence_is_preempted() -> None:
    # Room for two 8-token prompts plus a little: "a" pauses and keeps its blocks until
    # "c" needs them; "b", running, is never preempted for it.
    s = make(num_blocks=5, block_size=4, budget=64)
    for rid in ("a", "b"):
        s.handle(request(rid, 8, max_tokens=8))
    plan = s.schedule()
    s.handle(answer(plan))
    s.handle(FlowControl("a", True))
    plan = s.schedule()
    assert [q.rid for q in plan.seqs] == ["b"] and list(s.paused) == ["a"]
    assert s.seqs["a"].block_table, "a paused sequence keeps its KV while nobody needs it"
    s.handle(answer(plan))
    # Other tokens than a's and b's, so no prefix-cache hit makes room for it.
    s.handle(SequenceRequest("c", tuple(range(50, 58)), SamplingParams(max_tokens=2), 2,
                             (EOS,)))
    plan = s.schedule()
    assert {q.rid for q in plan.seqs} == {"b", "c"}
    assert not s.seqs["a"].block_table and s.seqs["a"].status is State.PAUSED
    assert s.num_preemptions == 1 and list(s.paused) == ["a"]
    s.handle(answer(plan))
    s.handle(FlowControl("a", False))  # its reader caught up: it recomputes
    run_to_end(s)
    assert not s.drain_problems()


def test_a_decode_step_goes_to_the_detokenizer_as_columns_without_objects() -> None:
    # Issue 28: a plain token is three list entries; only a rid's first row (its
    # DetokSetup) and its finish get a TokenOut, and the finish shares its token's row.
    s = make()
    for rid in ("a", "b"):
        s.handle(request(rid, 3, max_tokens=3))
    first, middle, last, *frees = run_to_end(s)
    assert all(b.rids == () for b in frees)
    assert first.rids == ("a", "b") and first.token_ids == (7, 7)
    assert first.rare_rows == (0, 1) and all(o.spec is not None for o in first.rare)
    assert middle.rids == ("a", "b") and middle.num_tokens == (1, 1)
    assert middle.rare_rows == () and middle.rare == ()
    assert last.rids == ("a", "b") and last.token_ids == (7, 7)
    assert [(o.rid, o.finish_reason, o.token_ids) for o in last.rare] == [
        ("a", "length", ()), ("b", "length", ())]
    assert [(o.rid, o.token_ids, o.finish_reason) for o in last.outputs] == [
        ("a", (7,), "length"), ("b", (7,), "length")]
