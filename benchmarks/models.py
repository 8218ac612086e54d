"""What each model path costs: native against transformers-backed, per family (issue 30).

    python benchmarks/models.py [--families llama qwen3 ...] [--workload offline|uniform|both]
                                [--hidden 256] [--layers 4] [--head-dim 64] [--prompts 32]
                                [--prompt-len L] [--max-tokens M] [--batch 8] [--rounds 2]
                                [--parity-prompts 8] [--threads N] [--results DIR] [--no-save]

Every family is built on the spot at one shape (random weights, the tests' tiny
tokenizer, nothing downloaded; ``tests/test_models_families.py`` builds them) and runs a
workload greedily (``ignore_eos``), in float32 on the CPU, on up to three paths:

* ``native``: ``LLM(model_impl="native")``, for the families the native model has
  (Llama, Qwen2, Qwen3, Mistral);
* ``transformers``: ``LLM(model_impl="transformers")`` for every family (also Gemma 2
  and 3, Phi-3, OLMo 2, Granite, Mixtral, Qwen3-MoE), the model's own transformers
  modules with the paged attention op plugged in;
* ``generate``: transformers' own ``generate`` on the same weights (sdpa; eager for
  Gemma 2, whose soft-cap sdpa lacks), the baseline, timed as
  ``offline_throughput.padded_generate`` times it.

Two workloads (``--workload``, default ``offline``):

* ``offline``: ``offline_throughput.py``'s, smaller: ``--prompts`` (32) seeded random
  prompts of 16-512 ids asking for 16-128 new tokens each (``offline_throughput.workload``),
  ``generate`` in static left-padded batches of ``--batch`` (8): how a user batches
  ``generate``, and the workload on which the native path's 3x over it was set;
* ``uniform``: ``--prompts`` distinct prompts of 64 ids, 64 new tokens each, ``generate``
  in one batch: its best case (no padding, every row finishes together).

``--prompt-len`` and ``--max-tokens`` set uniform's lengths and the top of offline's
ranges (whose bottom is then at most 16). Reported per workload and family: output tok/s
of each path (the median over ``--rounds``; only the tokens each prompt asked for count),
the ratios native / transformers (what the native path buys), transformers / generate
and native / generate (target >= 3, issue 30), and parity: for how many of the first
``--parity-prompts`` (8) prompts each engine path's greedy tokens equal transformers'
``generate`` run one prompt at a time in float32 with eager attention (the tests'
oracle). Results go to ``--results``/models.json and models.md. CPU-bound and a few
minutes at the default size: run it on a quiet machine (on a shared one pass
``--threads 1``: two threads beside a busy core made ``generate`` 10x slower and the
ratios meaningless); the smallest setting (``--hidden 64 --layers 1 --prompts 2
--max-tokens 4 --rounds 1``) only checks that it runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
RESULTS = Path(__file__).parent / "results"

NATIVE = ["llama", "qwen2", "qwen3", "mistral"]
TRANSFORMERS_ONLY = ["gemma2", "gemma3", "phi3", "olmo2", "granite", "mixtral", "qwen3_moe"]
FAMILIES = NATIVE + TRANSFORMERS_ONLY
WINDOWED = {"mistral", "gemma2", "gemma3"}  # their test configs have a sliding window
TARGET = 3.0  # engine / transformers generate (issue 30, as offline_throughput's)
PATHS = ("native", "transformers", "generate")


def shape_of(family: str, args: argparse.Namespace) -> dict[str, Any]:
    """The config sizes every family shares. Mixtral's experts are as wide as the dense
    MLP (two active: twice its compute, as in Mixtral); Qwen3-MoE's half as wide (two
    active: the dense MLP's compute)."""
    heads = max(1, args.hidden // args.head_dim)
    shape: dict[str, Any] = dict(
        hidden_size=heads * args.head_dim, intermediate_size=4 * heads * args.head_dim,
        num_hidden_layers=args.layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), head_dim=args.head_dim,
        max_position_embeddings=4096, initializer_range=0.05)
    if family == "qwen3_moe":
        shape["moe_intermediate_size"] = 2 * heads * args.head_dim
    if family in WINDOWED:  # shorter than the context, so that the window matters
        shape["sliding_window"] = args.window
    return shape


