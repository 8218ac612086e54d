"""The Worker's start-up step (topology/warmup.py): its plans, and that it leaves nothing.

A server's Worker runs one step of ``max_num_batched_tokens`` before its first plan, in
its own step thread, so the first burst does not pay for a cold step; the step must
leave no rid behind and change no answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from actorllm.config import EngineConfig, read_model_info
from actorllm.engine.async_engine import Resources, open_engine
from actorllm.llm import collect
from actorllm.topology import warmup
from actorllm.topology.placement import large_step_threads
from actorllm.wire.sampling import SamplingParams
from actorllm.worker.runner import ModelRunner


def test_the_plans_fill_the_budget_in_rows_of_their_own_blocks() -> None:
    step, drop = warmup.warmup_plans(300, block_size=16, num_blocks=100, max_model_len=256,
                                     vocab_size=50)
    assert step.num_tokens == (128, 128, 44)
    assert sum(step.num_tokens) == len(step.token_ids) == 300
    assert step.num_new_blocks == (8, 8, 3)
    assert sorted(step.new_blocks) == list(range(19))  # distinct, from the pool's start
    assert all(0 <= t < 50 for t in step.token_ids)
    assert all(step.sample) and step.start_pos == (0, 0, 0)
    assert [n.prompt_token_ids for n in step.new] == [
        step.token_ids[:128], step.token_ids[128:256], step.token_ids[256:]]
    assert all(n.params.temperature == 0.0 for n in step.new)  # greedy: no random draw
    assert drop.rids == () and set(drop.drop) == set(step.rids)


def test_the_plans_fit_a_small_pool_and_a_short_context() -> None:
    (step, _) = warmup.warmup_plans(2048, block_size=16, num_blocks=17, max_model_len=256,
                                    vocab_size=50)
    assert step.num_tokens == (128, 128)  # two rows of 8 blocks: 16 of the 17
    (step, _) = warmup.warmup_plans(100, block_size=4, num_blocks=64, max_model_len=33,
                                    vocab_size=50)
    assert step.num_tokens == (32, 32, 32, 4)
    assert max(step.new_blocks) < 64
    assert warmup.warmup_plans(64, block_size=16, num_blocks=0, max_model_len=256,
                               vocab_size=50) == []


def test_a_warm_up_leaves_the_runner_holding_nothing(tiny_llama_dir: Path) -> None:
    runner = ModelRunner(tiny_llama_dir, num_blocks=64, block_size=16)
    warmup.warm_up(runner, 512, block_size=16, max_model_len=256, vocab_size=300)
    assert runner.num_states == 0
    assert not runner.tables.slot_of


def test_a_served_engine_warms_up_once_and_answers_as_hf(
        tiny_llama_dir: Path, hf_greedy_fn: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=16,
                          max_num_batched_tokens=512, serving_http=True)
    assert large_step_threads(config) is not None  # the Worker leaves a core: it warms up
    calls: list[int] = []
    real = warmup.warm_up

    def counted(runner: Any, tokens: int, **kw: Any) -> float:
        calls.append(tokens)
        return real(runner, tokens, **kw)

    monkeypatch.setattr(warmup, "warm_up", counted)
    prompt = [5, 17, 42, 9, 33, 2, 71]
    want, _ = hf_greedy_fn(tiny_llama_dir, prompt, 6)

    async def main() -> list[int]:
        async with open_engine(config, resources=Resources(config)) as engine:
            got = await collect(engine, "w0", prompt,
                                SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
            assert await engine.wait_drained() == []
            return list(got.outputs[0].token_ids)

    assert trio.run(main) == list(want)
    assert calls == [512]


def test_no_warm_up_offline_with_ranks_or_when_switched_off(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served = EngineConfig(model=str(tiny_llama_dir), serving_http=True)
    offline = EngineConfig(model=str(tiny_llama_dir))
    info = read_model_info(str(tiny_llama_dir))
    large = large_step_threads(served)
    assert warmup.warmup_for(served, info, None, large) is not None
    assert large_step_threads(offline) is None  # offline: no team of its own
    assert warmup.warmup_for(offline, info, None, large_step_threads(offline)) is None
    assert warmup.warmup_for(served, None, None, large) is None
    monkeypatch.setenv("ACTORLLM_WARMUP", "0")
    assert warmup.warmup_for(served, info, None, large) is None
