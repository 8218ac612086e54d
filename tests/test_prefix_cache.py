"""Prefix caching and priority scheduling (issue 15).

The Scheduler's decisions are driven by hand (as in test_scheduler.py): hits counted
exactly, blocks shared and given back, the prompt-logprobs rule, the priority order. Then
the whole engine: greedy output equals transformers and the cache-off run under
preemption, chunked prefill and ``n > 1``; the HTTP fields (``cached_tokens``,
``priority``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import Call, app_for, hf_greedy
from steps import Tables

from actorllm.config import EngineConfig
from actorllm.engine.async_engine import AsyncEngine, Resources, open_engine
from actorllm.llm import GenerationResult, collect, make_request
from actorllm.scheduler.actor import Scheduler
from actorllm.scheduler.kv_pool import BlockPool, hash_block
from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import (
    InvalidRequest,
    PromptLogprobs,
    SampledToken,
    SamplingParams,
    SchedulerInput,
    SequenceRequest,
    StepPlan,
    StepResult,
    TokenBatch,
    TokenLogprob,
)
from actorllm.wire.outputs import Merged, RequestError, merge_all

EOS = 1
BS = 4


def make(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64,
         **kw: Any) -> Scheduler:
    return Scheduler(Mailbox("s", SchedulerInput, 8), Mailbox("w", StepPlan, 2),
                     Mailbox("d", TokenBatch, 8), num_blocks=num_blocks, block_size=BS,
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, **kw)


def req(rid: str, tokens: list[int], max_tokens: int = 2, **params: Any) -> SequenceRequest:
    return SequenceRequest(rid, tuple(tokens), SamplingParams(max_tokens=max_tokens,
                                                              ignore_eos=True, **params),
                           max_tokens, (EOS,))


class Driver:
    """Plays the Worker: answers every plan with token 7 and the prompt logprobs it asks
    for (each position's score is ``-position``); remembers plans and finishes."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.plans: list[StepPlan] = []
        self.mirror = Tables()  # the plans' block-table diffs, applied as the Worker does
        self.tables: list[dict[str, tuple[int, ...]]] = []  # per plan: its rows' tables
        self.finished: list[str] = []
        self.cached: dict[str, int | None] = {}
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.reported: dict[str, list[Any]] = {}  # prompt logprobs the client would read

    def step(self) -> StepPlan | None:
        plan = self.s.schedule()
        if plan is not None:
            self.plans.append(plan)
            reports = []
            for x in plan.seqs:
                if x.new is not None:
                    self.prompts[x.rid] = x.new.prompt_token_ids
                if x.prompt_logprobs_from is not None:
                    prompt = self.prompts[x.rid]
                    hi = min(x.start_pos + len(x.token_ids), len(prompt) - 1)
                    reports.append(PromptLogprobs(x.rid, x.prompt_logprobs_from, tuple(
                        TokenLogprob(prompt[p], -float(p))
                        for p in range(x.prompt_logprobs_from, hi + 1))))
            self.tables.append(self.mirror.apply(plan))
            self.s.handle(StepResult.of_tokens(plan, (
                SampledToken(x.rid, 7) for x in plan.seqs if x.sample),
                prompt_logprobs=tuple(reports)))
        batch = self.s.take_batch()
        for out in batch.outputs if batch else ():
            self.reported.setdefault(out.rid, []).extend(out.prompt_logprobs)
            if out.finish_reason is not None:
                self.finished.append(out.rid)
                self.cached[out.rid] = out.cached_tokens
        return plan

    def run(self, limit: int = 200) -> None:
        for _ in range(limit):
            if self.step() is None:
                return

    def computed(self, rid: str) -> list[tuple[int, int]]:
        """(start, length) of each chunk the rid was scheduled with."""
        return [(x.start_pos, len(x.token_ids)) for p in self.plans for x in p.seqs
                if x.rid == rid]


SYSTEM = list(range(100, 108))  # two full blocks


def test_hits_are_counted_exactly_in_a_scripted_scenario() -> None:
    s = make()
    d = Driver(s)
    # A shared system prompt: the second question finds both blocks of it.
    s.handle(req("q1", [*SYSTEM, 1, 2, 3]))
    d.run()
    s.handle(req("q2", [*SYSTEM, 4, 5, 6]))
    d.run()
    assert d.computed("q2")[0] == (8, 3)
    assert d.cached == {"q1": 0, "q2": 8}
    assert (s.pool.queries, s.pool.hits) == (22, 8)
    # A prompt on a block boundary: its last token is computed again, so only the first
    # block is a hit (its second block is recomputed into a fresh block).
    s.handle(req("edge", SYSTEM))
    d.run()
    assert d.computed("edge")[0] == (4, 4) and d.cached["edge"] == 4
    # A prompt that is a prefix of another: 10 tokens of q1's 11, two full blocks cached.
    s.handle(req("prefix", [*SYSTEM, 1, 2]))
    d.run()
    assert d.computed("prefix")[0] == (8, 2) and d.cached["prefix"] == 8
    # Output tokens fill blocks too: q1's third block (1, 2, 3, 7) was computed by its
    # decode step and is cached.
    s.handle(req("follow-up", [*SYSTEM, 1, 2, 3, 7, 9]))
    d.run()
    assert d.cached["follow-up"] == 12
    assert (s.pool.queries, s.pool.hits) == (22 + 8 + 10 + 13, 8 + 4 + 8 + 12)
    stats = s.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (53, 32)
    assert s.pool.num_used == 0 and not s.drain_problems()


def test_eviction_takes_the_least_recently_used_block_without_references() -> None:
    s = make(num_blocks=6)
    d = Driver(s)
    s.handle(req("a", [*range(10, 18), 1], max_tokens=1))  # 3 blocks, 2 of them cached
    d.run()
    s.handle(req("b", [*range(20, 28), 1], max_tokens=1))
    d.run()
    assert len(s.pool.cached_blocks()) == 4 and s.pool.evictions == 0
    # "a" again: its blocks become the most recently used.
    s.handle(req("a2", [*range(10, 18), 2], max_tokens=1))
    d.run()
    assert d.cached["a2"] == 8
    # A 5-block prompt needs 5 of the 6 blocks: 2 free ones and 3 evicted, b's first.
    s.handle(req("big", list(range(40, 59)), max_tokens=1))
    d.run()
    assert s.pool.evictions == 3
    s.handle(req("a3", [*range(10, 18), 3], max_tokens=1))
    s.handle(req("b2", [*range(20, 28), 2], max_tokens=1))
    d.run()
    assert d.cached["b2"] == 0, "b's blocks were the least recently used: evicted"
    assert d.cached["a3"] == 4, "a's second block went, its first (freed last) stayed"
    assert not s.drain_problems()


def test_a_block_with_references_is_never_evicted() -> None:
    pool = BlockPool(3, BS)
    a = pool.allocate(2)
    h = hash_block(None, [1, 2, 3, 4])
    pool.register(a[0], h)
    pool.share([a[0]])  # a second holder
    pool.free([a[0]])
    assert pool.refs == {a[0]: 1, a[1]: 1} and pool.cached_blocks() == []
    assert pool.allocate(1) not in ([a[0]], [a[1]])
    assert not pool.can_allocate(1)
    pool.free(reversed(a))
    assert pool.cached_blocks() == [a[0]] and pool.lookup([h]) == [a[0]]
    assert pool.allocate(2) == [a[1], a[0]], "free blocks first, then the cached one"
    assert pool.lookup([h]) == [] and pool.evictions == 1, "evicted: its hash is forgotten"


def test_hashes_chain_the_prefix() -> None:
    first = hash_block(None, [1, 2, 3, 4])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]),
                                                        [5, 6, 7, 8])
    assert hash_block(first, [5, 6, 7, 8]) == hash_block(hash_block(None, [1, 2, 3, 4]),
                                                        [5, 6, 7, 8])


