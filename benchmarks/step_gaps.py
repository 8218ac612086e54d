"""Where a decode step's wall time goes between the Worker's thread and the event loop.

    python benchmarks/step_gaps.py [--rounds 3] [--num-prompts 256] [--output-len 256]

On host_overhead.py's near-zero-compute model (built here, seeded), ``LLM.generate`` runs
256 prompts of 128 random ids to 256 tokens, with overlap scheduling off and on in
alternate rounds (one process, one set of weights). Timestamps are taken by wrapping
three methods for the run: ``ModelRunner.execute`` (the Worker's thread: pack, forward,
sample), ``Scheduler.handle`` of a ``StepResult`` (the commit) and ``Scheduler.schedule``
(the plan). For each step of a full batch of decode rows (every row one token, at least
``--min-rows`` rows), matched by step id:

- **execute**: the Worker's thread on the step, from taking the plan to its result.
- **result hop**: the result's end in the thread to the Scheduler's ``handle`` of it
  (``run_sync_soon``, the event loop's wake-up, the Worker's task forwarding it).
- **commit**: ``handle`` of the result.
- **to plan**: the end of the commit to the next plan made (the Scheduler's sending task
  woken, ``schedule``).
- **plan hop**: the plan made to the thread starting it (the Worker's feed task, the
  thread's wake-up, the GIL).
- **step**: one ``execute`` start to the next.

With overlap off, result hop + commit + to plan + plan hop is the time the thread waits
between steps; with overlap on, the next plan is made while the step runs, and only the
thread's wait (``gap``) is reported. Medians in microseconds, of all rounds' steps; the
wrappers add a few microseconds each. Results: ``benchmarks/results/step_gaps.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_overhead  # the near-zero-compute model
import serving  # the offline benchmarks' prompts and sampling

from actorllm import LLM, SamplingParams
from actorllm.scheduler.actor import Scheduler
from actorllm.wire.messages import StepResult
from actorllm.worker.runner import ModelRunner

RESULTS = Path(__file__).parent / "results"
PARTS = ("execute", "result hop", "commit", "to plan", "plan hop", "gap", "step")


@contextlib.contextmanager
def stamped(events: dict[str, dict[int, float]], full: set[int], min_rows: int
            ) -> Iterator[None]:
    """Record, by step id, when each step's execute starts and ends, when the Scheduler's
    handle of its result starts and ends and when its plan was made; ``full`` gets the
    ids of the decode steps of at least ``min_rows`` rows."""
    execute, handle, schedule = ModelRunner.execute, Scheduler.handle, Scheduler.schedule
    now = time.perf_counter

    def timed_execute(self: ModelRunner, plan: Any) -> Any:
        events["exec_start"][plan.step_id] = now()
        result = execute(self, plan)
        events["exec_end"][plan.step_id] = now()
        return result

    def timed_handle(self: Scheduler, msg: Any) -> None:
        if not isinstance(msg, StepResult):
            return handle(self, msg)
        events["handle_start"][msg.step_id] = now()
        handle(self, msg)
        events["handle_end"][msg.step_id] = now()
        return None

    def timed_schedule(self: Scheduler) -> Any:
        plan = schedule(self)
        if plan is not None:
            events["planned"][plan.step_id] = now()
            if len(plan.rids) >= min_rows and sum(plan.num_tokens) == len(plan.rids):
                full.add(plan.step_id)
        return plan

    ModelRunner.execute, Scheduler.handle, Scheduler.schedule = (
        timed_execute, timed_handle, timed_schedule)
    try:
        yield
    finally:
        ModelRunner.execute, Scheduler.handle, Scheduler.schedule = execute, handle, schedule


def parts(events: dict[str, dict[int, float]], full: set[int]) -> dict[str, list[float]]:
    """Each full step's parts (see the module docstring), in microseconds."""
    out: dict[str, list[float]] = {p: [] for p in PARTS}
    es, ee = events["exec_start"], events["exec_end"]
    hs, he, planned = events["handle_start"], events["handle_end"], events["planned"]
    for k in sorted(full):
        nxt = k + 1
        if not all(k in d for d in (es, ee, hs, he)) or nxt not in es:
            continue
        spans = {"execute": ee[k] - es[k], "result hop": hs[k] - ee[k],
                 "commit": he[k] - hs[k], "gap": es[nxt] - ee[k], "step": es[nxt] - es[k]}
        if planned.get(nxt, 0.0) > he[k]:  # made after this result: overlap off
            spans["to plan"] = planned[nxt] - he[k]
            spans["plan hop"] = es[nxt] - planned[nxt]
        for name, s in spans.items():
            out[name].append(s * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--min-rows", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = host_overhead.build_model(Path(tempfile.mkdtemp()) / "model", args.seed)
    prompts = serving.random_id_prompts(args.seed, host_overhead.MODEL_SHAPE["vocab_size"],
                                        args.input_len, args.num_prompts)
    llm = LLM(model=str(model), max_num_seqs=args.num_prompts, dtype="float32")
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                            **serving.OFFLINE_SAMPLING)  # type: ignore[arg-type]
    llm.generate(prompts[:8], params)  # warm-up: the op built, the threads made
    base = llm.config
    runs: dict[str, dict[str, Any]] = {m: {"tok_s": [], "parts": {p: [] for p in PARTS}}
                                       for m in ("overlap off", "overlap on")}
    for r in range(args.rounds):
        for mode in (("overlap off", "overlap on") if r % 2 == 0 else
                     ("overlap on", "overlap off")):
            # A new engine for the new config (and no prefix-cache hit from the last round).
            llm.close()
            llm.config = attrs.evolve(base, async_scheduling=mode == "overlap on")
            events: dict[str, dict[int, float]] = {
                k: {} for k in ("exec_start", "exec_end", "handle_start", "handle_end",
                                "planned")}
            full: set[int] = set()
            with stamped(events, full, args.min_rows):
                t0 = time.perf_counter()
                results = llm.generate(prompts, params)
                elapsed = time.perf_counter() - t0
            failed = [r.error for r in results if r.error]
            if failed:  # (e.g. prompt + output past the model's context): no speed to report
                raise SystemExit(f"step_gaps: {len(failed)} requests failed: {failed[0]}")
            runs[mode]["tok_s"].append(args.num_prompts * args.output_len / elapsed)
            for name, xs in parts(events, full).items():
                runs[mode]["parts"][name].extend(xs)
    table = {m: {p: (statistics.median(xs) if xs else None) for p, xs in run["parts"].items()}
             for m, run in runs.items()}
    lines = ["# Where a decode step's time goes between the Worker's thread and the loop", "",
             f"{platform.platform()}, near-zero-compute model (host_overhead.py), "
             f"{args.num_prompts} prompts, {args.input_len} in / {args.output_len} out, "
             f"{args.rounds} rounds alternating; medians over the steps of at least "
             f"{args.min_rows} decode rows, in microseconds.", "",
             "| part | overlap off | overlap on |", "|---|---:|---:|"]
    for p in PARTS:
        cells = [f"{table[m][p]:.0f}" if table[m][p] is not None else "-" for m in runs]
        lines.append(f"| {p} | {' | '.join(cells)} |")
    lines.append("| output tok/s (median of rounds) | " + " | ".join(
        f"{statistics.median(run['tok_s']):.0f}" for run in runs.values()) + " |")
    print("\n".join(lines))
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "step_gaps.json").write_text(json.dumps(
            {"args": vars(args), "medians_us": table,
             "tok_s": {m: run["tok_s"] for m, run in runs.items()},
             "steps": {m: len(run["parts"]["step"]) for m, run in runs.items()}}, indent=2))
        (RESULTS / "step_gaps.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
