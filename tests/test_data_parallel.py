"""Data parallelism (``--data-parallel-size N``): N engine replicas behind one Frontend.

Each engine session starts two child interpreters that import torch (seconds on this
machine), so the end-to-end tests batch several checks into one session. The Router's
rule itself is checked directly, without processes.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import Call, app_for, collect_all, greedy_expectations

from actorllm import cli, cpus
from actorllm.config import EngineConfig
from actorllm.engine.async_engine import AsyncEngine, open_engine
from actorllm.frontend.routing import AFFINITY_CHARS, AFFINITY_SLACK, Router
from actorllm.llm import LLM, collect, make_request
from actorllm.topology.placement import child_roles, split_role, worker_threads
from actorllm.wire.messages import GenerateRequest, SamplingParams, SchedulerStats
from actorllm.wire.outputs import Merged, RequestError, merge_all

ENGINE_ARGS: dict[str, Any] = dict(num_kv_blocks=96, max_num_seqs=8)
PROMPTS = [
    "The river runs past the old mill",
    "Hello! How are you today?",
    "A small library stands on the corner",
    "Seven ships sailed at dawn",
]
MAX_TOKENS = 12
# Longer than the affinity key, so two prompts that start with it share a key (and, in
# the replica, several full KV blocks).
SHARED = ("Once upon a time, in a quiet valley between two mountains, there lived an old "
          "clockmaker who repaired every clock in the village and kept a notebook of the "
          "hours each one had lost. " * 2)[:AFFINITY_CHARS + 24]  # (the tiny model: 256 tokens)
assert len(SHARED) > AFFINITY_CHARS


def greedy(n: int = 1, max_tokens: int = MAX_TOKENS, **kw: Any) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def dp_config(model: Path, **kw: Any) -> EngineConfig:
    return EngineConfig(model=str(model), topology="engine", data_parallel_size=2,
                        **ENGINE_ARGS, **kw)


def sample(engine: AsyncEngine, name: str, **labels: str) -> float:
    engine.update_gauges()
    value = engine.metrics.registry.get_sample_value(f"actorllm:{name}", labels or None)
    return 0.0 if value is None else value


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path, tiny_tokenizer: Any) -> dict[str, Any]:
    """transformers' greedy continuation of each prompt, as ids and as text."""
    return greedy_expectations(tiny_llama_dir, tiny_tokenizer, PROMPTS, MAX_TOKENS)


# --- the Router's rule, without processes -------------------------------------------------


def _req(rid: str, prompt: str, max_tokens: int = 16) -> GenerateRequest:
    return GenerateRequest(rid, SamplingParams(max_tokens=max_tokens), prompt=prompt)


def test_router_spreads_by_load_then_kv_usage_then_count() -> None:
    router = Router(3)
    picks = []
    for i in range(3):  # idle: each replica in turn (fewest routed)
        r = router.pick(_req(f"a{i}", "hi"))
        router.add(r, 10)
        picks.append(r)
    assert sorted(picks) == [0, 1, 2]
    router.add(0, 500)
    router.add(2, 500)
    assert router.pick(_req("b", "hi")) == 1  # fewest outstanding tokens
    router.sub(0, 510)
    router.sub(1, 10)
    router.sub(2, 510)
    router.on_stats(SchedulerStats(kv_blocks_used=50, kv_blocks_total=100, replica=0))
    router.on_stats(SchedulerStats(kv_blocks_used=10, kv_blocks_total=100, replica=1))
    router.on_stats(SchedulerStats(kv_blocks_used=30, kv_blocks_total=100, replica=2))
    assert router.pick(_req("c", "hi")) == 1  # equal loads: the lowest KV usage
    router.kill(1)
    assert router.pick(_req("d", "hi")) == 2  # a dead replica gets nothing
    assert router.total().kv_blocks_used == 80  # the dead one's usage reads zero


def test_router_prefix_affinity_unless_much_more_loaded() -> None:
    router = Router(2)
    first = router.pick(_req("a", SHARED + "one"))
    router.add(first, 100)
    # Loads close: the shared prefix goes where it went (the least loaded is the other).
    assert router.pick(_req("b", SHARED + "two")) == first
    assert router.affinity_hits == 1
    # A short prompt has no key: least loaded.
    assert router.pick(_req("c", "short")) == 1 - first
    # Much more loaded (beyond ratio x least + slack): the least loaded wins, and the
    # prefix's home moves there.
    router.add(first, 2 * AFFINITY_SLACK)
    other = router.pick(_req("d", SHARED + "three"))
    assert other == 1 - first
    router.add(other, 100)
    assert router.pick(_req("e", SHARED + "four")) == other