def test_children_of_one_prompt_prefill_it_once_and_share_its_blocks() -> None:
    s = make()
    d = Driver(s)
    prompt = list(range(30, 43))  # 13 tokens: 3 full blocks
    for i in range(4):  # the Frontend's children of a n = 4 request
        s.handle(req(f"p-{i}", prompt, max_tokens=3))
    d.step()
    first = d.plans[0]
    assert [x.rid for x in first.seqs] == ["p-0"], "the others wait for its blocks"
    d.step()
    tables = d.tables[1]
    assert {r: d.computed(r)[0] for r in ("p-1", "p-2", "p-3")} == {
        r: (12, 1) for r in ("p-1", "p-2", "p-3")}
    shared = tables["p-0"][:3]
    assert all(t[:3] == shared for t in tables.values())
    assert all(s.pool.refs[b] == 4 for b in shared)
    d.run()
    assert sorted(d.finished) == [f"p-{i}" for i in range(4)]
    assert not s.drain_problems() and s.pool.num_used == 0


def test_a_prompt_waiting_on_a_block_in_the_step_does_not_hold_up_the_line() -> None:
    s = make(budget=64)
    d = Driver(s)
    s.handle(req("a", [*SYSTEM, 1, 2, 3]))
    s.handle(req("b", [*SYSTEM, 4, 5, 6]))  # its first block is a's, computed this step
    s.handle(req("c", list(range(200, 211))))  # shares nothing
    d.step()
    assert [x.rid for x in d.plans[0].seqs] == ["a", "c"], "c starts; b waits a step"
    assert [seq.rid for seq in s.waiting] == ["b"]
    d.step()
    assert d.computed("b")[0] == (8, 3), "then b starts from a's two blocks"
    d.run()
    assert sorted(d.finished) == ["a", "b", "c"]
    assert not s.drain_problems() and s.pool.num_used == 0