def build(root: Path, family: str, args: argparse.Namespace) -> Path:
    """A random-weight checkpoint of ``family`` at the benchmark's shape."""
    import test_models_families as fam
    from helpers import build_tokenizer

    tok_dir = root / "tokenizer"
    if not tok_dir.is_dir():
        build_tokenizer(tok_dir)
    return fam.build_family(root / family, family, tok_dir, **shape_of(family, args))


Work = list[tuple[list[int], int]]  # (prompt ids, new tokens it asks for)
WORKLOADS = ("offline", "uniform")


def make_work(kind: str, vocab: int, args: argparse.Namespace) -> Work:
    """The prompts of workload ``kind`` (module docstring), seeded."""
    if kind == "uniform":
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, vocab, (args.prompts, args.prompt_len or 64), generator=gen)
        return [(p, args.max_tokens or 64) for p in ids.tolist()]
    from offline_throughput import workload

    top_p, top_o = args.prompt_len or 512, args.max_tokens or 128
    return workload(args.prompts, vocab, seed=0, prompt=(min(16, top_p), top_p),
                    output=(min(16, top_o), top_o))


def parameters(model_dir: Path) -> int:
    """The checkpoint's parameter count, from its safetensors headers."""
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


class EnginePath:
    """One ``LLM`` of a family on one path, built once and timed round after round."""

    def __init__(self, model_dir: Path, impl: str, args: argparse.Namespace,
                 max_model_len: int) -> None:
        from actorllm.llm import LLM

        # No prefix caching: the LLM's engine outlives a call, and every round runs the
        # same prompts, which transformers' generate (the peer) computes anew each time.
        self.llm = LLM(str(model_dir), model_impl=impl, max_num_seqs=args.prompts,
                       max_model_len=max_model_len, cpu_threads=args.threads,
                       enable_prefix_caching=False)
        self.tokens: list[list[int]] = []

    def run(self, work: Work, batch: int) -> float:
        from actorllm.wire.messages import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for _, n in work]
        t0 = time.perf_counter()
        results = self.llm.generate([ids for ids, _ in work], params)
        elapsed = time.perf_counter() - t0
        errors = [r.error for r in results if r.error]
        if errors:
            raise SystemExit(f"a request failed: {errors[0]}")
        self.tokens = [list(r.outputs[0].token_ids) for r in results]
        return elapsed


class GeneratePath:
    """transformers' own ``generate``, batched as ``offline_throughput`` batches it."""

    def __init__(self, model_dir: Path, family: str, args: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM

        attn = "eager" if family == "gemma2" else "sdpa"
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation=attn).eval()
        self.threads = args.threads
        self.tokens: list[list[int]] = []

    def run(self, work: Work, batch: int) -> float:
        from offline_throughput import padded_generate

        torch.set_num_threads(self.threads)  # the engine's Worker may have changed it
        elapsed, self.tokens = padded_generate(self.model, work, batch)
        return elapsed


def oracle(model_dir: Path, work: Work, threads: int) -> list[list[int]]:
    """The tests' oracle: greedy ``generate`` one prompt at a time, float32, eager."""
    from helpers import hf_greedy
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    return [hf_greedy(model, ids, n)[0] for ids, n in work]


