"""A StepPlan packed into the ForwardBatch the model runs: host tuples to device tensors.

This is where a step changes shape on its way to the device: the Scheduler's
per-sequence token ids, start positions and block tables become flat int arrays (ids,
positions, KV slots, lengths, cumulative query lengths, sampled rows) and a padded
block table, one tensor each. Per-token work is one list comprehension per sequence
(the slots of its new tokens); every tensor is made from a flat ``array`` without
per-element Python objects. Called by ``ModelRunner._prepare`` (worker/runner.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

import torch

from actorllm.model import ForwardBatch
from actorllm.wire.messages import FEED_LAST_SAMPLE, StepPlan


def pack_plan(plan: StepPlan, block_size: int, num_blocks: int, max_model_len: int,
              device: torch.device, last_sample: Callable[[str, int], int]) -> ForwardBatch:
    """Pack ``plan`` into device tensors, checking every sequence's length and table.

    ``last_sample(rid, position)`` gives the token a sequence scheduled with
    ``FEED_LAST_SAMPLE`` was sampled last (overlap scheduling). ValueError on a
    sequence with no tokens, over ``max_model_len``, or a block table too short or
    with an entry outside ``[0, num_blocks)``: so the batch promises ``slots_valid``.
    """
    bs = block_size
    seqs = plan.seqs
    input_ids, positions, slots = array("q"), array("q"), array("q")
    seq_lens, cu, sample_indices = array("i"), array("i", [0]), array("q")
    tables: list[tuple[int, ...]] = []
    max_q = 0
    for s in seqs:
        q_len, start = len(s.token_ids), s.start_pos
        seq_len = start + q_len
        if q_len == 0:
            raise ValueError(f"rid {s.rid!r}: scheduled with no tokens")
        if seq_len > max_model_len:
            raise ValueError(
                f"rid {s.rid!r}: {seq_len} tokens exceed max_model_len {max_model_len}"
            )
        needed = -(-seq_len // bs)
        table = s.block_table
        if len(table) < needed:
            raise ValueError(
                f"rid {s.rid!r}: {seq_len} tokens need {needed} blocks, "
                f"block table has {len(table)}"
            )
        if needed and (min(table[:needed]) < 0 or max(table[:needed]) >= num_blocks):
            raise ValueError(f"block table entry out of range [0, {num_blocks})")
        tables.append(table[:needed])
        if s.token_ids[0] == FEED_LAST_SAMPLE:
            input_ids.append(last_sample(s.rid, s.start_pos))
        else:
            input_ids.extend(s.token_ids)
        if q_len == 1:
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            span = range(start, seq_len)
            positions.extend(span)
            slots.extend([table[p // bs] * bs + p % bs for p in span])
        seq_lens.append(seq_len)
        cu.append(cu[-1] + q_len)
        if s.sample:
            sample_indices.append(cu[-1] - 1)
        max_q = max(max_q, q_len)
    width = max(len(t) for t in tables)
    flat = array("i")
    for t in tables:
        flat.extend(t)
        if len(t) < width:
            flat.extend((0,) * (width - len(t)))

    def dev(a: array, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        kind = torch.int64 if a.typecode == "q" else torch.int32
        t = torch.frombuffer(a, dtype=kind) if len(a) else torch.empty(0, dtype=kind)
        return t.to(device=device, dtype=dtype, non_blocking=True)

    return ForwardBatch(
        input_ids=dev(input_ids), positions=dev(positions), slot_mapping=dev(slots),
        block_tables=dev(flat, torch.int32).view(len(seqs), width),
        seq_lens=dev(seq_lens, torch.int32),
        cu_seqlens_q=dev(cu, torch.int32),
        sample_indices=dev(sample_indices),
        max_seqlen_q=max_q,
        max_seqlen_k=max(seq_lens),
        slots_valid=True,  # every block-table entry was range-checked above
    )
