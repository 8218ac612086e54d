"""Beside a noisy neighbour (issue 33): offline throughput quiet and with one competing
busy process on the same CPUs, for actorllm and vLLM's CPU build, in one run.

    .venv/bin/python benchmarks/noisy_neighbour.py                    # the full run
    .venv/bin/python benchmarks/noisy_neighbour.py --skip-vllm --num-prompts 16 \\
        --output-len 16 --out /tmp/nn                                 # a quick check

The model: ``benchmarks/host_overhead.py``'s near-zero-compute Llama with the shape the
issue measured (2 layers, hidden 96, 3 heads of 32, 1 KV head, intermediate 192), so
what is measured is how the host side and the OpenMP team share the cores. Each
variant runs ``--rounds`` times: quiet, then beside a competitor (a pure-Python spin
loop, ``taskset`` to the same CPUs, started before and killed after the run). The
variants:

- ``actorllm``: ``LLM.generate`` as a user gets it (the team cut to the CPUs others
  leave, ``actorllm/cpus.py``; the short OpenMP spin);
- ``actorllm-fixed-team``: the same with ``ACTORLLM_ADAPT_THREADS=0`` (the team of
  before the fix), for comparison;
- ``vllm``: ``vllm bench throughput`` (its ``LLM.generate``), from the virtualenv of
  ``benchmarks/serving.py``.

Both engines run through ``benchmarks/serving.py``'s machinery (pinning, threads,
tcmalloc, the same prompts and sampling as ``host_overhead.py``'s offline run).
Results: ``benchmarks/results/noisy_neighbour.{json,md}`` (``--out`` elsewhere), with
each variant's median ratio (beside a competitor / quiet) and the target: actorllm keeps
at least 0.7x of its quiet throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_overhead  # the model builder
import serving  # the vLLM virtualenv, pinning and the offline runs

log = logging.getLogger("benchmarks.noisy_neighbour")

STEM = "noisy_neighbour"
SHAPE: dict[str, int] = {"num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 3,
                         "head_dim": 32, "num_key_value_heads": 1, "intermediate_size": 192}
TARGET = 0.7
VARIANTS: dict[str, dict[str, str]] = {  # name -> extra environment (actorllm only)
    "actorllm": {},
    "actorllm-fixed-team": {"ACTORLLM_ADAPT_THREADS": "0"},
    "vllm": {},
}
SPIN = "while True:\n    pass\n"


@contextlib.contextmanager
def competitor(settings: serving.Settings) -> Iterator[subprocess.Popen[bytes]]:
    """One busy process on the benchmark's CPUs for the length of the block."""
    proc = subprocess.Popen(settings.pinned([sys.executable, "-c", SPIN]),
                            start_new_session=True)
    time.sleep(0.5)  # let it reach its loop before the run starts
    try:
        yield proc
    finally:
        serving.kill_group(proc, grace=2.0)


def measure(variant: str, settings: serving.Settings, args: argparse.Namespace) -> float:
    """One offline run of ``variant``: output tokens per second."""
    if variant == "vllm":
        return float(serving.offline_vllm(settings, args)["output_tokens_per_s"])
    ours = replace(settings, actorllm_extra_env=VARIANTS[variant])
    out = serving.offline_actorllm(ours, args)
    if out.get("num_errors"):
        raise serving.BenchError(f"{variant}: {out['num_errors']} requests failed: "
                                 f"{out.get('errors')}")
    return float(out["output_tokens_per_s"])


def run_variant(variant: str, settings: serving.Settings,
                args: argparse.Namespace) -> dict[str, Any]:
    """``--rounds`` pairs, quiet then beside the competitor; the medians and their ratio."""
    quiet: list[float] = []
    noisy: list[float] = []
    for r in range(args.rounds):
        quiet.append(measure(variant, settings, args))
        with competitor(settings):
            noisy.append(measure(variant, settings, args))
        log.info("%s round %d: quiet %.0f tok/s, beside a busy process %.0f tok/s (%.2fx)",
                 variant, r, quiet[-1], noisy[-1], noisy[-1] / quiet[-1])
    q, n = statistics.median(quiet), statistics.median(noisy)
    return {"quiet_tok_s": quiet, "noisy_tok_s": noisy, "quiet_median": round(q, 1),
            "noisy_median": round(n, 1), "ratio": round(n / q, 3),
            "extra_env": VARIANTS[variant]}


