"""The Worker's persistent batch, and a StepPlan packed from it into the ForwardBatch the
model runs.

A StepPlan carries per row only the block ids appended since the Worker last saw the
rid. :class:`BlockTables` keeps every known rid's table in one preallocated array,
one row per slot (a slot is the Worker's number for a rid while it holds it): a plan's
``new_blocks`` are written into the slots, a ``NewSeqData`` row (first sight, or back
after preemption by recompute) starts its slot afresh, ``StepPlan.drop`` frees it. So a
step never rebuilds what did not change, and :func:`pack_plan` builds every tensor with a
handful of vector operations over the plan's columns, not a Python loop per token.
Called by ``ModelRunner`` (worker/runner.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from actorllm.model import ForwardBatch
from actorllm.wire.messages import FEED_LAST_SAMPLE, StepPlan

_FIRST_SLOTS = 64  # the array doubles when more rids are held at once
# The longest prefill chunk packed a row per token for the one-op step. Each row's
# attention reads its whole prefix, where the module's SDPA is one matmul a chunk: at a
# 2,048-token chunk of the embedded model the op took 1.01-1.06x the module's CPU time
# on one thread, 1.00x on two (benchmarks/prefill_op.py --seqs 1 --tokens 2048); longer
# chunks are the module's.
ONE_OP_MAX_CHUNK = 2048


#: At most this many new block ids in a plan are appended row by row (BlockTables.apply).
FEW_NEW_BLOCKS = 32


class BlockTables:
    """Every held rid's block table, in slot rows of one int32 array."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        # One block more than max_model_len needs: a step planned ahead may reserve it.
        self.width = -(-max_model_len // block_size) + 1
        self.tables = np.zeros((_FIRST_SLOTS, self.width), dtype=np.int32)
        self.lens = np.zeros(_FIRST_SLOTS, dtype=np.int64)  # entries held per slot
        self.slot_of: dict[str, int] = {}
        self._free = list(range(_FIRST_SLOTS - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.slot_of)

    def table(self, rid: str) -> list[int]:
        """``rid``'s block table as held (for tests and checks)."""
        slot = self.slot_of.get(rid)
        return [] if slot is None else self.tables[slot, : self.lens[slot]].tolist()

    def reset(self, rid: str) -> None:
        """``rid`` starts afresh (a NewSeqData row): its table is empty."""
        self.drop(rid)
        self._take(rid)

    def drop(self, rid: str) -> None:
        """Forget ``rid``'s table; its slot is free for another rid."""
        slot = self.slot_of.pop(rid, None)
        if slot is not None:
            self.tables[slot, : self.lens[slot]] = 0
            self.lens[slot] = 0
            self._free.append(slot)

    def clear(self) -> None:
        for rid in list(self.slot_of):
            self.drop(rid)

    def _take(self, rid: str) -> int:
        if not self._free:
            n = len(self.lens)
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
            self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        slot = self.slot_of[rid] = self._free.pop()
        return slot

    def apply(self, plan: StepPlan) -> np.ndarray:
        """Append the plan's new block ids to its rows' tables (a rid seen for the first
        time gets a slot); returns the rows' slots. Checks every new id before writing any:
        ValueError on one outside ``[0, num_blocks)`` or a table past its width, and then
        nothing changed."""
        slot_of = self.slot_of
        try:
            slots = [slot_of[rid] for rid in plan.rids]
        except KeyError:
            slots = [slot_of[rid] if rid in slot_of else self._take(rid) for rid in plan.rids]
        rows = np.asarray(slots, dtype=np.int64)
        if not plan.new_blocks:
            return rows
        new = plan.new_blocks
        if min(new) < 0 or max(new) >= self.num_blocks:
            raise ValueError(f"block table entry out of range [0, {self.num_blocks})")
        if len(new) <= FEW_NEW_BLOCKS:
            self._append_few(plan, slots)
            return rows
        blocks = np.asarray(new, dtype=np.int64)
        counts = np.asarray(plan.num_new_blocks, dtype=np.int64)
        grown = self.lens[rows] + counts
        if grown.max() > self.width:
            i = int(np.argmax(grown))
            raise _table_full(plan.rids[i], int(grown[i]), self.width)
        # Every new id's (slot, column): rows repeated by their counts, columns counting on
        # from each table's end.
        has = np.flatnonzero(counts)
        row_of = np.repeat(rows[has], counts[has])
        first = np.repeat(np.cumsum(counts[has]) - counts[has], counts[has])
        cols = np.repeat(self.lens[rows[has]], counts[has]) + np.arange(len(blocks)) - first
        self.tables[row_of, cols] = blocks
        self.lens[rows[has]] = grown[has]
        return rows

    def _append_few(self, plan: StepPlan, slots: list[int]) -> None:
        """:meth:`apply`'s appending where few rows grow (a decode step: the rows that
        crossed into a block), row by row rather than in a dozen whole-batch numpy calls."""
        counts, new, lens = plan.num_new_blocks, plan.new_blocks, self.lens
        grow = [(i, c, int(lens[slots[i]])) for i, c in enumerate(counts) if c]
        top = max(held + c for _, c, held in grow)
        if top > self.width:  # the longest, first of equals (as the numpy path's argmax)
            i = next(i for i, c, held in grow if held + c == top)
            raise _table_full(plan.rids[i], top, self.width)
        at, tables = 0, self.tables
        for i, c, held in grow:
            slot = slots[i]
            tables[slot, held:held + c] = new[at:at + c]
            lens[slot] = held + c
            at += c


def pack_plan(plan: StepPlan, tables: BlockTables, rows: np.ndarray, max_model_len: int,
              device: torch.device,
              last_samples: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
              one_token: bool = False) -> ForwardBatch:
    """Pack ``plan`` (its rows in ``tables`` at slots ``rows``, see ``BlockTables.apply``)
    into device tensors, checking every row's length and table.

    ``last_samples(plan_rows, slots, positions)`` gives the tokens the rows scheduled
    with ``FEED_LAST_SAMPLE`` sampled last (overlap scheduling), one array for all of
    them. ValueError on a row with no tokens, over ``max_model_len``, or whose table is
    too short for its tokens: so the batch promises ``slots_valid`` (every held entry was
    range-checked on its way in). ``one_token``: every token is packed as a row of its
    own (where no chunk is longer than ``ONE_OP_MAX_CHUNK``), as
    :func:`every_token_a_row` would split the batch, here in numpy (its torch ops took
    ~85 us of a one-row verify step in the engine), for the one-op step, which then runs
    prefill and mixed steps too; not with a draft model (its ``fill`` splits later).
    """
    if one_token and len(plan.num_drafts) == 1 and plan.sample[0] \
            and plan.num_tokens[0] == plan.num_drafts[0] + 1:
        return _pack_lone_row(plan, tables, int(rows[0]), max_model_len, device)
    n = len(plan.rids)
    if plan.num_tokens.count(1) == n and plan.sample.count(True) == n and n:
        return _pack_decode(plan, tables, rows, max_model_len, device, last_samples)
    return _pack_any(plan, tables, rows, max_model_len, device, last_samples, one_token)


def _pack_any(plan: StepPlan, tables: BlockTables, rows: np.ndarray, max_model_len: int,
              device: torch.device,
              last_samples: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
              one_token: bool) -> ForwardBatch:
    """:func:`pack_plan` of any plan: prefill chunks, drafts, rows that do not sample."""
    bs = tables.block_size
    q = np.asarray(plan.num_tokens, dtype=np.int64)
    start = np.asarray(plan.start_pos, dtype=np.int64)
    seq_lens = start + q
    if q.min() <= 0:
        raise ValueError(f"rid {plan.rids[int(np.argmin(q))]!r}: scheduled with no tokens")
    if seq_lens.max() > max_model_len:
        i = int(np.argmax(seq_lens))
        raise _too_long(plan.rids[i], int(seq_lens[i]), max_model_len)
    needed = -(-seq_lens // bs)
    held = tables.lens[rows]
    short = np.flatnonzero(held < needed)
    if len(short):
        i = int(short[0])
        raise _table_short(plan.rids[i], int(seq_lens[i]), int(needed[i]), int(held[i]))
    ids = np.asarray(plan.token_ids, dtype=np.int64)
    cu = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    if len(ids) == len(q):  # all decode rows: one token each
        positions, token_rows = start, rows
    else:
        row_of = np.repeat(np.arange(len(q)), q)
        positions = np.arange(len(ids)) - cu[row_of] + start[row_of]
        token_rows = rows[row_of]
    fed = np.flatnonzero(ids == FEED_LAST_SAMPLE)
    if len(fed):
        i = np.searchsorted(cu, fed, side="right") - 1
        ids[fed] = last_samples(i, rows[i], start[i])
    slots = tables.tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
    width = int(needed.max())
    block_tables = np.ascontiguousarray(tables.tables[rows, :width])
    sample_indices = (cu[1:] - 1)[np.asarray(plan.sample, dtype=bool)]
    if plan.num_drafts:  # a speculating row's logits at its last token and each draft
        d = np.asarray(plan.num_drafts, dtype=np.int64)[np.asarray(plan.sample, dtype=bool)]
        first = np.repeat(np.cumsum(d + 1) - (d + 1), d + 1)
        sample_indices = np.repeat(sample_indices - d, d + 1) + np.arange(len(first)) - first
    if one_token and len(ids) > len(q) and q.max() <= ONE_OP_MAX_CHUNK:
        # every token a row: see every_token_a_row
        block_tables = np.ascontiguousarray(tables.tables[token_rows, :width])
        seq_lens, q = positions + 1, np.ones(len(ids), dtype=np.int64)
        cu = np.arange(len(ids) + 1)

    def dev(a: np.ndarray, dtype: type = np.int64) -> torch.Tensor:
        # Cast by numpy: on the CPU no torch call at all (each is a GIL hand-off).
        return _tensor(np.ascontiguousarray(a, dtype=dtype), device)

    return ForwardBatch(
        input_ids=dev(ids), positions=dev(positions), slot_mapping=dev(slots),
        block_tables=dev(block_tables, np.int32),
        seq_lens=dev(seq_lens, np.int32),
        cu_seqlens_q=dev(cu, np.int32),
        sample_indices=dev(sample_indices),
        max_seqlen_q=int(q.max()),
        max_seqlen_k=int(seq_lens.max()),
        slots_valid=True,  # every block-table entry was range-checked on its way in
    )


def _pack_lone_row(plan: StepPlan, tables: BlockTables, row: int, max_model_len: int,
                   device: torch.device) -> ForwardBatch:
    """:func:`pack_plan` of one speculating row ``[t, d1 .. dk]`` (its slot ``row``), as
    one-token rows, with the same checks: the general path's ~a dozen more numpy calls
    were ~25 us of such a step in the engine (concurrency 1: each call after the op
    meets cold caches; noisy, shared machine)."""
    bs = tables.block_size
    n, start = plan.num_tokens[0], plan.start_pos[0]
    end = start + n
    if end > max_model_len:
        raise _too_long(plan.rids[0], end, max_model_len)
    width = -(-end // bs)
    if tables.lens[row] < width:
        raise _table_short(plan.rids[0], end, width, int(tables.lens[row]))
    # (No FEED_LAST_SAMPLE: a row gets drafts only once its tokens are all known.)
    positions = np.arange(start, end, dtype=np.int64)
    table = tables.tables[row, :width].astype(np.int64)
    slots = table[positions // bs] * bs + positions % bs
    ordinal = np.arange(n + 1, dtype=np.int64)

    def dev(a: np.ndarray) -> torch.Tensor:
        return _tensor(a, device)

    return ForwardBatch(
        input_ids=dev(np.asarray(plan.token_ids, dtype=np.int64)), positions=dev(positions),
        slot_mapping=dev(slots),
        block_tables=dev(np.repeat(tables.tables[row:row + 1, :width], n, axis=0)),
        seq_lens=dev((positions + 1).astype(np.int32)),
        cu_seqlens_q=dev(ordinal.astype(np.int32)), sample_indices=dev(ordinal[:n]),
        max_seqlen_q=1, max_seqlen_k=end, slots_valid=True)


def _pack_decode(plan: StepPlan, tables: BlockTables, rows: np.ndarray, max_model_len: int,
                 device: torch.device,
                 last_samples: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
                 ) -> ForwardBatch:
    """:func:`pack_plan` of a decode step (every row one token that samples), with the
    same checks and the same batch in fewer numpy calls: the general path's ~53 us at
    255 rows ran ~150 us inside a busy engine, on the step thread, which under overlap
    is the cycle (issue 28; docs/architecture.md, "A decode step's own packing")."""
    bs = tables.block_size
    start = np.array(plan.start_pos, dtype=np.int64)
    seq_lens = start + 1
    top = int(seq_lens.max())
    if top > max_model_len:
        i = int(np.argmax(seq_lens))
        raise _too_long(plan.rids[i], top, max_model_len)
    needed = (seq_lens + (bs - 1)) // bs
    held = tables.lens[rows]
    if (held < needed).any():
        i = int(np.argmax(held < needed))
        raise _table_short(plan.rids[i], int(seq_lens[i]), int(needed[i]), int(held[i]))
    ids = np.array(plan.token_ids, dtype=np.int64)
    if FEED_LAST_SAMPLE in plan.token_ids:
        fed = np.flatnonzero(ids == FEED_LAST_SAMPLE)
        ids[fed] = last_samples(fed, rows[fed], start[fed])
    block, within = np.divmod(start, bs)
    slots = tables.tables[rows, block].astype(np.int64) * bs + within
    ordinal = np.arange(len(start) + 1, dtype=np.int64)

    def dev(a: np.ndarray) -> torch.Tensor:
        return _tensor(a, device)

    return ForwardBatch(
        input_ids=dev(ids), positions=dev(start), slot_mapping=dev(slots),
        block_tables=dev(tables.tables[rows, :(top + bs - 1) // bs]),
        seq_lens=dev(seq_lens.astype(np.int32)), cu_seqlens_q=dev(ordinal.astype(np.int32)),
        sample_indices=dev(ordinal[:-1]), max_seqlen_q=1, max_seqlen_k=top,
        slots_valid=True)


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` as a tensor on ``device``: the same memory on the CPU, else an async copy."""
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device=device, non_blocking=True)


def _too_long(rid: str, tokens: int, max_model_len: int) -> ValueError:
    """The error of a row whose ``tokens`` would pass ``max_model_len``."""
    return ValueError(f"rid {rid!r}: {tokens} tokens exceed max_model_len {max_model_len}")


def _table_full(rid: str, entries: int, width: int) -> ValueError:
    """The error of a plan that would grow a row's block table past its ``width``."""
    return ValueError(f"rid {rid!r}: a block table of {entries} entries, past {width}")


def _table_short(rid: str, tokens: int, needed: int, held: int) -> ValueError:
    """The error of a row whose block table holds fewer blocks than its tokens need."""
    return ValueError(f"rid {rid!r}: {tokens} tokens need {needed} blocks, block table "
                      f"has {held}")


def one_token_rows(plan: StepPlan, batch: ForwardBatch) -> ForwardBatch:
    """``batch`` (``plan`` packed) with each speculating row as one row per token, for the
    one-op decode step (ops/cpu_step.py), when every row is a decode or speculating row;
    else ``batch`` itself.

    The op writes every token's K/V into the cache before any row attends, so the token
    at position p of a row ``[t, d1 .. dk]`` is a row of its own with the row's table and
    ``seq_len = p + 1``: it sees exactly the tokens a causal mask would let it see. Input
    ids, positions, slots and the logits rows stay as they are, one per token.
    """
    if not plan.num_drafts or batch.max_seqlen_q == 1:
        return batch
    q = np.asarray(plan.num_tokens, dtype=np.int64)
    if not (q == 1 + np.asarray(plan.num_drafts, dtype=np.int64)).all():
        return batch  # a prefill chunk: the model module runs the step
    return every_token_a_row(batch)


def every_token_a_row(batch: ForwardBatch) -> ForwardBatch:
    """``batch`` with every token a row of its own, for the one-op step (ops/cpu_step.py):
    a prefill chunk's token at position p gets its sequence's block table and
    ``seq_len = p + 1`` (:func:`one_token_rows` says why that is the causal mask)."""
    if batch.max_seqlen_q == 1:
        return batch
    cu = batch.cu_seqlens_q.cpu().numpy()
    dev = batch.positions.device
    row_of = torch.from_numpy(np.repeat(np.arange(len(cu) - 1), np.diff(cu))).to(dev)
    return dataclasses.replace(
        batch, seq_lens=(batch.positions + 1).to(torch.int32),
        block_tables=batch.block_tables[row_of],
        cu_seqlens_q=torch.arange(len(row_of) + 1, dtype=torch.int32, device=dev),
        max_seqlen_q=1)


def every_token_samples(batch: ForwardBatch) -> bool:
    """Whether every token of ``batch`` is a sampling row (decode and verify steps whose
    rows all sample), so the one op's ``logits=True`` makes exactly the logits needed."""
    return batch.sample_indices.shape[0] == batch.input_ids.shape[0]
