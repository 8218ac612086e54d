"""A prefill step through the Python model against the one-op step on one-token rows.

The one-op step (ops/cpu_step.py) takes a prefill chunk as one row per token, each with
its sequence's block table and ``seq_len = position + 1`` (worker/packing.py
``every_token_a_row``): the op writes every token's K/V before any row attends. This
times both forms of the same step, ``--seqs`` prompts of ``--tokens`` tokens each (hidden
states out, no LM head), on each of ``--threads``: the 25th percentile of ``--repeats``
calls, alternating, of wall time and of the calling thread's CPU time; and prints the
largest difference of their outputs. With ``--busy`` a second thread runs pure Python
the while (as ``single``'s event loop does parsing and tokenizing a burst), holding the
GIL but for the interpreter's switch interval: each op the module calls from Python
waits to take it back, the one op once; wall time past CPU time is that wait, or a
core shared with the busy thread.
    python benchmarks/prefill_op.py [--model DIR] --seqs 16 --tokens 128 [--busy]
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import torch

from actorllm.model.llama import ForwardBatch
from actorllm.worker.packing import every_token_a_row
from actorllm.worker.runner import ModelRunner

BLOCK = 16


def prefill_batch(seqs: int, tokens: int, vocab: int) -> ForwardBatch:
    """``seqs`` prompts of ``tokens`` tokens from position 0, each in blocks of its own."""
    per_seq = -(-tokens // BLOCK)
    tables = torch.arange(seqs * per_seq, dtype=torch.int32).view(seqs, per_seq)
    positions = torch.arange(tokens).repeat(seqs)
    row_of = torch.arange(seqs).repeat_interleave(tokens)
    slots = tables[row_of, positions // BLOCK].long() * BLOCK + positions % BLOCK
    return ForwardBatch(
        input_ids=torch.randint(10, vocab, (seqs * tokens,)), positions=positions,
        slot_mapping=slots, block_tables=tables,
        seq_lens=torch.full((seqs,), tokens, dtype=torch.int32),
        cu_seqlens_q=torch.arange(0, seqs * tokens + 1, tokens, dtype=torch.int32),
        sample_indices=torch.arange(tokens - 1, seqs * tokens, tokens),
        max_seqlen_q=tokens, max_seqlen_k=tokens, slots_valid=True)


def spin(stop: threading.Event) -> None:
    """Pure Python until ``stop``: it holds the GIL, handing it over only when asked."""
    n = 0
    while not stop.is_set():
        n = (n * 31 + 7) % 1_000_003


def main() -> None:
    """Print both forms' times on each thread count, and their outputs' difference."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: the embedded model)")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--busy", action="store_true", help="a pure-Python thread beside")
    args = parser.parse_args()
    runner = ModelRunner(args.model or "actorllm/assets/default-model",
                         num_blocks=args.seqs * (-(-args.tokens // BLOCK)), block_size=BLOCK)
    step, model = runner.decode_step, runner.model
    assert step is not None, "the one-op step does not run this model"
    batch = prefill_batch(args.seqs, args.tokens, model.config.vocab_size)
    rows = every_token_a_row(batch)
    caches = runner.kv_caches
    with torch.inference_mode():
        ref = model(batch, caches, runner.backend)
        out = step(rows, caches)
    print(f"{args.seqs} x {args.tokens} tokens: max |op - module| = "
          f"{(out - ref).abs().max().item():.3g}")
    calls = {"module": lambda: model(batch, caches, runner.backend),
             "op, one-token rows": lambda: step(rows, caches)}
    stop = threading.Event()
    if args.busy:
        threading.Thread(target=spin, args=(stop,), daemon=True).start()
    for n in args.threads:
        torch.set_num_threads(n)
        times: dict[str, list[float]] = {k: [] for k in calls}
        cpu: dict[str, list[float]] = {k: [] for k in calls}  # this thread's CPU time
        with torch.inference_mode():
            for _ in range(args.repeats):
                for name, fn in calls.items():
                    t0, c0 = time.perf_counter(), time.thread_time()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.thread_time() - c0)
        print(f"{n} thr: " + ", ".join(
            f"{k} {np.percentile(v, 25) * 1e3:.1f} ms (this thread's CPU "
            f"{np.percentile(cpu[k], 25) * 1e3:.1f})" for k, v in times.items()))
    stop.set()


if __name__ == "__main__":
    main()