def run(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    t_start = time.perf_counter()
    model = host_overhead.build_model(log_dir / "model", args.seed, SHAPE)
    config = json.loads((model / "config.json").read_text())
    threads = args.threads or len([c for c in args.cpus.split(",") if c.strip()])
    venv = args.vllm_venv.expanduser()
    variants = [v for v in args.variants if not (args.skip_vllm and v == "vllm")]
    vllm_python = (serving.ensure_vllm_venv(venv, log_dir) if "vllm" in variants
                   else venv / "bin" / "python")
    settings = serving.Settings(
        model=model, vllm_python=vllm_python, cpus=args.cpus, threads=threads,
        dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_gib=args.kv_cache_gib,
        tcmalloc=None if args.no_tcmalloc else serving.find_tcmalloc(), log_dir=log_dir,
        seed=args.seed, start_timeout=args.start_timeout, num_warmups=args.num_warmups)
    env = serving.environment(settings)
    results = {v: run_variant(v, settings, args) for v in variants}
    env["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    ours = results.get("actorllm", {}).get("ratio")
    return {
        "benchmark": STEM, "issue": 33,
        "config": {"command": " ".join(["python", "benchmarks/noisy_neighbour.py",
                                        *sys.argv[1:]]),
                   "model_shape": {**host_overhead.MODEL_SHAPE, **SHAPE},
                   "parameters": host_overhead.parameter_count(config),
                   "num_prompts": args.num_prompts, "input_len": args.input_len,
                   "output_len": args.output_len, "cpus": args.cpus, "threads": threads,
                   "dtype": args.dtype, "rounds": args.rounds, "seed": args.seed,
                   "competitor": "one pure-Python spin loop, taskset to the same CPUs"},
        "environment": env, "variants": results,
        "target": {"what": "actorllm beside a busy process / quiet (medians)",
                   "bound": f">= {TARGET}", "value": ours,
                   "met": ours is not None and ours >= TARGET},
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


def markdown(result: dict[str, Any]) -> str:
    cfg, env, target = result["config"], result["environment"], result["target"]
    fmt = serving.fmt
    lines = [
        "# Beside a noisy neighbour (issue 33)", "",
        f"Near-zero-compute Llama ({cfg['parameters']:,} parameters: "
        + ", ".join(f"{k} {v}" for k, v in cfg["model_shape"].items())
        + f"); {cfg['num_prompts']} prompts, {cfg['input_len']} in / {cfg['output_len']} "
        f"out, offline; CPUs {cfg['cpus']}, {cfg['threads']} threads, {cfg['dtype']}; "
        f"competitor: {cfg['competitor']}; {cfg['rounds']} round(s), medians. Commit "
        f"{env.get('git_commit', '?')[:12]}{' (dirty)' if env.get('git_dirty') else ''}; "
        f"load average before {env.get('load_average_before')}, after "
        f"{env.get('load_average_after')}.", "",
        f"`{cfg['command']}`", "",
        "| variant | quiet tok/s | beside a busy process tok/s | ratio |",
        "|---|---:|---:|---:|",
    ]
    for name, row in result["variants"].items():
        lines.append(f"| {name} | {fmt(row['quiet_median'])} | {fmt(row['noisy_median'])} "
                     f"| {fmt(row['ratio'], 2)} |")
    verdict = ("not measured (no actorllm variant)" if target["value"] is None
               else f"{fmt(target['value'], 2)}, {'met' if target['met'] else 'not met'}")
    lines += ["", f"Target: {target['what']} {target['bound']}: {verdict}."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--variants", type=serving.parse_list(tuple(VARIANTS)),
                   default=list(VARIANTS))
    p.add_argument("--skip-vllm", action="store_true", help="actorllm only")
    p.add_argument("--vllm-venv", type=Path, default=serving.DEFAULT_VLLM_VENV)
    p.add_argument("--cpus", default="0,1", help="taskset CPU list for every process")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=4)
    p.add_argument("--no-tcmalloc", action="store_true")
    p.add_argument("--num-warmups", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=serving.RESULTS)
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.input_len + args.output_len > host_overhead.MODEL_SHAPE["max_position_embeddings"]:
        sys.stderr.write("noisy_neighbour.py: error: --input-len + --output-len exceeds 512\n")
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, serving._interrupt)
    log_dir = Path(tempfile.mkdtemp(prefix="actorllm-bench-noisy-"))
    ok = False
    try:
        result = run(args, log_dir)
        ok = True
    except serving.BenchError as exc:
        sys.stderr.write(f"noisy_neighbour.py: error: {exc}\n(logs in {log_dir})\n")
        return 1
    except KeyboardInterrupt as exc:
        sys.stderr.write(f"noisy_neighbour.py: interrupted ({exc or 'SIGINT'}); "
                         f"logs in {log_dir}\n")
        return 130
    finally:
        if ok and not args.keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{STEM}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    md = markdown(result)
    (args.out / f"{STEM}.md").write_text(md)
    sys.stdout.write(md)
    log.info("wrote %s/%s.{json,md}", args.out, STEM)
    return 0


if __name__ == "__main__":
    sys.exit(main())
