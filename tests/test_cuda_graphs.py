"""Decode steps in CUDA graphs (worker/cuda_graphs.py), on the CPU: the buckets, the padded
static buffers a graph replays, and the runner's use of them, with ``capture=False`` (the
padded batch run eagerly, which is what a graph would replay). The capture and replay
themselves need a GPU: tests/gpu/test_graphs_cuda.py."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy
from hypothesis import given
from hypothesis import strategies as st
from steps import Plans, execute

from actorllm.config import EngineConfig
from actorllm.model import ForwardBatch, load_model
from actorllm.model.llama import allocate_kv_caches
from actorllm.ops import select_backend
from actorllm.wire.messages import NewSeqData, SamplingParams, ScheduledSeq
from actorllm.worker.cuda_graphs import DecodeGraphs, check_graphs, graph_sizes
from actorllm.worker.runner import ModelRunner

BLOCK = 4
CPU = torch.device("cpu")


@given(st.integers(1, 600))
def test_every_row_count_has_a_bucket_at_most_8_larger(max_rows: int):
    sizes = graph_sizes(max_rows)
    assert list(sizes) == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_rows
    assert all(b - a <= 8 for a, b in itertools.pairwise(sizes))
    assert all(s in (1, 2, 4) or s % 8 == 0 or s == max_rows for s in sizes)


def test_graph_sizes_refuses_no_rows():
    with pytest.raises(ValueError, match="max_rows"):
        graph_sizes(0)


def _decode_batch(rows: list[tuple[int, int, list[int]]], slots_of: dict[int, int] | None = None
                  ) -> ForwardBatch:
    """Decode rows ``(token, position, table)``: each row's new token at ``position``."""
    width = max(len(t) for _, _, t in rows)
    tables = torch.tensor([t + [0] * (width - len(t)) for _, _, t in rows], dtype=torch.int32)
    pos = torch.tensor([p for _, p, _ in rows])
    slots = torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for _, p, t in rows])
    n = len(rows)
    return ForwardBatch(
        input_ids=torch.tensor([tok for tok, _, _ in rows]), positions=pos, slot_mapping=slots,
        block_tables=tables, seq_lens=(pos + 1).int(), cu_seqlens_q=torch.arange(n + 1).int(),
        sample_indices=torch.arange(n), max_seqlen_q=1, max_seqlen_k=int(pos.max()) + 1)