def test_a_deferred_prompt_keeps_its_place_before_later_arrivals() -> None:
    s = make(num_blocks=5)  # a takes 3 blocks: c's 3 do not fit beside them
    d = Driver(s)
    s.handle(req("a", [*SYSTEM, 1, 2, 3]))
    s.handle(req("b", [*SYSTEM, 4, 5, 6]))
    s.handle(req("c", list(range(200, 211))))
    d.step()
    assert [x.rid for x in d.plans[0].seqs] == ["a"]
    assert [seq.rid for seq in s.waiting] == ["b", "c"], "b is still ahead of c"


def test_abort_of_one_sharer_keeps_the_blocks_of_the_others() -> None:
    from actorllm.wire.messages import AbortRequest

    s = make()
    d = Driver(s)
    prompt = list(range(30, 39))
    s.handle(req("a", prompt, max_tokens=4))
    d.step()
    s.handle(req("b", prompt, max_tokens=4))
    plan = s.schedule()  # in flight: a decodes, b starts from a's blocks
    assert plan is not None
    tables = d.mirror.apply(plan)
    assert tables["a"][:2] == tables["b"][:2]
    s.handle(AbortRequest("a"))  # fenced: a keeps its reference until the result
    assert all(s.pool.refs[b] == 2 for b in tables["a"][:2])
    s.handle(StepResult.of_tokens(plan, (SampledToken(x.rid, 7) for x in plan.seqs)))
    assert all(s.pool.refs[b] == 1 for b in tables["a"][:2])
    d.run()
    assert not s.drain_problems()


def test_a_request_owing_prompt_logprobs_takes_only_what_it_need_not_score() -> None:
    s = make(num_blocks=64, budget=64)
    d = Driver(s)
    prompt = list(range(50, 63))
    s.handle(req("plain", prompt))
    d.run()
    s.handle(req("scored", prompt, prompt_logprobs=1))
    d.run()
    assert d.computed("scored")[0] == (0, 13), "every position it reports is computed"
    assert d.cached["scored"] == 0
    # After a preemption, the positions already reported may come from the cache:
    # skippable_prefix() is prompt_lps_next - 1, floored to a block.
    s2 = make(num_blocks=64, budget=5)
    d2 = Driver(s2)
    s2.handle(req("plain", prompt))
    d2.run()
    s2.handle(req("scored", prompt, prompt_logprobs=1))
    d2.step()
    d2.step()  # two chunks of 5: positions 1..10 reported
    seq = s2.seqs["scored"]
    assert seq.prompt_lps_next == 11 and seq.skippable_prefix() == 10
    s2.batch.preempt(seq)
    d2.run()
    restart = d2.computed("scored")[2]
    assert restart[0] == 8, "two full blocks (8 <= 10 tokens) from the cache"
    got = d2.reported["scored"]
    assert got[0] is None and [e.logprob for e in got[1:]] == [-float(p) for p in range(1, 13)]
    assert not s2.drain_problems()


def test_cache_off_computes_everything() -> None:
    s = make(enable_prefix_caching=False)
    d = Driver(s)
    s.handle(req("q1", [*SYSTEM, 1]))
    d.run()
    s.handle(req("q2", [*SYSTEM, 2]))
    d.run()
    assert d.computed("q2")[0] == (0, 9) and d.cached["q2"] == 0
    assert (s.pool.queries, s.pool.hits) == (0, 0)
    assert s.pool.cached_blocks() == [] and not s.pool.hash_of


