"""End to end through all five actors on the CPU, checked against transformers.

Every test ends with the drain invariants (DESIGN.md §3, invariant 4): no blocks in
use, every registry, ledger and mailbox empty, the Worker holding no rid.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import hf_greedy

from actorllm.config import TOPOLOGIES, EngineConfig
from actorllm.engine.async_engine import AsyncEngine, Resources, open_engine
from actorllm.frontend.actor import DuplicateRequestId
from actorllm.llm import GenerationResult, collect
from actorllm.wire.messages import ChatMessage, GenerateRequest, SamplingParams
from actorllm.wire.outputs import RequestError

PROMPTS = [
    "hello",
    "the quick brown fox jumps over the lazy dog",
    "a",
    "once upon a time, in a land far away, there lived a very patient engineer who "
    "wrote tests for every corner of a server",
    "what is the answer?",
    "numbers 1 2 3 4 5 6 7 8 9 10 11 12",
    "short",
    "The state machine is a table you can read top to bottom, and so is this prompt.",
    "x y z",
]

# The contract every topology keeps, whether the worker and detokenizer run here or in child
# processes: streamed text, abort, errors. Each process engine costs ~5 s to start on a busy
# box, so only these run on all three; the rest stay single (test_topology.py compares the
# greedy answers of every topology).
ALL_TOPOLOGIES = pytest.mark.parametrize("topology", TOPOLOGIES)

_resources: dict[tuple[str, int, int | None], Resources] = {}


def resources_for(model: Path, *, num_kv_blocks: int = 64, block_size: int = 4,
                  max_model_len: int | None = 128, **kw: Any) -> tuple[EngineConfig, Resources]:
    """Weights load once per (model, cache size); each test starts fresh actors."""
    config = EngineConfig(model=str(model), num_kv_blocks=num_kv_blocks, block_size=block_size,
                          max_model_len=max_model_len, **kw)
    key = (str(model), num_kv_blocks, max_model_len)
    if key not in _resources or _resources[key].config.block_size != block_size:
        _resources[key] = Resources(config)
    return config, _resources[key]


@asynccontextmanager
async def engine_for(model: Path, **kw: Any) -> AsyncIterator[AsyncEngine]:
    config, res = resources_for(model, **kw)
    async with open_engine(config, resources=res) as engine:
        yield engine
        assert await engine.wait_drained() == []


async def run_all(engine: AsyncEngine, prompts: list[Any],
                  params: SamplingParams | list[SamplingParams]) -> list[GenerationResult]:
    """Submit every prompt at once; results in prompt order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    results: list[GenerationResult | None] = [None] * len(prompts)
    batch = engine.new_rid("t")

    async def one(i: int) -> None:
        results[i] = await collect(engine, f"{batch}-{i}", prompts[i], plist[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return [r for r in results if r is not None]


@pytest.mark.parametrize(("model_fixture", "overlap"), [
    ("tiny_llama_dir", False), ("tiny_qwen2_dir", False), ("tiny_llama_dir", True)])
async def test_greedy_equals_transformers_under_preemption_and_chunked_prefill(
    model_fixture: str, overlap: bool, request: pytest.FixtureRequest
) -> None:
    model: Path = request.getfixturevalue(model_fixture)
    max_new = 24
    # 40 blocks of 4 tokens: the 9 sequences need ~3x that, so the Scheduler must preempt;
    # a 16-token budget splits every prompt longer than 16 into chunks. With overlap the
    # Worker feeds each sampled token forward into a step planned before it was known.
    async with engine_for(model, num_kv_blocks=40, max_num_batched_tokens=16,
                          async_scheduling=overlap) as engine:
        runner = engine.actors["worker"].runner  # shared across tests: count from here
        fed_before = runner.fed_forward
        params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True,
                                logprobs=2)
        results = await run_all(engine, PROMPTS, params)
        stats = engine.frontend.stats
        # The model directory's own tokenizer: transformers 5 picks the class from the
        # model type (Qwen2 splits digits), so it may differ from the bare tokenizer's.
        tokenizer = engine.tokenizer
        fed = runner.fed_forward - fed_before
    assert stats.num_preemptions > 0, "the test must exercise preemption"
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > 16, "and chunked prefill"
    assert (fed > 0) == overlap, f"{fed} tokens fed forward"
    for prompt, res in zip(PROMPTS, results, strict=True):
        ids = tokenizer(prompt).input_ids
        ref_ids, ref_lps = hf_greedy(model, ids, max_new)
        (out,) = res.outputs
        assert list(out.token_ids) == ref_ids, prompt
        assert out.finish_reason == "length"
        got_lps = [lp.logprob for lp in out.logprobs]
        assert got_lps == pytest.approx(ref_lps, abs=1e-4)
        for lp in out.logprobs:  # the chosen token's logprob, then 2 alternatives, sorted
            assert len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1]
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert res.usage == {"prompt_tokens": len(ids), "completion_tokens": max_new}


