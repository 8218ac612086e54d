"""Speculative decoding with a draft model (``{"method": "draft_model"}``): greedy output
token-identical to transformers with a random draft (few drafts accepted) and with the
target's own weights as the draft (all accepted: the bonus token), under preemption,
chunked prefill, prefix caching and overlap scheduling, in the engine topology; aborts
that leak nothing; sampled rows keep their distribution; bad configs refused in one
line; the Scheduler's placeholders."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import abort_three_of_four, build_tiny_model, collect_all, hf_greedy, hf_model

from actorllm.config import EngineConfig, SpeculativeConfig
from actorllm.engine.async_engine import AsyncEngine, Resources, open_engine
from actorllm.llm import collect
from actorllm.scheduler.sequence import Sequence
from actorllm.scheduler.speculation import DRAFT_PLACEHOLDER, Speculation
from actorllm.wire.messages import SamplingParams

K = 3


def draft_spec(model: Path, k: int = K) -> dict[str, object]:
    # Every row drafts k here, as on a GPU (the CPU's default shares 8 draft tokens a step).
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k,
            "max_draft_tokens_per_step": 1024}


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A smaller random Llama with the same vocabulary: one layer, other heads and head
    size (its cache has its own shape), so its drafts are mostly rejected."""
    return build_tiny_model(tmp_path_factory.mktemp("draft-llama"), "llama",
                            tokenizer_dir=tokenizer_dir, seed=7, num_hidden_layers=1,
                            hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8, intermediate_size=64)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Eight prompts of 5 to 19 tokens; the last two repeat the first two (prefix hits)."""
    ps = [[(7 * i + 13 * j) % 300 + 5 for j in range(5 + 2 * i)] for i in range(6)]
    return [*ps, ps[0], ps[1]]


_resources: dict[tuple[str, ...], Resources] = {}


@asynccontextmanager
async def draft_engine(model: Path, spec: Any, *, num_kv_blocks: int = 128,
                       max_model_len: int = 64, **kw: Any) -> AsyncIterator[AsyncEngine]:
    config = EngineConfig(model=str(model), num_kv_blocks=num_kv_blocks, block_size=4,
                          max_model_len=max_model_len, speculative_config=spec, **kw)
    key = (str(model), str(num_kv_blocks), str(max_model_len), json.dumps(spec),
           config.attention_backend)
    if key not in _resources:  # (the runner holds the draft: one per spec)
        _resources[key] = Resources(config)
    async with open_engine(config, resources=_resources[key]) as engine:
        yield engine
        assert await engine.wait_drained() == []


def expected(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = hf_model(model_dir)
    return [hf_greedy(model, p, n)[0] for p in prompts]


@pytest.mark.parametrize(("draft", "overlap", "attention"), [
    ("random", False, "auto"), ("random", True, "auto"), ("self", False, "auto"),
    ("self", True, "auto"), ("random", False, "torch")])
async def test_greedy_equals_transformers_with_a_draft_model(
        tiny_llama_dir: Path, random_draft_dir: Path, prompts: list[list[int]], draft: str,
        overlap: bool, attention: str) -> None:
    """A 20-block pool (preemption), a 16-token budget (chunked prefill), one or two
    steps in flight; then a prompt sent again once its first run is over (a prefix-cache
    hit). The random draft's proposals are mostly rejected; the target's own weights as
    the draft have all accepted. On the CPU backend the draft's one-token passes run in
    one op; on torch's, the module."""
    max_new = 20
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    draft_dir = random_draft_dir if draft == "random" else tiny_llama_dir
    async with draft_engine(tiny_llama_dir, draft_spec(draft_dir), num_kv_blocks=20,
                            max_num_batched_tokens=16, async_scheduling=overlap,
                            attention_backend=attention) as engine:
        runner = engine.resources.runner
        one_op = runner.one_op_draft_steps
        results = await collect_all(engine, prompts, params)
        stats = engine.frontend.stats
        # Whether the repeats above hit depends on when each arrives (a twin's blocks are
        # hashed only once its step is back, and may be evicted by then); a prompt run
        # again after its first run ended always does.
        first = await collect(engine, "again0", prompts[5], params)
        hits = engine.frontend.stats.prefix_cache_hits
        second = await collect(engine, "again1", prompts[5], params)
        hits = engine.frontend.stats.prefix_cache_hits - hits
        # A row alone drafts up to K once its drafts are accepted; beside other rows the
        # cost model drafts fewer, by how the rows happened to share steps.
        alone = engine.frontend.stats
    # With the one-op decode step the target verifies in it too, as one-token rows.
    assert (runner.one_op_draft_steps > one_op) == (runner.decode_step is not None)
    assert stats.num_preemptions > 0, "the test must exercise preemption"
    assert hits > 0, "and prefix caching"
    assert first.outputs[0].token_ids == second.outputs[0].token_ids \
        == results[5].outputs[0].token_ids
    assert stats.spec_draft_tokens > 0 and stats.spec_num_drafts > 0
    assert sum(stats.spec_accepted_per_pos) == stats.spec_accepted_tokens
    if draft == "random":
        assert stats.spec_accepted_tokens < stats.spec_draft_tokens / 2, "mostly rejected"
    else:  # the same model drafts what it then verifies (fp32: no near-ties expected)
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
        assert alone.spec_accepted_tokens == alone.spec_draft_tokens
        assert alone.spec_accepted_per_pos[K - 1] > 0, "full acceptance: the bonus token"
    for prompt, res, want in zip(prompts, results, expected(tiny_llama_dir, prompts, max_new),
                                 strict=True):
        (out,) = res.outputs
        assert list(out.token_ids) == want, prompt
        assert out.finish_reason == "length" and res.error is None