# --- priority -------------------------------------------------------------------------------


def test_priority_a_later_urgent_request_preempts_and_finishes_first() -> None:
    s = make(max_num_seqs=1, scheduling_policy="priority")
    d = Driver(s)
    for i in range(3):
        s.handle(req(f"low-{i}", [10 + i, 11, 12], max_tokens=6, priority=5))
    d.step()  # low-0 runs
    s.handle(req("high", [20, 21, 22], max_tokens=2, priority=-1))
    d.run()
    assert d.finished[0] == "high"
    assert d.finished[1:] == ["low-0", "low-1", "low-2"], "equal priorities: by arrival"
    assert s.num_preemptions == 1


def test_priority_fcfs_ignores_priority_order() -> None:
    s = make(max_num_seqs=1)
    d = Driver(s)
    s.handle(req("a", [10, 11], max_tokens=3))
    s.handle(req("b", [12, 13], max_tokens=3))
    d.run()
    assert d.finished == ["a", "b"]


def test_priority_under_kv_pressure_the_lowest_priority_is_preempted() -> None:
    # 6 blocks of 4: three sequences of 5 prompt tokens growing to 12 cannot all fit.
    s = make(num_blocks=6, scheduling_policy="priority", enable_prefix_caching=False)
    d = Driver(s)
    s.handle(req("mid", list(range(10, 15)), max_tokens=7, priority=1))
    s.handle(req("low", list(range(20, 25)), max_tokens=7, priority=9))
    s.handle(req("top", list(range(30, 35)), max_tokens=7, priority=0))
    preempted = []
    for _ in range(100):
        before = {q.rid for q in s.running}
        if d.step() is None:
            break
        preempted += [r for r in before if s.seqs.get(r) and s.seqs[r] in s.waiting]
    assert preempted and set(preempted) == {"low"}
    assert d.finished[0] == "top"
    assert not s.drain_problems()


# --- the engine -------------------------------------------------------------------------------

_resources: dict[str, Resources] = {}


async def until(cond: Any, timeout: float = 30.0) -> None:
    """Wait for ``cond()`` (looked at every 5 ms; the timeout only guards against a hang)."""
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.005)


@asynccontextmanager
async def engine_for(model: Path, max_model_len: int = 160,
                     **kw: Any) -> AsyncIterator[AsyncEngine]:
    config = EngineConfig(model=str(model), block_size=4, max_model_len=max_model_len, **kw)
    key = f"{model}/{config.num_kv_blocks}/{max_model_len}"
    if key not in _resources:
        _resources[key] = Resources(config)
    async with open_engine(config, resources=_resources[key]) as engine:
        yield engine
        assert await engine.wait_drained() == []


SYSTEM_TEXT = ("You are a careful assistant. Answer briefly and do not invent facts; "
               "when unsure, say so.")
QUESTIONS = ["what is a river?", "name a colour", "count to three", "why is the sky blue",
             "hello"]


async def _one(engine: AsyncEngine, rid: str, prompt: str, params: SamplingParams,
               task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
               ) -> GenerationResult:
    """``collect``, streamed: ``task_status.started()`` once the first tokens are out (the
    whole prompt was computed, so its full blocks are in the prefix cache)."""
    choices: dict[int, Merged] = {}
    n_prompt = 0
    try:
        async for out in engine.generate(make_request(rid, prompt, params)):
            merge_all(choices, out)
            n_prompt = out.num_prompt_tokens or n_prompt
            if len(choices) == params.n:  # every choice has its first token
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED
    except RequestError as exc:
        task_status.started()
        return GenerationResult(rid, prompt, (), n_prompt, error=str(exc))
    outputs = tuple(choices[i].output(i) for i in sorted(choices))
    return GenerationResult(rid, prompt, outputs, n_prompt)


