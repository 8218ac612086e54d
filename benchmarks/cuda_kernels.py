"""Benchmark the cuda attention kernels against the GPU's copy bandwidth and torch SDPA.

Decode (one query token per sequence, Llama-3-8B attention shape: 32 query heads, 8 KV
heads, head_dim 128, block size 16): achieved bandwidth = K/V bytes read / kernel time,
beside a device-to-device copy measured in the same run and beside torch
``scaled_dot_product_attention`` on the same work with K/V already gathered into contiguous
``[batch, kv_heads, context, head_dim]`` tensors (so SDPA pays no paging). Prefill (whole
prompts, causal): TFLOP/s beside SDPA with the flash backend. Every row also reports the
largest difference from SDPA's output, a cheap check that the numbers are for right answers.

    python benchmarks/cuda_kernels.py [--dtype bf16|fp16] [--quick] [--out benchmarks/results]

Writes ``kernels.json`` and ``kernels.md`` to the output folder. Exits with code 2 and one
line on stderr where there is no usable GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SCALE = HEAD_DIM**-0.5
DECODE_BATCHES = (1, 8, 32, 128, 256)
DECODE_CONTEXTS = (128, 1024, 4096, 16384, 32768)
MAX_DECODE_TOKENS = 2 * 1024 * 1024  # batch x context cap: 4 GiB of K+V per config
PREFILL = ((1, 512), (1, 2048), (1, 8192), (1, 16384), (4, 2048), (16, 1024), (8, 4096))


def bench(fn: Callable[[], object], min_time: float = 0.2, min_iters: int = 5) -> float:
    """Median milliseconds of ``fn`` on the current stream, timed with CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    start_wall = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - start_wall < min_time:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if len(times) >= 200:
            break
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(nbytes: int) -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def paged_layout(batch: int, context: int, k_cache: torch.Tensor, gen: torch.Generator):
    """Block tables for ``batch`` sequences of ``context`` tokens, blocks in random order."""
    per_seq = math.ceil(context / BLOCK_SIZE)
    blocks = torch.randperm(k_cache.shape[0], generator=gen, device="cuda")[: batch * per_seq]
    return blocks.view(batch, per_seq).int()


def run_decode(backend, k_cache, v_cache, dtype, quick: bool) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch in DECODE_BATCHES[:3] if quick else DECODE_BATCHES:
        for context in DECODE_CONTEXTS[:3] if quick else DECODE_CONTEXTS:
            if batch * context > MAX_DECODE_TOKENS:
                continue
            tables = paged_layout(batch, context, k_cache, gen)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)

            def ours(q=q, tables=tables, seq_lens=seq_lens, cu=cu, context=context):
                return backend.paged_attention(
                    q,
                    k_cache,
                    v_cache,
                    tables,
                    seq_lens,
                    cu,
                    SCALE,
                    max_seqlen_q=1,
                    max_seqlen_k=context,
                )

            # SDPA gets K/V gathered contiguous (untimed): [batch, kv_heads, context, dim].
            def gather(cache, tables=tables, batch=batch, context=context):
                flat = cache.index_select(0, tables.flatten().long())
                flat = flat.view(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context]
                return flat.transpose(1, 2).contiguous()

            k, v = gather(k_cache), gather(v_cache)
            q4 = q.unsqueeze(2)
            ms = bench(ours)
            sdpa_ms = bench(lambda q4=q4, k=k, v=v: sdpa_gqa(q4, k, v, causal=False))
            diff = (ours().float() - sdpa_gqa(q4, k, v, False).squeeze(2).float()).abs().max()
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
            rows.append(
                dict(
                    batch=batch,
                    context=context,
                    ms=ms,
                    GBps=kv_bytes / ms / 1e6,
                    sdpa_ms=sdpa_ms,
                    sdpa_GBps=kv_bytes / sdpa_ms / 1e6,
                    max_abs_diff=float(diff),
                )
            )
            print(
                f"decode  batch {batch:>3} ctx {context:>5}: {ms:7.3f} ms "
                f"{rows[-1]['GBps']:7.0f} GB/s | sdpa {sdpa_ms:7.3f} ms "
                f"{rows[-1]['sdpa_GBps']:7.0f} GB/s | diff {diff:.2e}",
                flush=True,
            )
            del k, v
    return rows


