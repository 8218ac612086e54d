"""Where a one-op decode step's time goes, part by part, with no engine around it.

The Worker's ModelRunner loads a model (the near-zero-compute one of host_overhead.py
by default, or ``--model DIR``); its K/V cache is filled with random values for ``--rows``
sequences at ``--context`` tokens, and then, on 1 and 2 threads:

- the whole step as the engine runs it (``llama_decode`` with the LM head and the draw),
  as it runs without the draw and without the LM head, so the differences are the draw's
  and the head's (final norm included) shares, and with the draw as a second op call (the
  head and the draw a block of rows at a time in the op against one after the other);
- each part alone, as the op calls it: embedding, input norm, qkv, RoPE (the module's
  ops), attention (the C kernel), o-proj, MLP, LM head, draw (``sample_rows``). Each is
  one op call from Python, so it carries a few microseconds of dispatch the op does not.

Times are the 25th percentile of ``--repeats`` calls (a shared host's noise is upward),
in microseconds per step and per row. Run on a quiet host for absolute figures:
    python benchmarks/decode_parts.py [--model DIR] [--rows 240] [--context 256]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from actorllm.model.llama import ForwardBatch
from actorllm.ops.cpu_step import sample_rows
from actorllm.worker.runner import ModelRunner

BLOCK = 16


def timed(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The 25th percentile of ``repeats`` calls of each, in microseconds; the calls
    alternate, so a shared host's load falls on every part alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.percentile(t, 25)) * 1e6 for name, t in times.items()}


def decode_batch(rows: int, context: int, block_size: int = BLOCK,
                 device: str = "cpu") -> ForwardBatch:
    """``rows`` decode rows, row i at position ``context`` in blocks of its own (the
    first ``rows * (context // block_size + 1)`` blocks of the cache); also
    benchmarks/gpu_engine.py's step probe."""
    on = {"device": device}
    per_seq = context // block_size + 1
    tables = torch.arange(rows * per_seq, dtype=torch.int32, **on).view(rows, per_seq)
    positions = torch.full((rows,), context, dtype=torch.int64, **on)
    slots = tables[:, context // block_size].long() * block_size + context % block_size
    return ForwardBatch(
        input_ids=torch.randint(10, 4000, (rows,), **on), positions=positions,
        slot_mapping=slots, block_tables=tables,
        seq_lens=torch.full((rows,), context + 1, dtype=torch.int32, **on),
        cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, **on),
        sample_indices=torch.arange(rows, **on), max_seqlen_q=1, max_seqlen_k=context + 1,
        slots_valid=True)


def parts(runner: ModelRunner, batch: ForwardBatch, temps: torch.Tensor
          ) -> dict[str, Callable[[], object]]:
    """Each part of the step as a call, on inputs of the step's shapes."""
    step, model = runner.decode_step, runner.model
    assert step is not None, "the one-op decode step does not run this model"
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    caches = runner.kv_caches
    rows, hidden = batch.input_ids.shape[0], model.model.embed_tokens.weight.shape[1]
    h = torch.randn(rows, hidden)
    # The linears as the model calls them (PackedLinear: mm, or the op's GEMM, panels).
    q = torch.randn(rows, attn.num_heads, attn.head_dim)
    qkv = torch.randn(rows, attn.qkv_proj.out_features)
    cos = torch.randn(rows, 1, attn.head_dim)
    logits = torch.randn(rows, model.config.vocab_size)
    k, v = caches[0]
    eps = layer.input_layernorm.eps

    def rope() -> object:
        x = qkv.view(rows, -1, attn.head_dim)
        return x * cos + torch.roll(x, attn.head_dim // 2, -1) * cos

    def mlp_part() -> object:
        g, u = mlp.gate_up_proj(h).chunk(2, -1)
        return mlp.down_proj(torch.nn.functional.silu(g).mul(u))

    return {
        "step (engine: head + draw)": lambda: step(batch, caches, logits=True,
                                                   temperature=temps, greedy_below=1e-5),
        "step (engine, helper)": lambda: step(batch, caches, logits=True,
                                              temperature=temps, greedy_below=1e-5, helper=True),
        "step, logits out": lambda: step(batch, caches, logits=True),
        "step, logits out, then sample_rows": lambda: sample_rows(
            step(batch, caches, logits=True), temps, 1e-5),
        "step, hidden out": lambda: step(batch, caches),
        "embedding": lambda: torch.embedding(model.model.embed_tokens.weight, batch.input_ids),
        "rms_norm": lambda: torch.rms_norm(h, [hidden], layer.input_layernorm.weight, eps),
        "qkv mm": lambda: attn.qkv_proj(h),
        "rope (module ops)": rope,
        "attention (C kernel), a layer": lambda: runner.backend.decode(
            q, k, v, batch.block_tables, batch.seq_lens, batch.max_seqlen_k, attn.scale),
        "o-proj mm": lambda: attn.o_proj(q.view(rows, -1)),
        "mlp (gate_up, silu, mul, down)": mlp_part,
        "lm head mm": lambda: model.lm_head(h),
        "draw (sample_rows, T=1)": lambda: sample_rows(logits, temps, 1e-5),
        "argmax (sample_rows, T=0)": lambda: sample_rows(logits, torch.zeros(rows), 1e-5),
    }


def main() -> None:
    """Print each part's time on 1 and 2 threads."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: the near-zero model)")
    parser.add_argument("--rows", type=int, default=240)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--only", help="time only the parts whose name contains this")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(Path(__file__).parent))
            from host_overhead import build_model

            model = build_model(Path(tmp) / "nz", 0)
        blocks = args.rows * (args.context // BLOCK + 1)
        runner = ModelRunner(model, num_blocks=blocks, block_size=BLOCK)
    for k, v in runner.kv_caches:  # a filled cache: zero pages read faster than real ones
        k.normal_()
        v.normal_()
    batch = decode_batch(args.rows, args.context)
    temps = torch.ones(args.rows)
    calls = {name: fn for name, fn in parts(runner, batch, temps).items()
             if args.only is None or args.only in name}
    results = {}
    for n in args.threads:
        torch.set_num_threads(n)
        results[n] = timed(calls, args.repeats)
    head = f"{'part':34}" + "".join(f"{f'{n} thr us':>12}{'/row':>8}" for n in args.threads)
    print(f"{args.rows} rows at context {args.context}, 25th percentile of {args.repeats}")
    print(head)
    for name in calls:
        print(f"{name:34}" + "".join(f"{results[n][name]:12.1f}{results[n][name] / args.rows:8.2f}"
                                    for n in args.threads))


if __name__ == "__main__":
    main()
