"""ModelRunner on hand-written StepPlans against transformers greedy; the Worker actor."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing
from helpers import hf_greedy, hf_model
from steps import Plans, Ran, execute

from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import (
    NewSeqData,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    StepResult,
)
from actorllm.worker.actor import Worker
from actorllm.worker.runner import ModelRunner

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, logprobs=2)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_dir, num_blocks=64, block_size=BLOCK_SIZE)


class Script:
    """A toy scheduler: scrambled block tables, chunked prefill, greedy decode."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.step_id = 0
        self.plans = Plans()

    def seq(self, rid: str, tokens: list[int], start: int, sample: bool, new: NewSeqData | None):
        table = self.tables.setdefault(rid, [])
        while len(table) * BLOCK_SIZE < start + len(tokens):
            table.append(self.free.pop())
        return ScheduledSeq(rid, tuple(tokens), start, tuple(table), sample, new)

    def step(self, *seqs: ScheduledSeq, drop: tuple[str, ...] = ()) -> Ran:
        self.step_id += 1
        result = execute(self.runner, self.step_id, seqs, drop, self.plans)
        assert result.error is None, result.error
        return result

    def release(self, rid: str) -> None:
        self.free += self.tables.pop(rid)


def test_two_sequences_chunked_prefill_then_decode(runner: ModelRunner, tiny_llama_dir: Path):
    hf = hf_model(tiny_llama_dir)
    prompts = {"a": [0, *range(20, 43)], "b": [0, 5, 300, 301, 9]}  # 24 and 5 tokens
    want = {rid: hf_greedy(hf, p, 10) for rid, p in prompts.items()}
    s = Script(runner)
    a, b = prompts["a"], prompts["b"]
    new_a, new_b = NewSeqData(GREEDY, tuple(a)), NewSeqData(GREEDY, tuple(b))

    # a: prefill in chunks of 10 / 10 / 4; b joins in a's last chunk step.
    assert s.step(s.seq("a", a[:10], 0, False, new_a)).tokens == ()
    assert s.step(s.seq("a", a[10:20], 10, False, None)).tokens == ()
    r = s.step(s.seq("a", a[20:], 20, True, None), s.seq("b", b, 0, True, new_b))
    got = {t.rid: [t.token_id] for t in r.tokens}
    lps = {t.rid: [t.logprob] for t in r.tokens}
    for _ in range(9):
        r = s.step(
            *(
                s.seq(rid, [got[rid][-1]], len(prompts[rid]) + len(got[rid]) - 1, True, None)
                for rid in ("b", "a")  # order differs from the first step on purpose
            )
        )
        assert [t.rid for t in r.tokens] == ["b", "a"]
        for t in r.tokens:
            got[t.rid].append(t.token_id)
            lps[t.rid].append(t.logprob)
        assert r.forward_s > 0 and r.sample_s > 0

    for rid in prompts:
        assert got[rid] == want[rid][0]
        assert [lp.logprob for lp in lps[rid]] == pytest.approx(want[rid][1], abs=1e-4)
        assert all(lp.top[0][0] == lp.token_id and len(lp.top) == 2 for lp in lps[rid])
    s.step(drop=("a", "b"))
    assert runner.num_states == 0


def test_preempted_sequence_resumes_identically(runner: ModelRunner, tiny_llama_dir: Path):
    prompt = [0, *range(100, 110)]
    want, _ = hf_greedy(tiny_llama_dir, prompt, 8)
    s = Script(runner, seed=1)
    out = [s.step(s.seq("p", prompt, 0, True, NewSeqData(GREEDY, tuple(prompt)))).tokens[0]]
    for _ in range(3):
        pos = len(prompt) + len(out) - 1
        out.append(s.step(s.seq("p", [out[-1].token_id], pos, True, None)).tokens[0])
    ids = [t.token_id for t in out]
    # Preempt: blocks and state go; the sequence comes back as a prefill of prompt + output.
    s.release("p")
    s.step(drop=("p",))
    assert runner.num_states == 0
    new = NewSeqData(GREEDY, tuple(prompt), tuple(ids))
    ids.append(s.step(s.seq("p", prompt + ids, 0, True, new)).tokens[0].token_id)
    for _ in range(3):
        pos = len(prompt) + len(ids) - 1
        ids.append(s.step(s.seq("p", [ids[-1]], pos, True, None)).tokens[0].token_id)
    assert ids == want
    s.step(drop=("p",))