def run_prefill(backend, k_cache, v_cache, dtype, quick: bool) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for batch, seq_len in PREFILL[:3] if quick else PREFILL:
        tables = paged_layout(batch, seq_len, k_cache, gen)
        tokens = batch * seq_len
        shape = (tokens, NUM_KV_HEADS, HEAD_DIM)
        k = torch.randn(shape, generator=gen, device="cuda").to(dtype)
        v = torch.randn(shape, generator=gen, device="cuda").to(dtype)
        q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)
        pos = torch.arange(seq_len, device="cuda")
        slots = (tables.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).flatten()
        backend.write_kv(k, v, k_cache, v_cache, slots)
        seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
        cu = torch.arange(0, tokens + 1, seq_len, dtype=torch.int32, device="cuda")

        def ours(q=q, tables=tables, seq_lens=seq_lens, cu=cu, seq_len=seq_len):
            return backend.paged_attention(
                q,
                k_cache,
                v_cache,
                tables,
                seq_lens,
                cu,
                SCALE,
                max_seqlen_q=seq_len,
                max_seqlen_k=seq_len,
            )

        def packed(t, batch=batch, seq_len=seq_len):  # [tokens, H, D] -> [batch, H, len, D]
            return t.view(batch, seq_len, -1, HEAD_DIM).transpose(1, 2).contiguous()

        q4, k4, v4 = packed(q), packed(k), packed(v)
        try:  # flash SDPA with native GQA where this torch has it, else K/V repeated (untimed)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                sdpa_gqa(q4, k4, v4, causal=True)
        except RuntimeError:
            group = NUM_HEADS // NUM_KV_HEADS
            k4, v4 = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1)

        def flash(q4=q4, k4=k4, v4=v4):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return sdpa_gqa(q4, k4, v4, causal=True)

        ms = bench(ours)
        sdpa_ms = bench(flash)
        want = flash().transpose(1, 2).reshape(tokens, NUM_HEADS, HEAD_DIM)
        diff = (ours().float() - want.float()).abs().max()
        flops = 4 * batch * NUM_HEADS * HEAD_DIM * seq_len * seq_len / 2  # causal half
        rows.append(
            dict(
                batch=batch,
                seq_len=seq_len,
                ms=ms,
                TFLOPs=flops / ms / 1e9,
                sdpa_ms=sdpa_ms,
                sdpa_TFLOPs=flops / sdpa_ms / 1e9,
                max_abs_diff=float(diff),
            )
        )
        print(
            f"prefill batch {batch:>3} len {seq_len:>5}: {ms:7.3f} ms "
            f"{rows[-1]['TFLOPs']:6.1f} TFLOP/s | flash sdpa {sdpa_ms:7.3f} ms "
            f"{rows[-1]['sdpa_TFLOPs']:6.1f} TFLOP/s | diff {diff:.2e}",
            flush=True,
        )
    return rows


def markdown(result: dict) -> str:
    lines = [
        f"# Attention kernels on {result['device']}",
        "",
        f"{result['dtype']}, {NUM_HEADS} query heads / {NUM_KV_HEADS} KV heads, head_dim "
        f"{HEAD_DIM}, block size {BLOCK_SIZE}; torch {result['torch']}, cupy {result['cupy']}.",
        f"Device-to-device copy: **{result['copy_GBps']:.0f} GB/s** (read + write).",
        "",
        "## Decode (K/V bytes read / time)",
        "",
        "| batch | context | ours ms | ours GB/s | % of copy | SDPA ms | SDPA GB/s | max diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["decode"]:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['ms']:.3f} | {r['GBps']:.0f} | "
            f"{100 * r['GBps'] / result['copy_GBps']:.0f}% | {r['sdpa_ms']:.3f} | "
            f"{r['sdpa_GBps']:.0f} | {r['max_abs_diff']:.1e} |"
        )
    lines += [
        "",
        "## Prefill (causal FLOPs / time)",
        "",
        "| batch | length | ours ms | ours TFLOP/s | flash SDPA ms | flash SDPA TFLOP/s | "
        "max diff |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["prefill"]:
        lines.append(
            f"| {r['batch']} | {r['seq_len']} | {r['ms']:.3f} | {r['TFLOPs']:.1f} | "
            f"{r['sdpa_ms']:.3f} | {r['sdpa_TFLOPs']:.1f} | {r['max_abs_diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--quick", action="store_true", help="a small grid, for smoke tests")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print(
            "benchmarks/cuda_kernels.py: no CUDA GPU visible to torch; nothing to measure",
            file=sys.stderr,
        )
        return 2
    from actorllm.ops import BackendUnavailable, select_backend

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    try:
        backend = select_backend(
            "cuda", "cuda", dtype=dtype, head_dim=HEAD_DIM, block_size=BLOCK_SIZE
        )
    except BackendUnavailable as exc:
        print(f"benchmarks/cuda_kernels.py: cuda backend unavailable: {exc}", file=sys.stderr)
        return 2
    import cupy

    tokens = max(MAX_DECODE_TOKENS, max(b * n for b, n in PREFILL))
    blocks = tokens // BLOCK_SIZE + 64
    shape = (blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda").to(dtype)
    v_cache = torch.randn(shape, device="cuda").to(dtype)
    result = dict(
        device=torch.cuda.get_device_name(),
        dtype=args.dtype,
        torch=torch.__version__,
        cupy=cupy.__version__,
        shape=dict(
            num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE
        ),
        copy_GBps=copy_bandwidth(1 << 30),
    )
    print(f"{result['device']}: device-to-device copy {result['copy_GBps']:.0f} GB/s", flush=True)
    result["decode"] = run_decode(backend, k_cache, v_cache, dtype, args.quick)
    result["prefill"] = run_prefill(backend, k_cache, v_cache, dtype, args.quick)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "kernels.md").write_text(markdown(result))
    print(f"wrote {args.out / 'kernels.json'} and {args.out / 'kernels.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