def measure_family(root: Path, family: str, args: argparse.Namespace
                   ) -> dict[str, dict[str, Any]]:
    """Per workload: tok/s of each path (median of the rounds), ratios and parity."""
    model_dir = build(root, family, args)
    config = json.loads((model_dir / "config.json").read_text())
    works = {kind: make_work(kind, config["vocab_size"], args) for kind in args.workloads}
    longest = max(len(ids) + n for work in works.values() for ids, n in work)
    paths: dict[str, Any] = {}
    if family in NATIVE:
        paths["native"] = EnginePath(model_dir, "native", args, longest + 16)
    paths["transformers"] = EnginePath(model_dir, "transformers", args, longest + 16)
    paths["generate"] = GeneratePath(model_dir, family, args)
    rows = {}
    for kind, work in works.items():
        batch = args.batch if kind == "offline" else len(work)
        for path in paths.values():  # warm-up: first-call allocations, a few steps
            path.run([(ids, min(n, 4)) for ids, n in work[:2]], batch)
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds):  # alternate, so that a noisy spell hits every path
            for name, path in paths.items():
                seconds[name].append(path.run(work, batch))
        made = sum(n for _, n in work)
        tok_s = {name: made / statistics.median(s) for name, s in seconds.items()}
        rows[kind] = {"family": family, "architecture": config["architectures"][0],
                      "parameters": parameters(model_dir), "tok_s": tok_s,
                      "seconds": seconds, "parity": {}, "ratios": {}}
        want = oracle(model_dir, work[: args.parity_prompts], args.threads)
        for name in ("native", "transformers"):
            if name in paths:
                equal = sum(a == b for a, b in zip(paths[name].tokens, want, strict=False))
                rows[kind]["parity"][name] = {"equal": equal, "of": len(want)}
        for a, b in (("native", "transformers"), ("transformers", "generate"),
                     ("native", "generate")):
            if a in tok_s and b in tok_s:
                rows[kind]["ratios"][f"{a}/{b}"] = tok_s[a] / tok_s[b]
    return rows


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """Commit and machine facts for the report's header."""
    import transformers

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()

    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    return {
        "command": "python benchmarks/models.py " + shlex.join(sys.argv[1:]),
        "git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain")),
        "cpu": cpu, "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "threads": args.threads, "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "load_average_before": list(os.getloadavg()),
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _parity(row: dict[str, Any], name: str) -> str:
    p = row["parity"].get(name)
    if p is None:
        return "-"
    return f"{'yes' if p['equal'] == p['of'] else 'no'} ({p['equal']}/{p['of']})"


def describe(kind: str, cfg: dict[str, Any]) -> str:
    """One sentence on a workload's prompts and how ``generate`` batches them."""
    if kind == "uniform":
        return (f"{cfg['prompts']} distinct prompts of {cfg['prompt_len'] or 64} random ids, "
                f"{cfg['max_tokens'] or 64} new tokens each; `generate` in one batch (its "
                "best case: no padding, every row finishes together).")
    top_p, top_o = cfg["prompt_len"] or 512, cfg["max_tokens"] or 128
    return (f"{cfg['prompts']} seeded prompts of {min(16, top_p)}-{top_p} random ids asking "
            f"for {min(16, top_o)}-{top_o} new tokens each (`offline_throughput.workload`); "
            f"`generate` in static left-padded batches of {cfg['batch']}, each run to its "
            "longest output (how a user batches it).")


