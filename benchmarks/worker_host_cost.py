"""The Worker's own host cost per decode step, without the rest of the engine.

A ModelRunner on host_overhead.py's near-zero-compute model runs decode steps of
``--rows`` sequences planned ahead (every token ``FEED_LAST_SAMPLE``, as overlap
scheduling sends them) with the benchmark model's sampling (top-k 50, repetition penalty
1.2, temperature 1), and reports the runner's own timers (``StepResult.pack_s``,
``sample_s``, ``forward_s``) in microseconds per sequence per step. No event loop, no
other thread: what it measures is the Worker's Python and torch work, not waits for the
GIL (which the engine's timers include when the loop is busy).

    python benchmarks/worker_host_cost.py [--rows 256] [--steps 60] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from host_overhead import build_model

from actorllm.wire.messages import (
    FEED_LAST_SAMPLE,
    NewSeqData,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
)
from actorllm.worker.runner import ModelRunner

PROMPT, BLOCK = 128, 16
WARMUP = 5


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    per_seq = -(-(PROMPT + args.steps + WARMUP + 1) // BLOCK)
    with tempfile.TemporaryDirectory() as tmp:
        runner = ModelRunner(build_model(Path(tmp) / "m", 0), num_blocks=args.rows * per_seq,
                             block_size=BLOCK, num_threads=args.threads)
    params = SamplingParams(temperature=1.0, top_k=50, repetition_penalty=1.2, max_tokens=None)
    rows = range(args.rows)
    prompts = [tuple((7 * i + j) % 4000 for j in range(PROMPT)) for i in rows]
    for first in range(0, args.rows, 32):  # prefill in chunks of 32 sequences
        runner.execute(StepPlan.of_rows(first, tuple(
            ScheduledSeq(f"s{i}", prompts[i], 0, tuple(range(i * per_seq, (i + 1) * per_seq)),
                         True, NewSeqData(params, prompts[i]))
            for i in range(first, min(first + 32, args.rows)))))
    totals = {"pack": 0.0, "sample": 0.0, "forward": 0.0}
    for step in range(WARMUP + args.steps):
        plan = StepPlan.of_rows(args.rows + step, tuple(
            ScheduledSeq(f"s{i}", (FEED_LAST_SAMPLE,), PROMPT + step, (), True) for i in rows))
        result = runner.execute(plan)
        if result.error is not None:
            sys.stderr.write(f"worker_host_cost.py: error: {result.error}\n")
            return 1
        if step >= WARMUP:
            totals["pack"] += result.pack_s
            totals["sample"] += result.sample_s
            totals["forward"] += result.forward_s
    scale = 1e6 / (args.steps * args.rows)
    sys.stdout.write(" ".join(f"{k} {v * scale:.2f}" for k, v in totals.items())
                     + " us per sequence-step\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
