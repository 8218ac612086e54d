"""Offline throughput: actorllm against transformers ``generate`` on the same weights.

64 prompts with seeded random lengths (prompt 16-512 tokens, output 16-256 tokens,
ignore_eos) go through actorllm (continuous batching, paged KV) and through
transformers ``generate`` in static batches of 8, left-padded, in the same run.
Both count only the output tokens the prompts asked for. Also reported: actorllm's
engine overhead share, the wall time outside the Worker's forward passes and
sampling, at up to 32 concurrent sequences.

    python benchmarks/offline_throughput.py [--model DIR] [--num-prompts 64]

The last line reads ``ratio: R`` (actorllm / transformers output tokens per second).
Results go to benchmarks/results/offline_throughput.{json,md}. Without --model, a
random-weight Llama (the default model's shape, with 1024 positions so that 512 + 256
fits) is built in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"


def build_model(path: Path, seed: int) -> Path:
    """A random Llama shaped like the embedded model, with room for 768 positions."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from actorllm.config import default_model_dir

    src = default_model_dir()
    tok = AutoTokenizer.from_pretrained(src)
    base = json.loads((src / "config.json").read_text())
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=base["vocab_size"], hidden_size=base["hidden_size"],
        intermediate_size=base["intermediate_size"],
        num_hidden_layers=base["num_hidden_layers"],
        num_attention_heads=base["num_attention_heads"],
        num_key_value_heads=base["num_key_value_heads"], max_position_embeddings=1024,
        bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"),
        tie_word_embeddings=base.get("tie_word_embeddings", False),
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def workload(n: int, vocab: int, seed: int, prompt: tuple[int, int] = (16, 512),
             output: tuple[int, int] = (16, 256)) -> list[tuple[list[int], int]]:
    """``n`` seeded (random prompt ids, output length) pairs, lengths uniform in the ranges."""
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(*prompt))],
             rng.randint(*output)) for _ in range(n)]


def run_actorllm(model: Path, work: list[tuple[list[int], int]], max_num_seqs: int
                 ) -> dict[str, Any]:
    from actorllm import LLM, SamplingParams

    llm = LLM(model=str(model), max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
              num_kv_blocks=max_num_seqs * 48 + 64, max_model_len=1024)
    params = [SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
              for _, out in work]
    stats: dict[str, float] = {}
    import trio

    from actorllm.engine.async_engine import open_engine
    from actorllm.llm import collect

    async def go() -> float:
        async with open_engine(llm.config, resources=llm.resources) as engine:
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i, (ids, _) in enumerate(work):
                    nursery.start_soon(collect, engine, f"b{i}", ids, params[i])
            wall = time.perf_counter() - t0
            await engine.wait_drained()
            s = engine.frontend.stats
            stats.update(forward_s=s.forward_s, sample_s=s.sample_s, steps=s.steps,
                         preemptions=s.num_preemptions)
            return wall

    wall = trio.run(go)
    tokens = sum(out for _, out in work)
    busy = stats["forward_s"] + stats["sample_s"]
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "overhead_share": max(wall - busy, 0.0) / wall, "max_num_seqs": max_num_seqs,
            **stats}


def padded_generate(hf: Any, work: list[tuple[list[int], int]], batch: int, pad: int = 0
                    ) -> tuple[float, list[list[int]]]:
    """transformers ``generate`` as a user batches it: static batches of ``batch`` prompts,
    left-padded, each batch run to its longest output (``min_new_tokens`` too, so an EOS
    ends no row early). Returns the wall seconds and each prompt's first ``out`` tokens
    (what it asked for; the rest of its row is the batch's cost, not its output).

    ``models.py`` reuses it for every family, so that both benchmarks time ``generate``
    the same way."""
    t0 = time.perf_counter()
    tokens: list[list[int]] = []
    for start in range(0, len(work), batch):
        chunk = work[start : start + batch]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        new = max(out for _, out in chunk)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=pad)
        tokens += [row[width : width + n] for row, (_, n) in zip(out.tolist(), chunk,
                                                                  strict=True)]
    return time.perf_counter() - t0, tokens


def run_transformers(model: Path, work: list[tuple[list[int], int]], batch: int
                     ) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    wall, _ = padded_generate(hf, work, batch)
    tokens = sum(out for _, out in work)  # only what each prompt asked for counts
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "batch_size": batch}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="model dir (default: a random Llama)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both systems (1: no oversubscription on 2 cores)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_model(Path(tmp) / "bench-llama", args.seed)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        work = workload(args.num_prompts, vocab, args.seed)
        ours = run_actorllm(model, work, args.max_num_seqs)
        print(f"actorllm:     {ours['tokens_per_s']:8.1f} output tok/s  "
              f"(wall {ours['wall_s']:.1f} s, overhead {ours['overhead_share']:.1%})")
        peer = run_transformers(model, work, 8)
        print(f"transformers: {peer['tokens_per_s']:8.1f} output tok/s  "
              f"(wall {peer['wall_s']:.1f} s, static batches of 8)")
    ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
    result = {
        "benchmark": "offline_throughput", "num_prompts": args.num_prompts, "seed": args.seed,
        "model": str(args.model or "random Llama shaped like the embedded model"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, CPU",
        "torch": torch.__version__, "actorllm": ours, "transformers": peer, "ratio": ratio,
        "targets": {"ratio": 3.0, "overhead_share": 0.10},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offline_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "offline_throughput.md").write_text(
        "| system | output tok/s | wall s | notes |\n|---|---|---|---|\n"
        f"| actorllm | {ours['tokens_per_s']:.1f} | {ours['wall_s']:.1f} | max_num_seqs "
        f"{ours['max_num_seqs']}, engine overhead {ours['overhead_share']:.1%}, "
        f"{ours['preemptions']} preemptions |\n"
        f"| transformers generate | {peer['tokens_per_s']:.1f} | {peer['wall_s']:.1f} | "
        f"static batches of 8, left-padded |\n\n"
        f"ratio (actorllm / transformers): **{ratio:.2f}** (target >= 3); "
        f"overhead {ours['overhead_share']:.1%} (target <= 10 %)\n"
    )
    print(f"ratio: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