def test_router_affinity_does_not_stick_to_a_dead_replica() -> None:
    router = Router(3)
    home = router.pick(_req("a", SHARED + "one"))
    router.add(home, 10)
    assert router.pick(_req("b", SHARED + "two")) == home  # the prefix sticks ...
    router.kill(home)
    # ... until its replica dies: then the least loaded live one, which becomes its home.
    moved = router.pick(_req("c", SHARED + "three"))
    assert moved != home and moved in router.live
    router.add(moved, 100)  # now more loaded than the third, within the affinity slack
    assert router.pick(_req("d", SHARED + "four")) == moved
    assert all(router.pick(_req(f"e{i}", SHARED + str(i))) != home for i in range(20))


def test_router_never_routes_to_a_dead_replica_while_one_lives() -> None:
    router = Router(3)
    router.kill(0)
    router.kill(2)
    assert router.live == [1]
    picks = {router.pick(_req(f"r{i}", ("x" * AFFINITY_CHARS) if i % 2 else "hi"))
             for i in range(10)}
    assert picks == {1}


def test_roles_and_threads_of_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    assert child_roles("engine", 3) == ("engine0", "engine1", "engine2")
    assert child_roles("engine", 1) == ("engine",)
    assert split_role("engine1") == ("engine", 1) and split_role("engine") == ("engine", None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(9)), raising=False)
    monkeypatch.setattr(cpus, "cpu_quota", lambda root=None: None)  # a CI container's
    config = EngineConfig(topology="engine", data_parallel_size=2)
    assert worker_threads(config) == 4  # (9 cores - 1 for HTTP) / 2 replicas
    config = EngineConfig(topology="engine", data_parallel_size=16)
    assert worker_threads(config) == 1  # at least one each