async def test_seeded_sampling_is_independent_of_the_batch(tiny_llama_dir: Path) -> None:
    target = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16,
                            ignore_eos=True)
    async with engine_for(tiny_llama_dir) as engine:
        (alone,) = await run_all(engine, ["seeded prompt"], target)
    others = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    async with engine_for(tiny_llama_dir, num_kv_blocks=36, max_num_batched_tokens=8) as engine:
        crowd = await run_all(engine, [*PROMPTS[:5], "seeded prompt"], [others] * 5 + [target])
    assert crowd[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    async with engine_for(tiny_llama_dir) as engine:
        (other_seed,) = await run_all(engine, ["seeded prompt"],
                                      SamplingParams(temperature=1.0, top_p=0.9, top_k=50,
                                                     seed=4321, max_tokens=16, ignore_eos=True))
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


async def test_n_greater_than_one_fans_out_and_gathers(tiny_llama_dir: Path) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    async with engine_for(tiny_llama_dir) as engine:
        (res,) = await run_all(engine, ["fan out"], params)
        singles = await run_all(
            engine, ["fan out"] * 3,
            [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=10, ignore_eos=True)
             for i in range(3)])
    assert [o.index for o in res.outputs] == [0, 1, 2]
    # Child i is an ordinary request with seed + i: the same tokens as asked alone.
    for i, o in enumerate(res.outputs):
        assert o.token_ids == singles[i].outputs[0].token_ids
        assert o.finish_reason == "length"
    assert len({o.token_ids for o in res.outputs}) > 1


async def test_stop_string_across_token_boundaries(tiny_llama_dir: Path,
                                                   tiny_tokenizer: Any) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    async with engine_for(tiny_llama_dir) as engine:
        (full,) = await run_all(engine, ["stop here"], greedy)
        ids = full.outputs[0].token_ids
        pieces = [tiny_tokenizer.decode(ids[:i], skip_special_tokens=True)
                  for i in range(len(ids) + 1)]
        # A stop string that starts inside token 3 and ends inside a later token.
        start = len(pieces[3]) - 1
        stop = full.outputs[0].text[start : start + 4]
        assert len(stop) == 4
        first = full.outputs[0].text.find(stop)
        (cut,) = await run_all(engine, ["stop here"],
                               SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                              stop=(stop,)))
        (kept,) = await run_all(engine, ["stop here"],
                                SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                               stop=(stop,), include_stop_str_in_output=True))
    out = cut.outputs[0]
    assert out.text == full.outputs[0].text[:first]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert kept.outputs[0].text == full.outputs[0].text[: first + len(stop)]
    # Tokens delivered end with the one that completed the stop string.
    delivered = tiny_tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert delivered.startswith(full.outputs[0].text[: first + 4])