SEEDED = SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.3,
                        presence_penalty=0.4, seed=5, max_tokens=64)
OTHERS = {"b": (SamplingParams(temperature=0.8, repetition_penalty=1.2), [0, 7, 8, 7]),
          "c": (SamplingParams(temperature=0.0, frequency_penalty=0.5), [0, 9]),
          "d": (SamplingParams(temperature=1.2, top_p=0.8, seed=9), [0, 3, 3])}


def _seeded_run(runner: ModelRunner, others: tuple[str, ...], preempt_at: int | None,
                seed: int) -> list[int]:
    """Eight tokens of the seeded, penalized "a" beside ``others``; with ``preempt_at``,
    "a" is preempted by recompute after that many tokens (its slot may change)."""
    prompt = [0, 5, 300, 301, 9, 17]
    s = Script(runner, seed=seed)
    rows = [s.seq("a", prompt, 0, True, NewSeqData(SEEDED, tuple(prompt)))]
    rows += [s.seq(r, OTHERS[r][1], 0, True, NewSeqData(OTHERS[r][0], tuple(OTHERS[r][1])))
             for r in others]
    out: dict[str, list[int]] = {r: [] for r in ("a", *others)}
    prompts = {"a": prompt, **{r: OTHERS[r][1] for r in others}}
    while len(out["a"]) < 8:
        for t in s.step(*rows).tokens:
            out[t.rid].append(t.token_id)
        if len(out["a"]) == preempt_at:
            s.release("a")
            s.step(drop=("a",))
            # Another sequence may take its slot before it comes back.
            s.step(s.seq("z", [0, 1], 0, True, NewSeqData(SEEDED, (0, 1))))
            new = NewSeqData(SEEDED, tuple(prompt), tuple(out["a"]))
            rows = [s.seq("a", prompt + out["a"], 0, True, new)]
        else:
            rows = [s.seq("a", [out["a"][-1]], len(prompt) + len(out["a"]) - 1, True, None)]
        rows += [s.seq(r, [out[r][-1]], len(prompts[r]) + len(out[r]) - 1, True, None)
                 for r in others]
    s.step(drop=("a", *others, *(("z",) if preempt_at else ())))
    return out["a"]


def test_seeded_penalized_rows_ignore_batch_and_preemption(runner: ModelRunner):
    """A seeded row's tokens depend on its own logits and (seed, position) only: not on
    the rows beside it (penalized, greedy, seeded, unseeded), its slot, or a preemption."""
    alone = _seeded_run(runner, (), None, seed=3)
    assert _seeded_run(runner, ("b", "c", "d"), None, seed=4) == alone
    assert _seeded_run(runner, ("d", "b"), 3, seed=5) == alone
    assert runner.num_states == 0


def test_forget_together_with_the_same_rid(runner: ModelRunner):
    s = Script(runner, seed=2)
    # With `new`: the old state goes first, the new one stays (a preempted rid re-sent).
    r = s.step(s.seq("x", [0, 1, 2], 0, True, NewSeqData(GREEDY, (0, 1, 2))), drop=("x",))
    assert len(r.tokens) == 1 and runner.num_states == 1
    # Without `new`: this is the rid's last step; it samples, then its state goes.
    r = s.step(s.seq("x", [r.tokens[0].token_id], 3, True, None), drop=("x",))
    assert len(r.tokens) == 1 and runner.num_states == 0


