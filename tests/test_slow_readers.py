"""Slow and stalled readers, in-process (issue 13): pause, resume, preempt while paused,
cancel after --stream-timeout. The oracle for "nothing lost": the same greedy request read
by a reader that keeps up, token for token."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import Call, app_for

from actorllm.config import EngineConfig
from actorllm.engine.async_engine import AsyncEngine, Resources, open_engine
from actorllm.frontend.collector import OutputCollector
from actorllm.llm import collect
from actorllm.wire.messages import GenerateRequest, SamplingParams
from actorllm.wire.outputs import RequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
_resources: dict[tuple[str, int], Resources] = {}


@asynccontextmanager
async def engine_for(model: Path, num_kv_blocks: int = 64, **kw: Any
                     ) -> AsyncIterator[AsyncEngine]:
    config = EngineConfig(model=str(model), num_kv_blocks=num_kv_blocks, block_size=4,
                          max_model_len=128, **kw)
    key = (str(model), num_kv_blocks)
    if key not in _resources:
        _resources[key] = Resources(config)
    async with open_engine(config, resources=_resources[key]) as engine:
        yield engine
        assert await engine.wait_drained() == []


def sample(engine: AsyncEngine, name: str, labels: dict[str, str] | None = None) -> float:
    engine.update_gauges()
    value = engine.metrics.registry.get_sample_value(f"actorllm:{name}", labels or {})
    return 0.0 if value is None else value


async def until(cond: Any, timeout: float = 30.0) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.005)


async def reference(model: Path, prompt: str, params: SamplingParams = GREEDY) -> list[int]:
    """The tokens a reader that keeps up gets (flow control off)."""
    async with engine_for(model, max_pending_bytes_per_request=None, max_pending_bytes=None,
                          stream_timeout=None) as engine:
        res = await collect(engine, "ref", prompt, params)
    assert res.error is None
    return list(res.outputs[0].token_ids)


async def until_frozen(cond: Any, polls: int = 6000) -> None:
    """``until`` for a test on a frozen mock clock, where ``trio.sleep`` never returns: look
    every 5 ms of real time (in a thread, off trio's clock), for ``polls`` looks at most."""
    for _ in range(polls):
        if cond():
            return
        await trio.to_thread.run_sync(time.sleep, 0.005)
    raise AssertionError(f"still false after {polls} looks")


async def test_stalled_reader_is_paused_then_cancelled_after_the_timeout(
        tiny_llama_dir: Path, mock_clock: trio.testing.MockClock) -> None:
    """The stream timeout is judged on trio's clock, here a mock one that stands still until
    the test moves it: however slow the machine, the request is paused (and checked) before
    any of the timeout has passed, lives on at half of it, and is cancelled at all of it."""
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    async with engine_for(tiny_llama_dir, max_pending_bytes_per_request=16,
                          stream_timeout=0.5) as engine:
        col = await engine.submit(GenerateRequest("stall", params, prompt="a stalled reader"))
        await until_frozen(lambda: engine.frontend.stats.num_paused == 1)
        # The stats that say "paused" left the Scheduler after the pause: every token made
        # before it has arrived, and no step runs it any more.
        held = col.pending_tokens
        assert 0 < held < 120 and col.pending_bytes > 16
        assert engine.frontend.stats.num_running == 0  # a paused request holds no slot
        assert sample(engine, "requests_paused_total") == 1
        assert sample(engine, "num_requests_paused") == 1
        assert sample(engine, "pending_output_bytes") == col.pending_bytes
        assert sample(engine, "pending_output_bytes_max") == col.pending_bytes
        assert sample(engine, "oldest_undelivered_output_seconds") == 0  # no time passed
        mock_clock.jump(0.25)
        await trio.testing.wait_all_tasks_blocked()
        assert not col.engine_done.is_set()  # half the timeout: still alive
        assert sample(engine, "oldest_undelivered_output_seconds") == pytest.approx(0.25)
        mock_clock.jump(0.25)
        # From here on nothing is timed: let the clock run, so the guards below (and the
        # engine's drain on leaving) wait as they would on a real one.
        mock_clock.rate = 1.0
        with trio.fail_after(10):
            await col.engine_done.wait()  # the stream timeout ran out
        assert col.pending_tokens == held  # nothing generated while paused
        # The reader still gets every token it had not read, then the error.
        out = await col.get()
        assert len(out.outputs[0].token_ids) == held and not out.finished
        with pytest.raises(RequestError) as err:
            await col.get()
        assert err.value.code == "stream_timeout"
        assert sample(engine, "requests_cancelled_for_lag_total") == 1
        await until(lambda: sample(engine, "aborted_requests_total",
                                   {"reason": "stream_timeout"}) == 1)
        assert sample(engine, "pending_output_bytes") == 0
        assert sample(engine, "consumer_lag_tokens_count") == held
        # the histogram's sum: the lag after each token, 1 + 2 + ... + held
        assert sample(engine, "consumer_lag_tokens_sum") == held * (held + 1) / 2


async def test_a_final_only_reader_is_woken_once_and_never_paced(tiny_llama_dir: Path) -> None:
    """``LLM.generate`` and non-streaming HTTP take the whole result at the end. With the
    16-byte mark that pauses a stalled stream above, a final-only request runs to the end
    unpaused (paced, it would stall until the stream timeout cancelled it), and its reader
    is woken once, with every token."""
    prompt = "a stalled reader"
    want = await reference(tiny_llama_dir, prompt)
    async with engine_for(tiny_llama_dir, max_pending_bytes_per_request=16,
                          stream_timeout=0.5) as engine:
        request = GenerateRequest("whole", GREEDY, prompt=prompt)
        outs = [out async for out in engine.generate(request, final_only=True)]
        assert len(outs) == 1 and outs[0].finished
        assert list(outs[0].outputs[0].token_ids) == want
        assert sample(engine, "requests_paused_total") == 0
        assert sample(engine, "consumer_lag_tokens_count") == 0
        assert sample(engine, "pending_output_bytes") == 0


async def read_when_paused(engine: AsyncEngine, col: OutputCollector) -> tuple[list[int], int]:
    """A reader that reads only once the engine has paused its request: the token ids it
    got, and how many reads it made."""
    ids: list[int] = []
    reads = 0
    while True:
        await until(lambda: engine.frontend.stats.num_paused == 1 or col.engine_done.is_set())
        out = await col.get()
        reads += 1
        ids.extend(out.outputs[0].token_ids)
        if out.finished:
            return ids, reads
        if not col.engine_done.is_set():
            # The resume reaches the Scheduler. A fast step can run it, past the mark and
            # paused again, between two looks at the stats: new tokens say it ran too.
            await until(lambda: engine.frontend.stats.num_paused == 0 or col.pending_tokens > 0
                        or col.engine_done.is_set())


async def test_a_reader_that_catches_up_gets_every_token_once_in_order(
        tiny_llama_dir: Path) -> None:
    prompt = "a slow reader"
    want = await reference(tiny_llama_dir, prompt)
    async with engine_for(tiny_llama_dir, max_pending_bytes_per_request=24,
                          stream_timeout=None) as engine:
        col = await engine.submit(GenerateRequest("slow", GREEDY, prompt=prompt))
        ids, reads = await read_when_paused(engine, col)
        assert ids == want
        paused = sample(engine, "requests_paused_total")
        assert paused >= 2 and sample(engine, "requests_resumed_total") >= paused - 1
        # One read, one event: the merge ratio is every token over the reads.
        assert sample(engine, "tokens_per_output_event_count") == reads
        assert sample(engine, "tokens_per_output_event_sum") == len(want)


async def test_kv_pressure_preempts_a_paused_request_and_its_tokens_stay_greedy(
        tiny_llama_dir: Path) -> None:
    slow_prompt, fast_prompt = "paused under pressure", "x " * 40
    async with engine_for(tiny_llama_dir) as probe:
        n_fast = len(probe.tokenizer(fast_prompt).input_ids)
    # 32 blocks of 4: the fast request (124 tokens, 31 blocks) can only run once the
    # paused one has given its blocks back.
    fast_params = SamplingParams(temperature=0.0, max_tokens=124 - n_fast, ignore_eos=True)
    assert fast_params.max_tokens >= 8
    want_slow = await reference(tiny_llama_dir, slow_prompt)
    want_fast = await reference(tiny_llama_dir, fast_prompt, fast_params)
    async with engine_for(tiny_llama_dir, num_kv_blocks=32, max_pending_bytes_per_request=24,
                          stream_timeout=None) as engine:
        slow = await engine.submit(GenerateRequest("slow", GREEDY, prompt=slow_prompt))
        await until(lambda: engine.frontend.stats.num_paused == 1)
        assert engine.frontend.stats.kv_blocks_used > 0  # paused, it kept its KV
        before = engine.frontend.stats.num_preemptions
        fast = await collect(engine, "fast", fast_prompt, fast_params)
        assert fast.error is None and list(fast.outputs[0].token_ids) == want_fast
        assert engine.frontend.stats.num_preemptions > before  # the paused one gave way
        ids, _ = await read_when_paused(engine, slow)
        assert ids == want_slow  # recomputed after its resume: the same greedy tokens
        assert sample(engine, "num_preemptions_total") == engine.frontend.stats.num_preemptions


async def test_unread_output_over_the_global_mark_refuses_new_work(
        tiny_llama_dir: Path) -> None:
    """Admission counts what readers have not taken (not their slots): over
    --max-pending-bytes new requests get 503 overloaded until the reader catches up."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    small = {"prompt": "Hi", "max_tokens": 2}
    async with engine_for(tiny_llama_dir, max_pending_bytes_per_request=None,
                          max_pending_bytes=64, stream_timeout=None) as engine:
        app = app_for(engine, max_pending=8)
        col = await engine.submit(GenerateRequest("unread", params, prompt="nobody reads"))
        with trio.fail_after(30):
            await col.engine_done.wait()  # 40 tokens made, none read
        assert engine.frontend.pending_bytes > 64
        assert app.state.server.admission.held == 0  # it holds no slot, only bytes
        refused = await Call("/v1/completions", small).run(app)
        assert refused.status == 503, refused.chunks
        error = refused.json()["error"]
        assert error["code"] == "overloaded" and "slow clients" in error["message"]
        assert len([o async for o in col]) >= 1  # the reader takes what waits
        assert engine.frontend.pending_bytes == 0
        taken = await Call("/v1/completions", small).run(app)
        assert taken.status == 200, taken.chunks