@ALL_TOPOLOGIES
async def test_streamed_deltas_are_whole_characters_and_add_up(tiny_llama_dir: Path, topology: str,
                                                               tiny_tokenizer: Any) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    async with engine_for(tiny_llama_dir, topology=topology) as engine:
        for k, prompt in enumerate(["世界 🙂 café", "naïve → ünïcödé"]):
            texts, ids = [], []
            async for out in engine.generate(GenerateRequest(f"u{k}", params, prompt=prompt)):
                for o in out.outputs:
                    texts.append(o.text)
                    ids.extend(o.token_ids)
            assert "".join(texts) == tiny_tokenizer.decode(ids, skip_special_tokens=True)
            # Only the final flush may carry an incomplete character's replacement.
            assert all("\ufffd" not in t for t in texts[:-1] if t) or "\ufffd" in \
                tiny_tokenizer.decode(ids, skip_special_tokens=True)


async def test_chat_messages_use_the_chat_template(tiny_llama_dir: Path,
                                                   tiny_tokenizer: Any) -> None:
    msgs = (ChatMessage("user", "hi there"),)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    async with engine_for(tiny_llama_dir) as engine:
        (res,) = await run_all(engine, [list(msgs)], params)
    ids = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}],
                                             add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert res.num_prompt_tokens == len(ids)
    assert list(res.outputs[0].token_ids) == hf_greedy(tiny_llama_dir, list(ids), 5)[0]


async def test_abort_of_a_waiting_request(tiny_llama_dir: Path) -> None:
    async with engine_for(tiny_llama_dir, max_num_seqs=1) as engine:
        long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        first = await engine.submit(GenerateRequest("first", long, prompt="keep me busy"))
        second = await engine.submit(GenerateRequest("second", long, prompt="wait for me"))
        await first.get()  # the first is running, so the second waits
        await engine.abort("second")
        outs = [o async for o in second]
        assert outs and outs[-1].finished
        assert outs[-1].outputs[-1].finish_reason == "abort"
        assert sum(len(o.token_ids) for out in outs for o in out.outputs) == 0
        await engine.abort("first")
        async for _ in first:
            pass


