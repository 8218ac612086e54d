"""Where a decode step's time goes: 32 sequences at context 300 on the benchmark model.

The companion of offline_throughput.py, for when its ratio misses the target:
    python benchmarks/profile_decode.py > benchmarks/results/profile_decode.txt
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import build_model

from actorllm.wire.messages import NewSeqData, SamplingParams, ScheduledSeq, StepPlan
from actorllm.worker.runner import ModelRunner

SEQS, CONTEXT, BLOCKS_PER_SEQ = 32, 300, 40


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        runner = ModelRunner(build_model(Path(tmp) / "m", 0),
                             num_blocks=SEQS * BLOCKS_PER_SEQ, block_size=16)
    params = SamplingParams(temperature=0.0)
    prompt = tuple([5] * CONTEXT)

    def table(i: int) -> tuple[int, ...]:
        return tuple(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))

    runner.execute(StepPlan.of_rows(0, tuple(
        ScheduledSeq(f"s{i}", prompt, 0, table(i), True, NewSeqData(params, prompt))
        for i in range(SEQS))))
    # Every table was sent with the prefill: a decode row carries no new blocks.
    decode = StepPlan.of_rows(1, tuple(ScheduledSeq(f"s{i}", (7,), CONTEXT, (), True)
                                       for i in range(SEQS)))
    for _ in range(3):
        runner.execute(decode)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            runner.execute(decode)
    sys.stdout.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    t0 = time.perf_counter()
    for _ in range(10):
        runner.execute(decode)
    ms = (time.perf_counter() - t0) * 100
    sys.stdout.write(f"\ndecode step, {SEQS} sequences at context {CONTEXT}: {ms:.1f} ms\n")


if __name__ == "__main__":
    main()
