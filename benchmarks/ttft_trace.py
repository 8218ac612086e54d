"""Where a burst's first tokens wait, from a server's own trace (issue 28).

Run the server with ``--trace FILE`` (add ``--trace-hops`` for the Tokenizer's and the
Frontend's spans), drive it (e.g. ``vllm bench serve`` at rate inf), then:

    python benchmarks/ttft_trace.py FILE [--last 64] [--steps 12]

It takes the last ``--last`` requests registered (the measured burst, after warm-ups)
and prints the median, mean and max of each span of their way to a first token, then
the steps of the burst's first seconds: when each was planned, its rows and tokens, how
many prompts started in it, when its result came back and its forward time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

Times = dict[str, float]


def read(path: Path) -> tuple[dict[str, Times], dict[int, Any], dict[int, Any]]:
    """(per-span times by rid, plans by step, results by step) from a trace file; the
    spans hold ``prompt tokens`` too (a count by rid, not a time)."""
    spans: dict[str, Times] = {k: {} for k in (
        "register", "tokenizer in", "tokenizer out", "enqueue", "schedule", "planned",
        "result", "frontend", "prompt tokens")}
    plans: dict[int, Any] = {}
    results: dict[int, Any] = {}

    def first(span: str, rid: str, t: float) -> None:
        spans[span].setdefault(rid, t)

    for line in path.read_text().splitlines():
        d = json.loads(line)
        kind, t = d.get("kind"), d.get("t")
        if kind is None and d.get("event") in ("register", "enqueue", "schedule"):
            first(d["event"], d["rid"], t)
            if d["event"] == "enqueue":
                first("prompt tokens", d["rid"], d["prompt_tokens"])
        elif kind in ("recv", "send") and d["message"] in ("GenerateRequest",
                                                             "SequenceRequest"):
            span = "tokenizer in" if kind == "recv" and d["mailbox"] == "tokenizer" else (
                "tokenizer out" if kind == "send" and d["mailbox"] == "scheduler" else "")
            for rid in d["rids"] if span else ():
                first(span, rid, t)
        elif kind == "recv" and d["message"] == "OutputBatch" and d["mailbox"] == "frontend":
            for rid in d["rids"]:
                first("frontend", rid, t)
        elif kind == "plan":
            plans[d["step"]] = (t, d["seqs"])
            for rid, _, _ in d["seqs"]:
                first("planned", rid, t)
        elif kind == "result":
            results[d["step"]] = (t, d["forward_s"])
            for rid, *_ in d["tokens"]:
                first("result", rid, t)
    return spans, plans, results


def report(path: Path, last: int, num_steps: int) -> None:
    """Print the spans of the last ``last`` requests and the burst's first steps."""
    spans, plans, results = read(path)
    reg = spans["register"]
    rids = sorted(reg, key=reg.__getitem__)[-last:]
    t0 = min(reg[r] for r in rids)
    print(f"{len(rids)} requests, registered over {(max(reg[r] for r in rids) - t0) * 1e3:.0f} ms")
    prompt = spans.pop("prompt tokens")
    computed = {r: 0 for r in rids}  # prompt tokens each request's steps computed
    sampled: set[str] = set()  # a row after the one that samples first is a decode row
    for step in sorted(plans):
        for rid, n, sample in plans[step][1]:
            if rid in computed and rid not in sampled:
                computed[rid] += n
                if sample:
                    sampled.add(rid)
    total = sum(prompt.get(r, 0) for r in rids)
    print(f"  prompt tokens {total} (p50 {statistics.median(prompt.get(r, 0) for r in rids)}"
          f" a request), computed {sum(computed.values())}: prefix-cache hits "
          f"{total - sum(computed.values())} tokens in "
          f"{sum(computed[r] < prompt.get(r, 0) for r in rids)} requests")
    names = [name for name in spans if spans[name]]  # (the hop spans need --trace-hops)
    for a, b in [*itertools.pairwise(names), (names[0], names[-1])]:
        got = [(spans[b][r] - spans[a][r]) * 1e3 for r in rids
               if r in spans[a] and r in spans[b]]
        if got:
            print(f"  {a:>13} -> {b:<13} p50 {statistics.median(got):8.1f}  mean "
                  f"{statistics.mean(got):8.1f}  max {max(got):8.1f} ms")
    for step in sorted(s for s in plans if plans[s][0] >= t0)[:num_steps]:
        t, seqs = plans[step]
        back, forward = results.get(step, (None, None))
        print(f"  step {step:5d} planned +{(t - t0) * 1e3:7.1f} ms  rows {len(seqs):4d}  "
              f"tokens {sum(n for _, n, _ in seqs):5d}  prompts {sum(n > 1 for _, n, _ in seqs):3d}"
              + (f"  back +{(back - t0) * 1e3:7.1f}  forward {forward * 1e3:6.1f} ms"
                 if back is not None else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--last", type=int, default=64, help="the measured requests: the last N")
    p.add_argument("--steps", type=int, default=12, help="steps of the burst to list")
    args = p.parse_args()
    report(args.trace, args.last, args.steps)


if __name__ == "__main__":
    main()
