"""The whole engine on one GPU: attention backend, CUDA graphs and overlap scheduling, side by
side.

A random-weight Llama (bf16, GQA, head_dim 64; ``--layers`` deep) serves the same seeded
offline workload six ways in one run: the ``torch`` attention backend (the reference), the
``cuda`` one (CuPy kernels), and the ``cuda`` one with decode steps replayed from CUDA
graphs (``cuda_graphs=True``, worker/cuda_graphs.py), each with the Scheduler keeping one
step in flight (``async_scheduling=False``) and two (``True``, the default on a GPU).
Issue 28's GPU targets are read off the graphs: their row against the 12,992 tok/s that
the ``cuda`` backend with overlap gave on an H200 before graphs (``BEFORE_GRAPHS``; target
>= 3x), and a step of ``--num-prompts`` rows (128 in / 128 out, all at once), its time
in the engine (wall / steps) against the device's own for such a step
(``device_step_ms``: graph replay, LM head and greedy pick timed by CUDA events; target
<= 1.5x). Each way runs
``--rounds`` times after a warm-up (kernel compile, cuBLAS start); the best round counts.
Greedy outputs are compared between the ways too. They are not equal token for token:
batches of another make-up (overlap scheduling admits requests a step apart) and bf16
attention that sums in another order flip near-ties (on this random model about 2 % of bf16
picks differ from fp32 ones), and after a flip a continuation differs for good. So the
report gives the share of prompts whose first output token agrees (prefill alone decides
it; a wrong kernel would make it near 0) and the median share of an output that comes
before its first difference. tests/gpu/test_engine_cuda.py checks flips are near-ties.

    python benchmarks/gpu_engine.py [--num-prompts 256] [--layers 8] [--rounds 3]

Writes ``gpu_engine.{json,md}`` to ``--out`` (default benchmarks/results). Exits with code
2 and one line on stderr where torch sees no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import workload  # noqa: E402  (the same seeded prompts, longer)

RESULTS = ROOT / "benchmarks" / "results"
BEFORE_GRAPHS = 12992.0  # tok/s, cuda backend with overlap, H200, the run before graphs
WAYS = (("torch", False), ("cuda", False), ("cuda", True))  # (attention, CUDA graphs)


def build_model(path: Path, layers: int) -> Path:
    """A ~0.4B-parameter random Llama with the embedded model's tokenizer, saved in bf16."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from actorllm.config import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=2048, intermediate_size=5632,
                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=64, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run_once(llm: Any, overlap: bool, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """One pass of the workload through a fresh engine on ``llm``'s resources."""
    import attrs
    import trio

    from actorllm import SamplingParams
    from actorllm.engine.async_engine import open_engine
    from actorllm.llm import collect

    config = attrs.evolve(llm.config, async_scheduling=overlap)
    results: dict[int, list[int]] = {}

    async def one(engine: Any, i: int, ids: list[int], out: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
        res = await collect(engine, f"g{i}", ids, params)
        assert res.error is None, res.error
        results[i] = list(res.outputs[0].token_ids)

    async def go() -> float:
        async with open_engine(config, resources=llm.resources) as engine:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i, (ids, out) in enumerate(work):
                    nursery.start_soon(one, engine, i, ids, out)
            wall = time.perf_counter() - t0
            await engine.wait_drained()
            steps.append(engine.frontend.stats.steps)
            return wall

    steps: list[int] = []
    wall = trio.run(go)
    tokens = sum(out for _, out in work)
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "steps": steps[0], "token_ids": [results[i] for i in range(len(work))]}


def device_step_ms(llm: Any, rows: int, context: int, repeats: int = 20) -> float:
    """The device's own time for one decode step of ``rows`` rows at ``context`` tokens:
    the forward replayed from its CUDA graph, the LM head and a greedy pick, back to back
    on the stream with no host work between them (CUDA events, median of ``repeats``).
    It writes K/V into the first blocks of the cache, which no request holds now."""
    from decode_parts import decode_batch

    runner = llm.resources.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes[-1] >= rows
    batch = decode_batch(rows, context, runner.block_size, device="cuda")
    times = []
    with torch.inference_mode():
        for i in range(repeats + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner.model.compute_logits(graphs.run(batch)).argmax(dim=-1)
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Share of outputs whose first token agrees, and the median share before a difference."""
    first = sum(p[:1] == q[:1] for p, q in zip(a, b, strict=True)) / max(1, len(a))
    shares = sorted(
        next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), len(p)) / len(p)
        for p, q in zip(a, b, strict=True))
    return {"first_token": first, "before_first_difference": shares[len(shares) // 2]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_engine: no CUDA GPU visible to torch", file=sys.stderr)
        return 2

    from actorllm import LLM

    rows: list[dict[str, Any]] = []
    tokens: dict[tuple[str, bool, bool], list[list[int]]] = {}
    probe: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "m", args.layers)
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(model))
        work = workload(args.num_prompts, vocab, args.seed, prompt=(64, 512), output=(64, 256))
        warm = workload(8, vocab, args.seed + 1, prompt=(64, 512), output=(64, 256))
        blocks = args.num_prompts * (512 + 256) // 16 + 64
        for backend, graphs in WAYS:
            llm = LLM(model=str(model), device="cuda", dtype="bfloat16",
                      attention_backend=backend, max_num_seqs=args.num_prompts,
                      max_num_batched_tokens=8192, num_kv_blocks=blocks, max_model_len=1024,
                      cuda_graphs=graphs)
            assert llm.resources.runner.backend_name == backend
            run_once(llm, True, warm)
            for overlap in (False, True):
                best: dict[str, Any] | None = None
                for _ in range(args.rounds):
                    r = run_once(llm, overlap, work)
                    print(f"{backend:5} graphs={graphs!s:5} overlap={overlap!s:5}: "
                          f"{r['tokens_per_s']:9.0f} tok/s ({r['wall_s']:.2f} s)", flush=True)
                    if best is None or r["tokens_per_s"] > best["tokens_per_s"]:
                        best = r
                assert best is not None
                tokens[(backend, graphs, overlap)] = best.pop("token_ids")
                rows.append({"backend": backend, "cuda_graphs": graphs,
                             "async_scheduling": overlap, **best})
            if graphs:
                assert llm.resources.runner.graphs.replays > 0
                # Issue 28's step target: args.num_prompts rows decoding at once, 128 in /
                # 128 out, against the device's own time for such a step.
                fixed = [(ids[:128], 128) for ids, _ in work if len(ids) >= 128]
                fixed = (fixed * (args.num_prompts // max(1, len(fixed)) + 1))[:args.num_prompts]
                r = run_once(llm, True, fixed)
                probe = {"rows": args.num_prompts, "context": 192,
                         "engine_step_ms": 1e3 * r["wall_s"] / r["steps"],
                         "device_step_ms": device_step_ms(llm, args.num_prompts, 192)}
                probe["ratio"] = probe["engine_step_ms"] / probe["device_step_ms"]
                print(f"step at {args.num_prompts} rows: engine {probe['engine_step_ms']:.2f} ms,"
                      f" device {probe['device_step_ms']:.2f} ms", flush=True)
            llm.close()
            del llm
            torch.cuda.empty_cache()

    tps = {(r["backend"], r["cuda_graphs"], r["async_scheduling"]): r["tokens_per_s"]
           for r in rows}
    summary = {
        "async_over_sync": {f"{b}{'+graphs' if g else ''}": tps[(b, g, True)] / tps[(b, g, False)]
                            for b, g in WAYS},
        "cuda_over_torch": {str(o): tps[("cuda", False, o)] / tps[("torch", False, o)]
                            for o in (False, True)},
        "graphs_over_eager": {str(o): tps[("cuda", True, o)] / tps[("cuda", False, o)]
                              for o in (False, True)},
        "graphs_over_before": tps[("cuda", True, True)] / BEFORE_GRAPHS,
        "step_probe": probe,
        "same_tokens_async_vs_sync": {
            b: agreement(tokens[(b, False, False)], tokens[(b, False, True)])
            for b in ("torch", "cuda")},
        "same_tokens_cuda_vs_torch": agreement(tokens[("torch", False, True)],
                                               tokens[("cuda", False, True)]),
        "same_tokens_graphs_vs_eager": agreement(tokens[("cuda", False, True)],
                                                 tokens[("cuda", True, True)]),
    }
    same_sync = summary["same_tokens_async_vs_sync"]
    same_backends = summary["same_tokens_cuda_vs_torch"]
    props = torch.cuda.get_device_properties(0)
    env = {"gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
           "num_prompts": args.num_prompts, "layers": args.layers, "rounds": args.rounds,
           "hidden_size": 2048, "heads": "32/8", "head_dim": 64, "dtype": "bfloat16",
           "prompt_tokens": "64-512", "output_tokens": "64-256, ignore_eos",
           "output_tokens_total": rows[0]["output_tokens"]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_engine.json").write_text(
        json.dumps({"env": env, "rows": rows, "summary": summary}, indent=2) + "\n")
    lines = [f"# The engine on {props.name}", "",
             f"Random Llama, {args.layers} layers, hidden 2048, 32/8 heads of 64, bf16; "
             f"{args.num_prompts} prompts of 64-512 tokens, 64-256 output tokens each "
             f"(ignore_eos), all submitted at once; best of {args.rounds} rounds. "
             f"torch {torch.__version__}.", "",
             "| attention | CUDA graphs | async scheduling | output tok/s | wall s |",
             "|---|---|---|---:|---:|"]
    lines += [f"| {r['backend']} | {'on' if r['cuda_graphs'] else 'off'} | "
              f"{'on' if r['async_scheduling'] else 'off'} | "
              f"{r['tokens_per_s']:.0f} | {r['wall_s']:.2f} |" for r in rows]
    lines += ["",
              "| ratio | torch | cuda |", "|---|---:|---:|",
              "| async on / off | {torch:.2f} | {cuda:.2f} |".format(
                  **summary["async_over_sync"]),
              "| async vs sync: first greedy token equal | {:.3f} | {:.3f} |".format(
                  *(same_sync[b]["first_token"] for b in ("torch", "cuda"))),
              "| async vs sync: median share before a difference | {:.2f} | {:.2f} |".format(
                  *(same_sync[b]["before_first_difference"] for b in ("torch", "cuda"))),
              "",
              f"cuda / torch attention: {summary['cuda_over_torch']['False']:.2f} (sync), "
              f"{summary['cuda_over_torch']['True']:.2f} (async). Between the backends "
              f"(async), the first greedy token agrees for {same_backends['first_token']:.3f} "
              f"of the prompts, and the median output runs "
              f"{same_backends['before_first_difference']:.2f} of its length before a "
              "difference.", "",
              f"CUDA graphs / eager (cuda attention): "
              f"{summary['graphs_over_eager']['False']:.2f} (sync), "
              f"{summary['graphs_over_eager']['True']:.2f} (async); with graphs and overlap "
              f"{summary['graphs_over_before']:.2f}x the {BEFORE_GRAPHS:.0f} tok/s before "
              f"graphs (issue 28's target: >= 3x). Graphs against eager (async): the first "
              f"greedy token agrees for "
              f"{summary['same_tokens_graphs_vs_eager']['first_token']:.3f} of the prompts, "
              f"the median output runs "
              f"{summary['same_tokens_graphs_vs_eager']['before_first_difference']:.2f} of "
              "its length before a difference.", "",
              f"A step of {probe['rows']} rows (128 in / 128 out, graphs and overlap): "
              f"{probe['engine_step_ms']:.2f} ms in the engine (wall / steps) against "
              f"{probe['device_step_ms']:.2f} ms of the device's own (graph replay, LM head, "
              f"greedy pick at ~192 tokens of context, CUDA events): {probe['ratio']:.2f}x "
              "(issue 28's target: <= 1.5x).", ""]
    (args.out / "gpu_engine.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
