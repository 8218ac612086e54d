"""One step of the largest size before serving, so a burst's first prefill runs warm.

A freshly built runner has never run a step of ``max_num_batched_tokens`` tokens. The
first one touches every page of its activations for the first time (glibc's heap grows
to the peak once, then keeps it: ``worker/sizing.keep_heap``) and starts the large-step
thread team, and it is the first step of the first burst a server sees: on the embedded
model, 64 prompts at once, the burst's first prefill step took about twice the time per
token of the same step in a later burst (docs/architecture.md, "Where a first token
waits"). vLLM runs such a step at start-up too (its profile run), so without this the
first measured scenario of a benchmark paid a cost the peer did not.

The step is the Worker's own business: rows of made-up prompts in blocks the Scheduler
has not handed out yet, greedy, then dropped, so no sampling state, table row or random
draw survives it. The K/V it writes is never read: a block is read only by a sequence
whose own steps wrote it first, or as a prefix-cache hit, which only a real step's
result registers.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

from actorllm.config import EngineConfig, ModelInfo
from actorllm.wire.sampling import SamplingParams
from actorllm.wire.steps import NewSeqData, StepPlan

log = logging.getLogger(__name__)

ROW_TOKENS = 128  # a row's length: a typical prompt, so attention sees several rows
WARMUP_RID = "warmup-{}"


def warmup_plans(tokens: int, *, block_size: int, num_blocks: int, max_model_len: int,
                 vocab_size: int) -> list[StepPlan]:
    """The plans of a warm-up: one prefill step of up to ``tokens`` tokens in rows of
    ``ROW_TOKENS`` (each sampling, greedily), in the pool's first blocks; then an empty
    step that drops every row. Empty if not even one block can be spared."""
    row_len = max(1, min(ROW_TOKENS, max_model_len - 1, tokens))
    blocks_per_row = math.ceil(row_len / block_size)
    rows = min(math.ceil(tokens / row_len), num_blocks // blocks_per_row)
    if rows < 1:
        return []
    lengths = [row_len] * rows
    lengths[-1] = min(row_len, tokens - row_len * (rows - 1))
    rids = tuple(WARMUP_RID.format(i) for i in range(rows))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    ids = [tuple((3 + i + j) % vocab_size for j in range(n)) for i, n in enumerate(lengths)]
    counts = [math.ceil(n / block_size) for n in lengths]
    starts = [sum(counts[:i]) for i in range(rows)]
    step = StepPlan(
        step_id=0, rids=rids, num_tokens=tuple(lengths),
        token_ids=tuple(t for row in ids for t in row), start_pos=(0,) * rows,
        sample=(True,) * rows, num_new_blocks=tuple(counts),
        new_blocks=tuple(b for s, c in zip(starts, counts, strict=True)
                         for b in range(s, s + c)),
        new_rows=tuple(range(rows)),
        new=tuple(NewSeqData(params=params, prompt_token_ids=row) for row in ids))
    return [step, StepPlan(step_id=1, drop=rids)]


def warm_up(runner: Any, tokens: int, *, block_size: int, max_model_len: int,
            vocab_size: int) -> float:
    """Run :func:`warmup_plans` on ``runner`` (a ModelRunner) and leave it as it was
    found: no rid known. Returns the seconds it took. A failed step is logged and
    ignored (serving would meet the same failure with a real request and say so)."""
    t0 = time.perf_counter()
    for plan in warmup_plans(tokens, block_size=block_size, num_blocks=runner.num_blocks,
                             max_model_len=max_model_len, vocab_size=vocab_size):
        result = runner.execute(plan)
        if result.error is not None:
            log.warning("warm-up step failed (ignored): %s", result.error)
            break
    runner.drop_all()
    took = time.perf_counter() - t0
    log.info("warm-up: one step of %d tokens in %.2f s", tokens, took)
    return took


def warmup_for(config: EngineConfig, info: ModelInfo | None, runner: Any,
               large_team: int | None) -> Callable[[], object] | None:
    """The Worker's start-up step for ``config`` (``Worker(warmup=...)``), or None. Only
    where a server's first burst pays for a cold step: a Worker with a large-step team
    of its own (``large_team``: ``placement.large_step_threads``, which is None offline,
    with ``--cpu-threads`` and off the CPU), one rank, no draft model (neither
    measured), a model whose limits are known, and no ``ACTORLLM_WARMUP=0`` in the
    environment (for A/B runs, as ``ACTORLLM_KEEP_HEAP``)."""
    if large_team is None or info is None or config.speculative is not None \
            or config.tensor_parallel_size > 1 or os.environ.get("ACTORLLM_WARMUP") == "0":
        return None
    return lambda: warm_up(runner, config.max_num_batched_tokens,
                           block_size=config.block_size, max_model_len=info.max_model_len,
                           vocab_size=info.vocab_size)