async def test_greedy_equals_transformers_in_the_engine_topology(
        tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    async with draft_engine(tiny_llama_dir, draft_spec(tiny_llama_dir),
                            topology="engine") as engine:
        results = await collect_all(engine, prompts[:3], params)
        stats = engine.frontend.stats
    assert stats.spec_accepted_tokens > 0
    for res, want in zip(results, expected(tiny_llama_dir, prompts[:3], 12), strict=True):
        assert list(res.outputs[0].token_ids) == want


async def test_a_steadily_decoding_row_drafts_under_overlap_as_serve_runs(
        tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    """``actorllm serve``'s engine (overlap on), one request at a time, the target as its
    own draft: the decoding row is not planned ahead, so the draft proposes at its steps
    (all accepted), and the tokens are transformers'."""
    max_new = 16
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    async with draft_engine(tiny_llama_dir, draft_spec(tiny_llama_dir), num_kv_blocks=96,
                            serving_http=True) as engine:
        assert engine.config.overlap, "serve's default in single on the CPU"
        got = [list((await collect(engine, f"s{i}", p, params)).outputs[0].token_ids)
               for i, p in enumerate(prompts[:2])]
        stats = engine.frontend.stats
    # A step that verifies K drafts emits K + 1 tokens: 15 decoded tokens, about 4 steps.
    assert stats.spec_num_drafts >= 2 * 3, stats
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    assert got == expected(tiny_llama_dir, prompts[:2], max_new)


async def test_abort_mid_speculation_leaks_nothing(
        tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    """Requests aborted while their drafts are in flight: the engine drains (no block,
    sequence or Worker state left: draft_engine checks) and the others finish."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    async with draft_engine(tiny_llama_dir, draft_spec(tiny_llama_dir)) as engine:
        ends = await abort_three_of_four(engine, prompts, params)
        stats = engine.frontend.stats
    assert ends == ["abort", "abort", "abort", "length"]
    assert stats.spec_draft_tokens > 0


async def test_sampled_outputs_follow_the_same_distribution_with_a_draft(
        tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    """300 seeded requests, top-k 3 at temperature 1.5: the joint distribution of the
    first two tokens (the second verified by rejection against the draft's point mass:
    the target's own argmax, accepted with its probability, else redrawn) with a draft
    against none, a chi-square test of homogeneity over the 3 x 3 pairs. 99.99th
    percentile at 8 degrees of freedom: 31.8."""
    n = 300
    counts: dict[bool, Counter[tuple[int, ...]]] = {}
    for spec in (False, True):
        params = [SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True,
                                 seed=i) for i in range(n)]
        async with draft_engine(tiny_llama_dir,
                                draft_spec(tiny_llama_dir, 2) if spec else None,
                                max_num_seqs=128, num_kv_blocks=256) as engine:
            results: list[Any] = [None] * n

            async def one(i: int) -> None:
                results[i] = await collect(engine, f"d{i}", prompts[2], params[i])  # noqa: B023

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
            stats = engine.frontend.stats
        counts[spec] = Counter(tuple(r.outputs[0].token_ids[:2]) for r in results)
        if spec:
            assert stats.spec_num_drafts > n / 4
            assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    cells = sorted(set(counts[False]) | set(counts[True]))
    assert len(cells) <= 9
    chi = sum((counts[False][c] - counts[True][c]) ** 2 / (counts[False][c] + counts[True][c])
              for c in cells)
    assert chi < 31.8, (counts[False], counts[True])


def test_llm_and_the_cli_take_a_draft_model(tiny_llama_dir: Path, random_draft_dir: Path,
                                            prompts: list[list[int]]) -> None:
    from actorllm.llm import LLM

    llm = LLM(str(tiny_llama_dir), speculative_config=draft_spec(random_draft_dir),
              num_kv_blocks=64, block_size=4, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    (res,) = llm.generate([prompts[3]], params)
    assert list(res.outputs[0].token_ids) == expected(tiny_llama_dir, [prompts[3]], 10)[0]
    out = subprocess.run(
        [sys.executable, "-m", "actorllm", "run", "--model", str(tiny_llama_dir),
         "--speculative-config", json.dumps(draft_spec(tiny_llama_dir)),
         "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--output", "jsonl",
         "--max-model-len", "64", "hello world"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert '"finish_reason": "length"' in out.stdout, out.stdout


# --- refusals -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    """A config.json like the tiny Llama's with another vocab_size (the check reads only
    config.json, before any weights load)."""
    path = tmp_path_factory.mktemp("other-vocab")
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg["vocab_size"] += 8
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_draft_model_configs_are_checked(tiny_llama_dir: Path, other_vocab_dir: Path,
                                         tmp_path: Path) -> None:
    model = str(tiny_llama_dir)
    assert SpeculativeConfig.parse(draft_spec(tiny_llama_dir)) == SpeculativeConfig(
        "draft_model", K, model=model, max_draft_tokens_per_step=1024)
    for spec, words in (({"method": "draft_model", "num_speculative_tokens": 2}, "needs"),
                        (draft_spec(tmp_path / "nope"), "does not exist"),
                        (draft_spec(other_vocab_dir), "vocab_size"),
                        ({**draft_spec(tiny_llama_dir), "prompt_lookup_max": 2}, "unknown key"),
                        ({"method": "ngram", "num_speculative_tokens": 2, "model": model},
                         "unknown key")):
        with pytest.raises(ValueError, match=words):
            EngineConfig(model=model, speculative_config=spec)
    with pytest.raises(ValueError, match="tensor-parallel"):
        EngineConfig(model=model, speculative_config=draft_spec(tiny_llama_dir),
                     tensor_parallel_size=2)


@pytest.mark.parametrize(("command", "bad"), [("run", "missing"), ("serve", "vocab")])
def test_a_bad_draft_model_is_one_line_and_exit_2(tiny_llama_dir: Path, other_vocab_dir: Path,
                                                  tmp_path: Path, command: str,
                                                  bad: str) -> None:
    draft = tmp_path / "missing" if bad == "missing" else other_vocab_dir
    args = [command, "--model", str(tiny_llama_dir), "--speculative-config",
            json.dumps(draft_spec(draft)), *(["x"] if command == "run" else [])]
    out = subprocess.run([sys.executable, "-m", "actorllm", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--speculative-config" in lines[0], out.stderr


# --- the Scheduler's side ----------------------------------------------------------------------


def test_draft_model_rows_carry_placeholders_and_back_off(tiny_llama_dir: Path) -> None:
    """The Scheduler plans a draft_model row like an n-gram one without knowing the
    tokens: K placeholders, never past max_tokens, none for logprob rows, and the same
    back-off once proposals of which nothing was accepted bring the estimate below
    paying."""
    spec = Speculation(SpeculativeConfig("draft_model", 4, model=str(tiny_llama_dir)))
    seq = Sequence("a", [9, 8, 7], SamplingParams(max_tokens=3), 3, frozenset())
    assert spec.propose(seq, 10) == [DRAFT_PLACEHOLDER] * 2
    assert spec.propose(seq, 1) == [DRAFT_PLACEHOLDER]
    lp = Sequence("b", [9, 8, 7], SamplingParams(logprobs=1), 16, frozenset())
    assert spec.propose(lp, 10) == []
    spec.verdict(seq, 2, 0)  # the estimate, 0.3, still pays ...
    assert seq.spec_skip == 0
    spec.verdict(seq, 2, 0)  # ... 0.2 does not: back-off, then a probe of one draft
    assert seq.spec_skip == 2
    assert [len(spec.propose(seq, 10)) for _ in range(5)] == [0, 0, 0, 0, 1]


async def test_resources_built_without_the_draft_are_refused(tiny_llama_dir: Path,
                                                             random_draft_dir: Path) -> None:
    """Resources outlive an engine run; a runner built without a draft, reused with a
    draft_model config, would leave every draft a placeholder, all rejected: exact output,
    no speculation, no word. open_engine refuses the pair instead."""
    plain = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=32, block_size=4,
                         max_model_len=64)
    resources = Resources(plain)
    spec = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=32, block_size=4,
                        max_model_len=64, speculative_config=draft_spec(random_draft_dir))
    with pytest.raises(ValueError, match="draft model None"):
        async with open_engine(spec, resources=resources):
            pass