def test_padded_replay_matches_the_eager_step_and_padding_writes_nothing(tiny_llama_dir: Path):
    """Two steps, 13 rows (bucket 16) then 5 (bucket 8): the second step's padding rows
    5..7 still hold the first step's rows, slots included. Between the steps those
    blocks are freed and refilled (by another request's prefill, say); a padding row
    that kept its stale slot would overwrite them (the planted bug the -1 fill stops)."""
    model = load_model(tiny_llama_dir, dtype=torch.float32, device=CPU)
    backend = select_backend("torch", CPU, dtype=torch.float32)
    num_blocks, max_len = 320, 64
    eager = allocate_kv_caches(model.config, num_blocks, BLOCK, torch.float32, CPU)
    torch.manual_seed(0)
    for k, v in eager:
        k.normal_(), v.normal_()
    cached = [(k.clone(), v.clone()) for k, v in eager]
    graphs = DecodeGraphs(lambda b: model(b, cached, backend), 16, max_len, BLOCK, CPU,
                          capture=False)
    rng = random.Random(0)
    free = list(range(num_blocks))
    rng.shuffle(free)

    def rows(n: int) -> list[tuple[int, int, list[int]]]:
        out = []
        for _ in range(n):
            pos = rng.randrange(1, max_len)
            out.append((rng.randrange(3, 300), pos, [free.pop() for _ in range(pos // BLOCK + 1)]))
        return out

    first, second = rows(13), rows(5)
    with torch.inference_mode():
        for i, step in enumerate((first, second)):
            batch = _decode_batch(step)
            assert graphs.applies(batch)
            torch.testing.assert_close(graphs.run(batch), model(batch, eager, backend))
            # (close, not equal: a matmul of 16 rows may round otherwise than one of 13)
            torch.testing.assert_close(cached, eager, msg=f"step {i}: the caches differ")
            if i == 0:  # the first step's blocks are freed and refilled
                for _, _, table in first:
                    for (k, v), (kc, vc) in zip(eager, cached, strict=True):
                        fill = torch.randn_like(k[table])
                        k[table], kc[table], v[table], vc[table] = fill, fill, -fill, -fill
    assert graphs.replays == 2


def test_only_decode_steps_within_the_bounds_run_from_graphs():
    graphs = DecodeGraphs(lambda b: b.input_ids, 8, 64, BLOCK, CPU, capture=False)
    decode = _decode_batch([(5, 10, [0, 1, 2])] * 3)
    assert graphs.applies(decode)
    assert not graphs.applies(_decode_batch([(5, 10, [0, 1, 2])] * 9))  # above the top bucket
    prefill = ForwardBatch(
        input_ids=torch.arange(4), positions=torch.arange(4), slot_mapping=torch.arange(4),
        block_tables=torch.zeros((1, 1), dtype=torch.int32), seq_lens=torch.tensor([4]).int(),
        cu_seqlens_q=torch.tensor([0, 4]).int(), sample_indices=torch.tensor([3]),
        max_seqlen_q=4, max_seqlen_k=4)
    assert not graphs.applies(prefill)
    long = _decode_batch([(5, 64, list(range(17)))])  # a context past max_seqlen_k
    assert not graphs.applies(long)


GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def test_runner_decodes_through_the_graphs_as_transformers_does(tiny_llama_dir: Path):
    """The runner's decode steps go through DecodeGraphs (here without capture, and with
    the torch backend, since the one-op CPU step would take them first); three prompts
    decode together, then two, then one, so the bucket shrinks and padding rows hold
    the rows that left. Greedy output must equal transformers'."""
    runner = ModelRunner(tiny_llama_dir, num_blocks=64, block_size=BLOCK,
                         attention_backend="torch")
    runner.decode_step = None
    runner.graphs = DecodeGraphs(lambda b: runner.model(b, runner.kv_caches, runner.backend),
                                 4, runner.max_model_len, BLOCK, CPU, capture=False)
    prompts = {"a": [0, 5, 300, 301, 9], "b": [0, *range(20, 31)], "c": [0, 7, 8]}
    lengths = {"a": 9, "b": 6, "c": 3}
    want = {r: hf_greedy(tiny_llama_dir, p, lengths[r])[0] for r, p in prompts.items()}
    free = list(range(runner.num_blocks))
    random.Random(2).shuffle(free)
    tables: dict[str, list[int]] = {r: [] for r in prompts}
    plans, got = Plans(), {r: [] for r in prompts}
    step_id = 0

    def row(rid: str, tokens: list[int], start: int, new: NewSeqData | None) -> ScheduledSeq:
        while len(tables[rid]) * BLOCK < start + len(tokens):
            tables[rid].append(free.pop())
        return ScheduledSeq(rid, tuple(tokens), start, tuple(tables[rid]), True, new)

    rows = [row(r, p, 0, NewSeqData(GREEDY, tuple(p))) for r, p in prompts.items()]
    while rows:
        step_id += 1
        ran = execute(runner, step_id, rows, (), plans)
        assert ran.result.error is None, ran.result.error
        for t in ran.tokens:
            got[t.rid].append(t.token_id)
        live = [r for r in prompts if len(got[r]) < lengths[r]]
        done = tuple(r for r in prompts if len(got[r]) == lengths[r] and tables[r])
        for r in done:
            tables[r] = []
        rows = [row(r, [got[r][-1]], len(prompts[r]) + len(got[r]) - 1, None) for r in live]
        if done:
            step_id += 1
            execute(runner, step_id, (), done, plans)
    assert got == want
    assert runner.graphs.replays == max(lengths.values()) - 1  # every decode step


def test_graphs_are_refused_where_they_cannot_be_captured(tiny_llama_dir: Path):
    check_graphs(0, CPU, False, "transformers")  # none asked: nothing to refuse
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
        check_graphs(8, CPU, False, "native")
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        check_graphs(8, cuda, True, "native")
    with pytest.raises(ValueError, match="native model path"):
        check_graphs(8, cuda, False, "transformers")
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
        ModelRunner(tiny_llama_dir, num_blocks=16, block_size=BLOCK, cuda_graph_rows=4)
    with pytest.raises(ValueError, match="--cuda-graphs needs --device cuda"):
        EngineConfig(model=str(tiny_llama_dir), cuda_graphs=True)