async def _generate_all(engine: AsyncEngine, prompts: list[str],
                        params: list[SamplingParams]) -> list[Any]:
    """Every prompt at once, but the first ahead: the rest arrive once its prompt is
    computed, so they find its blocks (an event, not a pause that a slow machine
    outlasts)."""
    results: list[Any] = [None] * len(prompts)

    async def one(i: int, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        results[i] = await _one(engine, f"r{i}", prompts[i], params[i], task_status)

    async with trio.open_nursery() as nursery:
        await nursery.start(one, 0)
        for i in range(1, len(prompts)):
            nursery.start_soon(one, i)
    return results


async def test_greedy_output_is_the_same_with_the_cache_on_and_off_and_equals_transformers(
        tiny_llama_dir: Path) -> None:
    prompts = [f"{SYSTEM_TEXT} {q}" for q in QUESTIONS] + [SYSTEM_TEXT]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [greedy] * len(prompts)
    params[1] = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=3)
    outs: dict[bool, list[Any]] = {}
    stats = {}
    for caching in (True, False):
        # 24 blocks of 4 tokens (the fewest a 96-token context allows) for 8 sequences
        # of ~75 tokens: preemption even with the prefix shared; a 16-token budget:
        # chunked prefill.
        async with engine_for(tiny_llama_dir, max_model_len=96, num_kv_blocks=24,
                              max_num_batched_tokens=16,
                              enable_prefix_caching=caching) as engine:
            outs[caching] = await _generate_all(engine, prompts, params)
            stats[caching] = engine.frontend.stats
            tokenizer = engine.tokenizer
    on, off = stats[True], stats[False]
    assert on.num_preemptions > 0 and off.num_preemptions > 0, "preemption exercised"
    assert on.prefix_cache_hits > 0 and off.prefix_cache_hits == 0
    for prompt, a, b in zip(prompts, outs[True], outs[False], strict=True):
        assert a.error is None and b.error is None
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs], prompt
        ref = hf_greedy(tiny_llama_dir, tokenizer(prompt).input_ids, 12)[0]
        for o in a.outputs:
            assert list(o.token_ids) == ref, prompt


async def test_http_usage_reports_cached_tokens_and_priority_is_refused_under_fcfs(
        tiny_llama_dir: Path) -> None:
    async with engine_for(tiny_llama_dir, num_kv_blocks=64) as engine:
        app = app_for(engine)
        body = {"messages": [{"role": "system", "content": SYSTEM_TEXT},
                             {"role": "user", "content": "hi"}],
                "max_tokens": 2, "temperature": 0}
        first = (await Call("/v1/chat/completions", body).run(app)).json()
        second = (await Call("/v1/chat/completions", body).run(app)).json()
        n = first["usage"]["prompt_tokens"]
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        # Every full block but the one holding the last prompt token.
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": (n - 1) // 4 * 4}
        from prometheus_client.parser import text_string_to_metric_families

        call = await Call("/metrics", method="GET").run(app)
        samples = {x.name: x.value for f in text_string_to_metric_families(
            b"".join(call.chunks).decode()) for x in f.samples}
        assert samples["actorllm:prefix_cache_queries_total"] == 2 * n
        assert samples["actorllm:prefix_cache_hits_total"] == (n - 1) // 4 * 4
        call = await Call("/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                              "priority": 3}).run(app)
        assert call.status == 400 and call.json()["error"]["param"] == "priority"
        ok = await Call("/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                            "priority": 0}).run(app)
        assert ok.status == 200
        with pytest.raises(InvalidRequest, match="priority"):
            await collect(engine, "p", "hi", SamplingParams(max_tokens=2, priority=1))


async def test_http_priority_is_honoured_with_the_priority_policy(tiny_llama_dir: Path) -> None:
    async with engine_for(tiny_llama_dir, num_kv_blocks=64, max_num_seqs=1,
                          scheduling_policy="priority") as engine:
        app = app_for(engine)
        order: list[str] = []

        async def one(name: str, priority: int, max_tokens: int) -> None:
            call = await Call("/v1/completions", {
                "prompt": f"request {name}", "max_tokens": max_tokens, "ignore_eos": True,
                "priority": priority}).run(app)
            assert call.status == 200, call.json()
            order.append(name)

        async with trio.open_nursery() as nursery:
            # In order: each low one arrives once the Scheduler holds the one before (it
            # runs low0 and queues the rest), then the urgent one.
            for i in range(3):
                nursery.start_soon(one, f"low{i}", 5, 120)
                await until(lambda i=i: engine.frontend.stats.num_running == 1
                            and engine.frontend.stats.num_waiting == i)
            nursery.start_soon(one, "high", -5, 2)
        assert order[0] == "high", order