def render(report: dict[str, Any]) -> str:
    """The markdown report: command, commit, machine, a table per workload, the targets."""
    env, cfg = report["environment"], report["config"]
    lines = [
        "# Model paths: native against transformers-backed (issue 30)", "",
        f"`{env['command']}`", "",
        f"Commit {env['git_commit'][:12]}{' (dirty)' if env['git_dirty'] else ''}; "
        f"{env['cpu']}, {env['usable_cpus']} of {env['logical_cpus']} CPUs usable, "
        f"{env['threads']} torch threads; Python {env['python']}, torch {env['torch']}, "
        f"transformers {env['transformers']}; load average before "
        f"{[round(x, 2) for x in env['load_average_before']]}, after "
        f"{[round(x, 2) for x in env['load_average_after']]}.", "",
        f"Random weights, float32, hidden {cfg['hidden']} ({cfg['head_dim']}-wide heads), "
        f"{cfg['layers']} layers, sliding window {cfg['window']} where the family has one; "
        f"greedy, `ignore_eos`; output tok/s (the tokens each prompt asked for), median of "
        f"{cfg['rounds']} rounds. Parity: of the first {cfg['parity_prompts']} prompts, those "
        "whose greedy tokens equal transformers' `generate` run one prompt at a time "
        "(float32, eager attention).",
    ]
    for kind, result in report["workloads"].items():
        lines += ["", f"## Workload `{kind}`", "", describe(kind, cfg), "", *table(
            result["families"]), "", "Targets:", "", *targets(result["families"])]
    return "\n".join(lines) + "\n"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """One workload's table, a row per family."""
    lines = [
        "| family | parameters | native tok/s | transformers tok/s | generate tok/s "
        "| native / transformers | transformers / generate | native / generate "
        "| parity native | parity transformers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        t, r = row["tok_s"], row["ratios"]
        lines.append(
            f"| {row['family']} | {row['parameters']:,} | {_fmt(t.get('native'))} "
            f"| {_fmt(t['transformers'])} | {_fmt(t['generate'])} "
            f"| {_fmt(r.get('native/transformers'), 2)} "
            f"| {_fmt(r['transformers/generate'], 2)} | {_fmt(r.get('native/generate'), 2)} "
            f"| {_parity(row, 'native')} | {_parity(row, 'transformers')} |")
    return lines


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """One line per target: which families meet it."""
    out = []
    for key in ("transformers/generate", "native/generate"):
        have = [r for r in rows if key in r["ratios"]]
        miss = [r["family"] for r in have if r["ratios"][key] < TARGET]
        out.append(f"- {key.replace('/', ' / ')} >= {TARGET:g}: "
                   + ("met by every family" if not miss else f"not met by {', '.join(miss)}")
                   + f" ({len(have)} measured)")
    off = [f"{r['family']} {name}" for r in rows for name, p in r["parity"].items()
           if p["equal"] != p["of"]]
    out.append("- parity with transformers `generate`: "
               + ("every prompt, every path" if not off else f"not for {', '.join(off)}"))
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    ap.add_argument("--workload", choices=(*WORKLOADS, "both"), default="offline",
                    help="offline: offline_throughput's spread of lengths, generate in "
                         "padded batches; uniform: equal prompts, generate in one batch")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (whole heads)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--window", type=int, default=32,
                    help="sliding window of the windowed families (Mistral, Gemma 2/3)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="uniform: every prompt's length (64); offline: the longest (512)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="uniform: every prompt's new tokens (64); offline: the most (128)")
    ap.add_argument("--batch", type=int, default=8,
                    help="offline: generate's static batch size (offline_throughput's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parity-prompts", type=int, default=8,
                    help="how many of the prompts (the first) the oracle checks; it runs "
                         "them one at a time, the benchmark's slowest part")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="torch threads for every path (the engine's --cpu-threads)")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="where models.json and models.md go")
    ap.add_argument("--no-save", action="store_true", help="print only (for smoke runs)")
    args = ap.parse_args()
    args.workloads = WORKLOADS if args.workload == "both" else (args.workload,)
    return args


def main() -> None:
    import transformers

    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    transformers.utils.logging.disable_progress_bar()  # one bar per checkpoint write/load
    env = environment(args)
    rows: dict[str, list[dict[str, Any]]] = {kind: [] for kind in args.workloads}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            for kind, row in measure_family(Path(tmp), family, args).items():
                rows[kind].append(row)
                print(json.dumps({"workload": kind, **{k: row[k] for k in (
                    "family", "tok_s", "ratios", "parity")}}), flush=True)
    env["load_average_after"] = list(os.getloadavg())
    config = {k: getattr(args, k) for k in ("hidden", "head_dim", "layers", "window",
                                             "prompts", "prompt_len", "max_tokens", "batch",
                                             "rounds", "parity_prompts")}
    report = {"environment": env, "config": config, "target": TARGET,
              "workloads": {kind: {"description": describe(kind, config), "families": r}
                            for kind, r in rows.items()}}
    text = render(report)
    print(text)
    if not args.no_save:
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "models.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.results / "models.md").write_text(text)
        print(f"wrote {args.results / 'models.json'} and {args.results / 'models.md'}")


if __name__ == "__main__":
    main()