def test_failing_step_returns_an_error_and_the_runner_goes_on(runner: ModelRunner):
    short_table = ScheduledSeq("bad", tuple(range(10)), 0, (1,), True, NewSeqData(GREEDY, (1,)))
    result = execute(runner, 7, (short_table,), drop=())
    assert result.step_id == 7 and result.tokens == ()
    assert result.error is not None and "block table" in result.error
    unknown = execute(runner, 8, (ScheduledSeq("ghost", (5,), 3, (0,), True),))
    assert unknown.error is not None and "ghost" in unknown.error
    fine = ScheduledSeq("bad", (1, 2), 0, (4,), True, NewSeqData(GREEDY, (1, 2)))
    ok = execute(runner, 9, (fine,))
    assert ok.error is None and len(ok.tokens) == 1
    execute(runner, 10, (), drop=("bad",))
    assert runner.num_states == 0


def test_batches_promise_valid_slots_only_after_checking_the_tables(runner: ModelRunner):
    """``ForwardBatch.slots_valid`` lets the attention backend skip its look for -1 slots;
    it holds because _prepare refuses any block-table entry outside the cache."""
    with pytest.raises(ValueError, match="out of range"):
        runner._prepare(Plans().plan(1, (ScheduledSeq("x", (5, 6, 7, 8, 9), 0, (2, -1), True),)))
    batch = runner._prepare(Plans().plan(2, (ScheduledSeq("x", (5, 6, 7, 8, 9), 0, (2, 0),
                                                          True),)))
    assert batch.slots_valid
    assert batch.slot_mapping.tolist() == [8, 9, 10, 11, 0]


def test_runner_facts(runner: ModelRunner, tiny_qwen2_dir: Path):
    assert runner.eos_token_ids == (1,)
    assert runner.vocab_size == 400 and runner.max_model_len == 256
    assert runner.backend_name == "cpu" and runner.block_size == BLOCK_SIZE
    k = runner.kv_caches[0][0]
    assert k.shape == (64, BLOCK_SIZE, 2, 16) and k.dtype == torch.float32
    # kv_cache_bytes: 2 (k, v) * 2 layers * 16 tokens * 2 kv heads * 16 dims * 4 bytes = 8 KiB
    sized = ModelRunner(tiny_qwen2_dir, kv_cache_bytes=10 * 8192 + 100)
    assert sized.num_blocks == 10 and sized.block_size == 16
    with pytest.raises(ValueError, match="not both"):
        ModelRunner(tiny_qwen2_dir, num_blocks=4, kv_cache_bytes=1 << 20)


def test_worker_actor_runs_plans_from_its_inbox(runner: ModelRunner):
    async def main() -> list[Ran]:
        plans: Mailbox[StepPlan] = Mailbox("worker", StepPlan, capacity=4)
        results: Mailbox[StepResult] = Mailbox("scheduler", StepResult, capacity=4)
        worker = Worker(runner, plans, results)
        got = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.run)
            seq = ScheduledSeq("w", (0, 7, 8), 0, (3,), True, NewSeqData(GREEDY, (0, 7, 8)))
            sent = [Plans().plan(1, (seq,)), StepPlan(2, drop=("w",))]
            for plan in sent:
                await plans.send(plan)
            for plan in sent:
                got.append(Ran(plan, await results.receive()))
            plans.close()  # the worker drains and returns, ending the nursery
        return got

    first, second = trio.run(main)
    assert first.step_id == 1 and first.error is None and first.tokens[0].rid == "w"
    assert second.step_id == 2 and second.tokens == ()
    assert runner.num_states == 0


