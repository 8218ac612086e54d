"""Decode steps captured in CUDA graphs and replayed (worker/cuda_graphs.py), on a GPU.

Skipped, with the reason shown, where torch sees no GPU or CuPy cannot be imported; the
padding and the runner's use of the graphs are tested on the CPU too
(tests/test_cuda_graphs.py), without the capture.

- A replay gives what the eager forward pass gives for the same rows, with the attention
  split planned for the same bound (the graph plans for the longest context), and writes
  the same K/V; padding rows write none.
- The engine with ``cuda_graphs=True`` gives the tokens it gives without, where they
  differ only at near-ties (a padded matmul may round otherwise: the rule of
  test_engine_cuda.py), and its decode steps did replay graphs.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_model
from test_engine_cuda import PROMPTS, WHY_NOT, assert_same_or_near_tie
from transformers import AutoTokenizer

from actorllm import LLM, SamplingParams
from actorllm.model import ForwardBatch
from actorllm.worker.runner import ModelRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

BLOCK = 16


def _model(tmp_path: Path, tokenizer_dir: Path) -> Path:
    return build_tiny_model(tmp_path / "m", "llama", tokenizer_dir=tokenizer_dir,
                            hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, intermediate_size=512)


def _decode_batch(n: int, max_len: int, free: list[int], rng: random.Random,
                  bound: int) -> ForwardBatch:
    rows = []
    for _ in range(n):
        pos = rng.randrange(1, max_len - 1)
        rows.append((rng.randrange(3, 300), pos, [free.pop() for _ in range(pos // BLOCK + 1)]))
    width = max(len(t) for _, _, t in rows)
    on = {"device": "cuda"}
    pos = torch.tensor([p for _, p, _ in rows], **on)
    return ForwardBatch(
        input_ids=torch.tensor([t for t, _, _ in rows], **on), positions=pos,
        slot_mapping=torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for _, p, t in rows], **on),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for _, _, t in rows],
                                  dtype=torch.int32, **on),
        seq_lens=(pos + 1).int(), cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, **on),
        sample_indices=torch.arange(n, **on), max_seqlen_q=1, max_seqlen_k=bound)


def test_replay_matches_the_eager_forward(tmp_path: Path, tokenizer_dir: Path) -> None:
    runner = ModelRunner(_model(tmp_path, tokenizer_dir), num_blocks=512, block_size=BLOCK,
                         device="cuda", attention_backend="cuda", cuda_graph_rows=16)
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes == (1, 2, 4, 8, 16)
    torch.manual_seed(0)
    for k, v in runner.kv_caches:
        k.normal_(), v.normal_()
    eager = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    free = list(range(runner.num_blocks))
    rng = random.Random(0)
    rng.shuffle(free)
    max_len = min(runner.max_model_len, 200)
    with torch.inference_mode():
        for n in (13, 3, 16, 1):
            batch = _decode_batch(n, max_len, free, rng, graphs.max_seqlen_k)
            assert graphs.applies(batch)
            got = graphs.run(batch).clone()
            want = runner.model(batch, eager, runner.backend)
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(runner.kv_caches, eager, atol=2e-2, rtol=2e-2)
    assert graphs.replays == 4


def test_engine_with_graphs_gives_the_eager_engine_tokens(tmp_path: Path,
                                                          tokenizer_dir: Path) -> None:
    model = _model(tmp_path, tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM(model=str(model), device="cuda", dtype="bfloat16", attention_backend="cuda",
                  block_size=BLOCK, num_kv_blocks=256, max_num_seqs=8, cuda_graphs=graphs)
        outs[graphs] = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params)]
        runner = llm.resources.runner
        assert (runner.graphs is not None) == graphs
        if graphs:
            assert runner.graphs.replays > 0
        llm.close()
    assert all(len(x) == 32 for x in outs[False] + outs[True])
    assert_same_or_near_tie(model, prompts, outs[False], outs[True], "bfloat16")