@pytest.mark.parametrize(("flags", "message"), [
    (["--data-parallel-size", "0"], "--data-parallel-size must be at least 1, got 0"),
    (["--data-parallel-size", "2", "--topology", "pipeline"], "needs --topology engine"),
    (["--data-parallel-size", "2", "--topology", "single"], "needs --topology engine"),
    (["--data-parallel-size", "2", "--tensor-parallel-size", "2"], "cannot both be above 1"),
])
def test_bad_flags_are_one_line_errors(flags: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("actorllm: error:")


# --- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_replica(tiny_llama_dir: Path) -> list[Any]:
    """The prompts' greedy results from one engine without data parallelism."""
    return LLM(model=str(tiny_llama_dir), **ENGINE_ARGS).generate(PROMPTS, greedy())


async def test_two_replicas_match_one_and_spread_share_and_free(
        tiny_llama_dir: Path, expected: dict[str, Any], one_replica: list[Any]) -> None:
    one = one_replica
    async with open_engine(dp_config(tiny_llama_dir)) as engine:
        assert engine.supervisor is not None
        assert sorted(engine.supervisor.pids()) == ["engine0", "engine1"]
        router = engine.frontend.router
        # Same greedy tokens as one replica and as transformers; submitted together, so
        # they spread over both replicas.
        results = await collect_all(engine, PROMPTS, greedy())
        for prompt, res, ref in zip(PROMPTS, results, one, strict=True):
            (out,) = res.outputs
            assert (out.token_ids, out.text) == expected[prompt]
            assert out.token_ids == ref.outputs[0].token_ids
        routed = [sample(engine, "replica_requests_routed_total", replica=str(r))
                  for r in (0, 1)]
        assert routed == [2.0, 2.0]
        assert all(sample(engine, "replica_engine_steps_total", replica=str(r)) > 0
                   for r in (0, 1))
        assert sample(engine, "engine_steps_total") == sum(
            sample(engine, "replica_engine_steps_total", replica=str(r)) for r in (0, 1))

        # n > 1: every child on one replica.
        before = list(router.routed)
        fan = await engine.submit(make_request("fan", PROMPTS[1], greedy(n=3)))
        replicas = {engine.frontend.registry[f"fan-{i}"].replica for i in range(3)}
        assert len(replicas) == 1
        grew = [a - b for a, b in zip(router.routed, before, strict=True)]
        assert sorted(grew) == [0, 3]
        choices: dict[int, Merged] = {}
        async for out in fan:
            merge_all(choices, out)
        assert sorted(choices) == [0, 1, 2]
        assert all(tuple(c.token_ids) == expected[PROMPTS[1]][0] for c in choices.values())

        # A stop string still cuts the text where one replica would.
        text0 = expected[PROMPTS[0]][1]
        stop = text0[len(text0) // 2:][:3]
        for rid in ("s0", "s1"):  # two, so both replicas see one (alternation when idle)
            res = await collect(engine, rid, PROMPTS[0], greedy(stop=(stop,)))
            (out,) = res.outputs
            assert out.finish_reason == "stop" and out.stop_reason == stop
            assert out.text == text0[:text0.find(stop)]

        # An abort mid-stream reaches the replica that runs the request and frees its blocks.
        for rid in ("ab0", "ab1"):
            col = await engine.submit(make_request(rid, PROMPTS[2], greedy(max_tokens=200)))
            await col.get()
            owner = engine.frontend.registry[rid].replica
            await engine.abort(rid)
            with trio.fail_after(10):
                while router.stats[owner].kv_blocks_used:  # its own stats say so
                    await trio.sleep(0.02)
            assert col.finished
        assert await engine.wait_drained(timeout=15) == []

        # Prefix affinity: a prompt sharing a long prefix with one still running goes to
        # that replica, although the other is idle (the least loaded), and its prefix cache
        # serves the shared blocks there.
        p0 = await engine.submit(make_request("p0", SHARED + "The clockmaker",
                                              greedy(max_tokens=40)))
        await p0.get()  # its prompt is in the cache now
        home = engine.frontend.registry["p0"].replica
        assert router.load[home] > router.load[1 - home]
        hits = router.stats[home].prefix_cache_hits
        p1 = await engine.submit(make_request("p1", SHARED + "His daughter", greedy()))
        assert engine.frontend.registry["p1"].replica == home
        assert router.affinity_hits == 1
        assert await _outcome(p1) is None
        async for _ in p0:
            pass
        with trio.fail_after(5):
            while router.stats[home].prefix_cache_hits <= hits:
                await trio.sleep(0.02)
        assert await engine.wait_drained(timeout=15) == []


async def _streaming(engine: AsyncEngine, count: int, max_tokens: int = 200) -> dict[str, Any]:
    """``count`` long requests, each past its first output; rid -> collector."""
    collectors = {}
    for i in range(count):
        rid = f"long{i}"
        collectors[rid] = await engine.submit(
            make_request(rid, PROMPTS[i % len(PROMPTS)], greedy(max_tokens=max_tokens)))
    for col in collectors.values():
        await col.get()
    return collectors


async def _outcome(col: Any) -> RequestError | None:
    try:
        async for _ in col:
            pass
    except RequestError as exc:
        return exc
    return None


async def test_killed_replica_fails_only_its_requests_with_stay(tiny_llama_dir: Path) -> None:
    async with open_engine(dp_config(tiny_llama_dir, on_engine_death="stay")) as engine:
        assert engine.supervisor is not None
        pids = engine.supervisor.pids()
        collectors = await _streaming(engine, 4)
        on = {rid: engine.frontend.registry[rid].replica for rid in collectors}
        assert sorted(on.values()) == [0, 0, 1, 1]
        os.kill(pids["engine1"], signal.SIGKILL)
        outcomes = {}
        with trio.fail_after(60):  # a guard against a hang; the cause is asserted below
            for rid, col in collectors.items():
                if on[rid] == 1:
                    outcomes[rid] = await _outcome(col)
        message = "engine1 process exited with code -9 (killed by SIGKILL)"
        assert {(str(e), e.code) for e in outcomes.values() if e} == {(message, "engine_dead")}
        assert all(outcomes.values())
        # The other replica's requests run to their end; the engine serves on.
        for rid, col in collectors.items():
            if on[rid] == 0:
                assert await _outcome(col) is None
        assert engine.alive
        for i in range(3):
            res = await collect(engine, f"after{i}", PROMPTS[i], greedy())
            assert res.error is None and len(res.outputs[0].token_ids) == MAX_TOKENS
        app = app_for(engine)
        assert (await Call("/health", method="GET").run(app)).status == 200
        metrics = b"".join((await Call("/metrics", method="GET").run(app)).chunks).decode()
        assert 'actorllm:replica_up{replica="1"} 0.0' in metrics
        assert 'actorllm:replica_up{replica="0"} 1.0' in metrics
        assert sample(engine, "replica_up", replica="1") == 0.0
        assert sample(engine, "replica_deaths_total") == 1.0
        assert sample(engine, "aborted_requests_total", reason="engine_dead") == 2.0
        assert await engine.wait_drained(timeout=15) == []
        # With the last replica gone, the engine is dead.
        os.kill(pids["engine0"], signal.SIGKILL)
        with trio.fail_after(60):  # a guard against a hang
            await engine.died.wait()
        assert not engine.alive
        assert (await Call("/health", method="GET").run(app)).status == 503
        # Every replica dead: a new request is refused, naming the last one to die.
        with pytest.raises(RequestError, match="engine0 process exited") as refused:
            await engine.submit(make_request("late", PROMPTS[0], greedy()))
        assert refused.value.code == "engine_dead"
    assert engine.frontend.registry == {}


async def test_killed_replica_without_stay_kills_the_engine(tiny_llama_dir: Path) -> None:
    async with open_engine(dp_config(tiny_llama_dir)) as engine:
        assert engine.supervisor is not None
        collectors = await _streaming(engine, 2)
        assert {engine.frontend.registry[rid].replica for rid in collectors} == {0, 1}
        os.kill(engine.supervisor.pids()["engine0"], signal.SIGKILL)
        errors = [await _outcome(col) for col in collectors.values()]
        message = "engine0 process exited with code -9 (killed by SIGKILL)"
        assert {(str(e), e.code) for e in errors if e} == {(message, "engine_dead")}
        assert all(errors)
        assert not engine.alive
        with pytest.raises(RequestError, match="engine0 process exited"):
            await engine.submit(make_request("late", "Hi", greedy()))