def test_cpu_threads_sets_torch_threads(tiny_llama_dir: Path):
    before = torch.get_num_threads()
    try:
        ModelRunner(tiny_llama_dir, num_blocks=8, block_size=BLOCK_SIZE, num_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    from actorllm.config import EngineConfig

    with pytest.raises(ValueError, match="--cpu-threads"):
        EngineConfig(cpu_threads=0)


def test_a_small_step_runs_on_one_thread_and_a_large_one_on_all(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """Sleeping OpenMP threads cost more to wake than a small step saves
    (ops/threads.py): the step thread's team is 1 below SMALL_STEP_TOKENS tokens (unless
    DRAFT_STEP_TOKENS of them are past one per row), the configured count from there
    on, ``large_step_threads`` from LARGE_STEP_TOKENS or PREFILL_STEP_TOKENS past one
    per row, and each step's outputs do not depend on it."""
    from actorllm.cpus import ADAPT_ENV
    from actorllm.ops.threads import (
        DRAFT_STEP_TOKENS,
        LARGE_STEP_TOKENS,
        PREFILL_STEP_TOKENS,
        SMALL_STEP_TOKENS,
    )

    monkeypatch.setenv(ADAPT_ENV, "0")  # the counts as configured, whatever else runs here

    before = torch.get_num_threads()
    try:
        r = ModelRunner(tiny_llama_dir, num_blocks=192, block_size=BLOCK_SIZE, num_threads=2,
                        large_step_threads=3)
        seen: list[int] = []
        forward = r.model.forward

        def recording(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return forward(*args, **kwargs)

        r.model.forward = recording  # type: ignore[method-assign]
        op = r.decode_step
        if op is not None:  # every step here is a prompt: the one op runs it (cpu_step.py)

            class Recording:
                applies = staticmethod(op.applies)
                makes_logits = op.makes_logits

                def __call__(self, *args, **kwargs):
                    seen.append(torch.get_num_threads())
                    return op(*args, **kwargs)

            r.decode_step = Recording()  # type: ignore[assignment]
        s = Script(r)
        big = [0, *range(20, 20 + SMALL_STEP_TOKENS)]
        small = big[:DRAFT_STEP_TOKENS]  # (a prompt of more would count as compute)
        chunk = [0, *range(40, 40 + PREFILL_STEP_TOKENS)]  # one row, PREFILL_STEP_TOKENS past it
        # Four prompts of 128 tokens in one step: LARGE_STEP_TOKENS (the tiny model's
        # context is 256).
        prefills = [[0, *(20 + (i * 7 + k) % 300 for i in range(127))] for k in range(4)]
        results: list[Ran] = []

        def one(rid: str, ids: list[int]) -> ScheduledSeq:
            return s.seq(rid, ids, 0, True, NewSeqData(GREEDY, tuple(ids)))

        def steps() -> None:  # in a thread of its own, as the Worker's steps run
            results.append(s.step(one("big", big)))
            results.append(s.step(one("small", small)))
            results.append(s.step(*(one(f"p{k}", ids) for k, ids in enumerate(prefills))))
            results.append(s.step(one("big2", big)))
            results.append(s.step(one("chunk", chunk)))

        assert 4 * 128 == LARGE_STEP_TOKENS
        t = threading.Thread(target=steps)
        t.start()
        t.join()
        assert seen == [2, 1, 3, 2, 3]
        # The same prompts on 1, 2 and 3 threads: the same greedy tokens as transformers.
        hf = hf_model(tiny_llama_dir)
        assert [results[0].tokens[0].token_id] == hf_greedy(hf, big, 1)[0]
        assert [results[1].tokens[0].token_id] == hf_greedy(hf, small, 1)[0]
        assert [results[4].tokens[0].token_id] == hf_greedy(hf, chunk, 1)[0]
        got = {t.rid: t.token_id for t in results[2].tokens}
        assert [got[f"p{k}"] for k in range(4)] == [hf_greedy(hf, ids, 1)[0][0]
                                                    for ids in prefills]
    finally:
        torch.set_num_threads(before)


_POOLS = """
import os, sys, threading, torch
from actorllm.wire.messages import NewSeqData, SamplingParams, ScheduledSeq, StepPlan
from actorllm.worker.runner import ModelRunner
def threads():
    return len(os.listdir("/proc/self/task"))
torch.set_num_threads(2)  # (its first call may start a thread of torch's own pthreadpool)
before = threads()
r = ModelRunner(sys.argv[1], num_blocks=64, block_size=4, num_threads=2)
built = threads()
prompt = tuple(range(20, 84))
plan = StepPlan.of_rows(1, (ScheduledSeq("a", prompt, 0, tuple(range(16)), True,
                         NewSeqData(SamplingParams(temperature=0.0), prompt)),))
seen = []
t = threading.Thread(target=lambda: (r.execute(plan), seen.append(threads())))
t.start(); t.join()
print(before, built, seen[0])
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_only_the_step_thread_starts_an_openmp_team(tiny_llama_dir: Path):
    """Building the runner makes no OpenMP threads in the building thread (libgomp
    throttles every team's spin once it manages more threads than CPUs); the step
    thread's first large step makes its team's one other thread."""
    import subprocess
    import sys

    from actorllm.cpus import ADAPT_ENV

    out = subprocess.run([sys.executable, "-c", _POOLS, str(tiny_llama_dir)],
                         capture_output=True, text=True, timeout=120,
                         # the team as configured, whatever else runs on this machine
                         env={**os.environ, "OMP_NUM_THREADS": "2", ADAPT_ENV: "0"})
    assert out.returncode == 0, out.stderr
    before, built, stepped = map(int, out.stdout.split())
    assert built == before
    assert stepped == before + 2  # the step thread and its team's other thread


class _GatedRunner:
    """A stand-in ModelRunner (the Worker actor is under test): each step waits for its
    gate, and records the step ids it started."""

    ranks = None

    def __init__(self) -> None:
        self.started: list[int] = []
        self.gates: dict[int, threading.Event] = {}

    def drop_all(self) -> None:
        pass

    def execute(self, plan: StepPlan) -> StepResult:
        self.started.append(plan.step_id)
        self.gates.setdefault(plan.step_id, threading.Event()).wait(10)
        return StepResult(step_id=plan.step_id)


def test_the_step_thread_starts_a_queued_plan_without_the_event_loop():
    """With two plans in flight the second starts when the first ends, even while the event
    loop is blocked (the overlap that async scheduling is for)."""
    runner = _GatedRunner()
    for i in (1, 2):
        runner.gates[i] = threading.Event()

    async def main() -> list[int]:
        plans: Mailbox[StepPlan] = Mailbox("worker", StepPlan, capacity=4)
        results: Mailbox[StepResult] = Mailbox("scheduler", StepResult, capacity=4)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(Worker(runner, plans, results).run)  # type: ignore[arg-type]
            await plans.send(StepPlan(1))
            await plans.send(StepPlan(2))
            while runner.started != [1]:
                await trio.sleep(0.001)
            # Once every task waits, the Worker has moved plan 2 to the thread's queue.
            await trio.testing.wait_all_tasks_blocked()
            assert plans.depth == 0
            runner.gates[1].set()
            deadline = time.monotonic() + 5
            while runner.started != [1, 2] and time.monotonic() < deadline:
                time.sleep(0.001)  # blocks the event loop: no task runs meanwhile
            started = list(runner.started)
            runner.gates[2].set()
            ids = [(await results.receive()).step_id, (await results.receive()).step_id]
            plans.close()
        assert ids == [1, 2]
        return started

    assert trio.run(main) == [1, 2]


def test_results_reach_a_full_scheduler_inbox_in_step_order():
    """The Worker's forwarding task waits while the Scheduler's inbox is full: with an
    inbox of one and a reader that takes the results late and one at a time, every
    result arrives once, in step order, also when steps end between two reads."""
    runner = _GatedRunner()

    async def main() -> list[int]:
        plans: Mailbox[StepPlan] = Mailbox("worker", StepPlan, capacity=8)
        results: Mailbox[StepResult] = Mailbox("scheduler", StepResult, capacity=1)
        got: list[int] = []
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(Worker(runner, plans, results).run)  # type: ignore[arg-type]
                for i in range(1, 7):
                    await plans.send(StepPlan(i))
                for i in (1, 2, 3):  # three results: one in the inbox, two queued
                    runner.gates.setdefault(i, threading.Event()).set()
                while runner.started[-1:] != [4]:
                    await trio.sleep(0.001)
                for i in (4, 5, 6):  # each later step ends just after a read
                    got.append((await results.receive()).step_id)
                    runner.gates.setdefault(i, threading.Event()).set()
                while len(got) < 6:
                    got.append((await results.receive()).step_id)
                plans.close()
        return got

    assert trio.run(main) == [1, 2, 3, 4, 5, 6]


def test_cancelling_the_worker_drops_plans_the_thread_has_not_started():
    runner = _GatedRunner()

    async def main() -> None:
        plans: Mailbox[StepPlan] = Mailbox("worker", StepPlan, capacity=4)
        results: Mailbox[StepResult] = Mailbox("scheduler", StepResult, capacity=4)
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(Worker(runner, plans, results).run)  # type: ignore[arg-type]
                for i in (1, 2, 3):
                    await plans.send(StepPlan(i))
                while runner.started != [1]:
                    await trio.sleep(0.001)
                await trio.testing.wait_all_tasks_blocked()  # plans 2 and 3 wait in the
                assert plans.depth == 0  # thread's queue, not in the mailbox
                nursery.cancel_scope.cancel()
                # Let the Worker's tasks see the cancellation before the running step ends:
                # a plan taken before then was not dropped by the cancel, it preceded it.
                with trio.CancelScope(shield=True):
                    await trio.testing.wait_all_tasks_blocked()
                runner.gates.setdefault(1, threading.Event()).set()  # the running step ends

    trio.run(main)
    assert runner.started == [1]


def test_the_worker_says_in_its_result_when_its_thread_waited_for_the_plan():
    """``StepResult.plan_wait_s`` (passed on by the Scheduler to the write pacing,
    server/pacing.py) is 0 for a plan queued while the previous step ran, and positive for
    one the idle step thread had to wait for."""
    runner = _GatedRunner()

    async def main() -> None:
        plans: Mailbox[StepPlan] = Mailbox("worker", StepPlan, capacity=4)
        results: Mailbox[StepResult] = Mailbox("scheduler", StepResult, capacity=4)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(Worker(runner, plans, results).run)  # type: ignore[arg-type]
                await plans.send(StepPlan(1))
                while runner.started != [1]:
                    await trio.sleep(0.001)
                await plans.send(StepPlan(2))  # queued while step 1 runs
                runner.gates.setdefault(1, threading.Event()).set()
                runner.gates.setdefault(2, threading.Event()).set()
                assert (await results.receive()).step_id == 1
                second = await results.receive()
                assert second.step_id == 2 and second.plan_wait_s == 0.0
                # Nothing queued after step 2: the thread blocks on its queue. (The pause
                # only lets it get there first; the figure asserted is not a duration.)
                await trio.sleep(0.2)
                runner.gates.setdefault(3, threading.Event()).set()
                await plans.send(StepPlan(3))
                third = await results.receive()
                assert third.step_id == 3 and third.plan_wait_s > 0.0
                plans.close()

    trio.run(main)


def test_a_plan_for_an_idle_thread_is_handed_over_before_the_loop_goes_on(monkeypatch):
    """The feed waits (GIL released) until the idle step thread has taken its plan, so the
    thread packs it before the loop's other actors run (issue 28). The bound is raised so
    that a slow wake-up on a busy host cannot end the wait first."""
    import actorllm.worker.actor as worker_actor

    monkeypatch.setattr(worker_actor, "HANDOFF_S", 30.0)
    runner = _GatedRunner()

    async def main() -> None:
        plans: Mailbox[StepPlan] = Mailbox("worker", StepPlan, capacity=4)
        results: Mailbox[StepResult] = Mailbox("scheduler", StepResult, capacity=4)
        worker = Worker(runner, plans, results)  # type: ignore[arg-type]
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(worker.run)
                while not worker._thread_idle:
                    await trio.sleep(0.001)
                await plans.send(StepPlan(1))
                # Only the loop's own work (no sleep): the feed has run, and with it the
                # hand-over, by the time every task is blocked again.
                await trio.testing.wait_all_tasks_blocked()
                assert not worker._thread_idle  # the thread has the plan already
                runner.gates.setdefault(1, threading.Event()).set()
                assert (await results.receive()).step_id == 1
                plans.close()

    trio.run(main)


def test_a_thread_that_has_handed_its_result_over_counts_as_waiting(monkeypatch):
    """The wake-up that hands a result to the loop gives the loop the GIL, which it keeps
    while it commits and plans: the thread stands still between its ``run_sync_soon`` and
    its plan queue. The feed must hand the next plan over to it all the same, or the loop
    runs the Detokenizer and Frontend first and the step starts after them (issue 28:
    ~80 us a step at concurrency 1). Here the thread is held up right after handing
    step 1's result over, and step 2's plan must be taken before the loop goes on."""
    import actorllm.worker.actor as worker_actor

    monkeypatch.setattr(worker_actor, "HANDOFF_S", 30.0)
    runner = _GatedRunner()
    runner.gates[1] = threading.Event()
    runner.gates[1].set()
    runner.gates[2] = threading.Event()
    handed = trio.lowlevel.TrioToken.run_sync_soon

    def slow_after_handing(self: Any, *args: Any, **kwargs: Any) -> None:
        handed(self, *args, **kwargs)
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)  # (GIL released: a stand-in for the thread starved of it)

    monkeypatch.setattr(trio.lowlevel.TrioToken, "run_sync_soon", slow_after_handing)

    async def main() -> None:
        plans: Mailbox[StepPlan] = Mailbox("worker", StepPlan, capacity=4)
        results: Mailbox[StepResult] = Mailbox("scheduler", StepResult, capacity=4)
        worker = Worker(runner, plans, results)  # type: ignore[arg-type]
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(worker.run)
                await plans.send(StepPlan(1))
                assert (await results.receive()).step_id == 1  # the thread is held up now
                await plans.send(StepPlan(2))
                await trio.testing.wait_all_tasks_blocked()
                assert runner.started == [1, 2]  # taken before the loop went on
                runner.gates[2].set()
                assert (await results.receive()).step_id == 2
                plans.close()

    trio.run(main)


def test_the_worker_is_ready_once_its_thread_waits_for_a_plan():
    """``Worker.ready`` (which open_engine waits for before it takes requests) is set once
    the step thread has finished its warm-up and waits for its first plan, not before."""
    runner = _GatedRunner()
    entered, warming = threading.Event(), threading.Event()

    def warm_up() -> None:
        entered.set()
        warming.wait(30)

    async def main() -> None:
        plans: Mailbox[StepPlan] = Mailbox("worker", StepPlan, capacity=4)
        results: Mailbox[StepResult] = Mailbox("scheduler", StepResult, capacity=4)
        worker = Worker(runner, plans, results, warmup=warm_up)  # type: ignore[arg-type]
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(worker.run)
                while not entered.is_set():
                    await trio.sleep(0.001)
                # (anything the thread handed the loop before its warm-up has arrived)
                await trio.testing.wait_all_tasks_blocked()
                early = worker.ready.is_set()
                warming.set()  # (before asserting: a failure must not leave it waiting)
                assert not early
                await worker.ready.wait()
                await plans.send(StepPlan(1))
                runner.gates.setdefault(1, threading.Event()).set()
                assert (await results.receive()).step_id == 1
                plans.close()

    trio.run(main)


def test_a_worker_whose_warm_up_fails_keeps_no_one_waiting_for_it():
    """A Worker that fails before its thread ever waits for a plan still sets ``ready``:
    open_engine goes on, and the engine is marked dead as for any actor that fails."""
    runner = _GatedRunner()

    def broken() -> None:
        raise RuntimeError("warm-up failed")

    async def main() -> None:
        plans: Mailbox[StepPlan] = Mailbox("worker", StepPlan, capacity=4)
        results: Mailbox[StepResult] = Mailbox("scheduler", StepResult, capacity=4)
        worker = Worker(runner, plans, results, warmup=broken)  # type: ignore[arg-type]
        failed = False

        async def run() -> None:
            nonlocal failed
            try:
                await worker.run()
            except* RuntimeError:  # (raised in the Worker's own nursery)
                failed = True

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await worker.ready.wait()
        assert failed

    trio.run(main)