@ALL_TOPOLOGIES
async def test_abort_mid_stream_double_abort_and_abort_after_finish(tiny_llama_dir: Path,
                                                                    topology: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    async with engine_for(tiny_llama_dir, topology=topology) as engine:
        col = await engine.submit(GenerateRequest("r", params, prompt="abort me"))
        got = 0
        while got < 3:
            out = await col.get()
            got += sum(len(o.token_ids) for o in out.outputs)
        await engine.abort("r")
        await engine.abort("r")  # idempotent
        rest = [o async for o in col]
        assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
        total = got + sum(len(o.token_ids) for out in rest for o in out.outputs)
        assert total < 100
        await engine.abort("r")  # after the end: a no-op
        short = SamplingParams(temperature=0.0, max_tokens=2)
        (done,) = await run_all(engine, ["done"], short)
        await engine.abort(done.rid)  # finished already
        assert done.error is None


async def test_leaving_the_stream_early_aborts(tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    async with engine_for(tiny_llama_dir) as engine:
        with trio.move_on_after(5):
            async for _ in engine.generate(GenerateRequest("gone", params, prompt="bye")):
                break  # the client disconnects after the first output
        assert await engine.wait_drained() == []
        assert engine.metrics.registry.get_sample_value("actorllm:aborted_requests_total",
                                                   {"reason": "client_disconnect"}) == 1


@ALL_TOPOLOGIES
async def test_bad_inputs_fail_alone_with_clear_errors(tiny_llama_dir: Path, topology: str) -> None:
    async with engine_for(tiny_llama_dir, max_model_len=64, topology=topology) as engine:
        ok = SamplingParams(temperature=0.0, max_tokens=4)
        results = await run_all(
            engine,
            ["", "fine", "word " * 80, [999999]],
            [ok, ok, ok, ok],
        )
        assert results[1].error is None and len(results[1].outputs[0].token_ids) == 4
        assert "empty" in (results[0].error or "")
        assert "maximum context length is 64" in (results[2].error or "")
        assert "vocabulary" in (results[3].error or "")
        with pytest.raises(RequestError) as info:
            async for _ in engine.generate(
                GenerateRequest("bad-temp", SamplingParams(temperature=-1), prompt="x")):
                pass
        assert info.value.code == "invalid_request" and info.value.param == "temperature"


async def test_live_duplicate_rid_is_rejected_and_reusable_after(tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    async with engine_for(tiny_llama_dir) as engine:
        col = await engine.submit(GenerateRequest("dup", params, prompt="one"))
        with pytest.raises(DuplicateRequestId):
            await engine.submit(GenerateRequest("dup", params, prompt="two"))
        with pytest.raises(DuplicateRequestId):  # a child id of a live parent collides too
            await engine.submit(GenerateRequest("dup", SamplingParams(n=2), prompt="two"))
        async for _ in col:
            pass
        assert await engine.wait_drained() == []
        (again,) = await run_all(engine, ["three"], SamplingParams(max_tokens=2))
        assert again.error is None


async def test_slow_reader_holds_one_merged_output(tiny_llama_dir: Path,
                                                   tiny_tokenizer: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    async with engine_for(tiny_llama_dir) as engine:
        col = await engine.submit(GenerateRequest("slow", params, prompt="slow reader"))
        with trio.fail_after(30):
            while not col.finished:
                await trio.sleep(0.01)  # read nothing while the request runs to the end
        assert col.pending_items() == 1  # O(1): every delta merged into one item
        (out,) = [o async for o in col]
        assert out.finished
        (choice,) = out.outputs
        assert len(choice.token_ids) == 30
        assert choice.text == tiny_tokenizer.decode(choice.token_ids, skip_special_tokens=True)


async def test_n_greater_than_one_with_a_bad_prompt_fails_once_and_drains(
    tiny_llama_dir: Path,
) -> None:
    async with engine_for(tiny_llama_dir) as engine:
        with pytest.raises(RequestError, match="empty"):
            async for _ in engine.generate(GenerateRequest("p", SamplingParams(n=3),
                                                           prompt="")):
                pass
        assert await engine.wait_drained() == []
        assert "p" not in engine.frontend.registry


async def test_aborting_a_parent_aborts_every_child(tiny_llama_dir: Path) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=100, ignore_eos=True)
    async with engine_for(tiny_llama_dir) as engine:
        col = await engine.submit(GenerateRequest("fan", params, prompt="abort us all"))
        outs = [await col.get()]
        await engine.abort("fan")
        outs += [o async for o in col]
        reasons = {o.index: o.finish_reason for out in outs for o in out.outputs
                   if o.finish_reason}
        tokens = sum(len(o.token_ids) for out in outs for o in out.outputs)
    assert outs[-1].finished
    assert reasons == {0: "abort", 1: "abort", 2: "abort"}
    assert tokens < 300


def test_the_first_step_is_planned_before_the_last_prompt_is_submitted(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    """``LLM.generate`` submits its prompts a chunk a turn of the event loop: the first
    step is planned while later prompts are still being registered (all at once, every
    prompt went through the Frontend and the Tokenizer before the Scheduler heard of the
    first). Read from the trace: the first plan comes before the last ``register``."""
    import json

    from actorllm.llm import LLM, SUBMIT_CHUNK

    trace = tmp_path / "trace.jsonl"
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=512, trace=str(trace))
    prompts = [[5 + i % 40, 6, 7, 8] for i in range(8 * SUBMIT_CHUNK)]
    results = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))
    assert [r.error for r in results] == [None] * len(prompts)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    registers = [i for i, line in enumerate(lines) if line.get("event") == "register"]
    plans = [i for i, line in enumerate(lines) if line.get("kind") == "plan"]
    assert len(registers) == len(prompts) and plans
    assert plans[0] < registers[-1]
