"""Packing a plan into the batch the model runs (worker/packing.py).

A decode step (every row one token that samples) has a path of its own, the step
thread's most frequent; it must give the batch, and the errors, that the path for any
plan gives on the same plan.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples

from actorllm.model import ForwardBatch
from actorllm.wire.messages import FEED_LAST_SAMPLE
from actorllm.wire.steps import StepPlan
from actorllm.worker import packing
from actorllm.worker.packing import BlockTables

BLOCK, MAX_LEN, BLOCKS = 4, 40, 64
CPU = torch.device("cpu")


def _fed(rows: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """A stand-in for the runner's last samples: a value that says which row it is for."""
    return 1000 * rows + positions


@st.composite
def decode_steps(draw: st.DrawFn) -> tuple[BlockTables, StepPlan, np.ndarray]:
    """Tables holding some rids, and a decode step over some of them (a few rows fed
    their last sample, a few past max_model_len or their tables when drawn so)."""
    tables = BlockTables(BLOCKS, BLOCK, MAX_LEN)
    n = draw(st.integers(1, 12))
    rids = [f"r{i}" for i in range(n)]
    starts = []
    for rid in rids:
        start = draw(st.integers(0, MAX_LEN + 1))
        need = start // BLOCK + 1
        has = draw(st.sampled_from([need, need, need + 1, max(need - 1, 0)]))
        has = min(has, tables.width)
        blocks = draw(st.lists(st.integers(0, BLOCKS - 1), min_size=has, max_size=has))
        tables.apply(StepPlan(step_id=0, rids=(rid,), num_tokens=(1,), token_ids=(1,),
                              start_pos=(0,), sample=(True,), num_new_blocks=(has,),
                              new_blocks=tuple(blocks)))
        starts.append(start)
    order = draw(st.permutations(range(n)))
    ids = [draw(st.sampled_from([FEED_LAST_SAMPLE, 7, 11])) for _ in range(n)]
    plan = StepPlan(step_id=1, rids=tuple(rids[i] for i in order), num_tokens=(1,) * n,
                    token_ids=tuple(ids), start_pos=tuple(starts[i] for i in order),
                    sample=(True,) * n)
    return tables, plan, tables.apply(plan)


def _packed(fn: Callable[..., ForwardBatch], *args: object) -> object:
    """The batch as plain lists, or the error's message."""
    try:
        batch = fn(*args)
    except ValueError as exc:
        return str(exc)
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v)
            for k, v in vars(batch).items()} | {
        "dtypes": [v.dtype for v in vars(batch).values() if isinstance(v, torch.Tensor)]}


@settings(max_examples=examples(300), deadline=None)
@given(decode_steps())
def test_a_decode_step_packs_as_any_plan_does(case: tuple[BlockTables, StepPlan, np.ndarray]
                                              ) -> None:
    tables, plan, rows = case
    fast = _packed(packing._pack_decode, plan, tables, rows, MAX_LEN, CPU, _fed)
    general = _packed(packing._pack_any, plan, tables, rows, MAX_LEN, CPU, _fed, True)
    assert fast == general


def test_pack_plan_takes_the_decode_path_only_for_decode_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row one token that samples: the decode path; a row that does not sample,
    or two tokens in a row, the general one."""
    tables = BlockTables(BLOCKS, BLOCK, MAX_LEN)
    taken: list[str] = []
    real_decode, real_any = packing._pack_decode, packing._pack_any
    monkeypatch.setattr(packing, "_pack_decode",
                        lambda *a: taken.append("decode") or real_decode(*a))
    monkeypatch.setattr(packing, "_pack_any", lambda *a: taken.append("any") or real_any(*a))

    def pack(num_tokens: tuple[int, ...], sample: tuple[bool, ...]) -> None:
        plan = StepPlan(step_id=1, rids=("a", "b"), num_tokens=num_tokens,
                        token_ids=(5,) * sum(num_tokens), start_pos=(0, 0), sample=sample,
                        num_new_blocks=(1, 1) if not taken else (0, 0), new_blocks=(1, 2)
                        if not taken else ())
        packing.pack_plan(plan, tables, tables.apply(plan), MAX_LEN, CPU, _fed)

    pack((1, 1), (True, True))
    pack((1, 1), (True, False))
    pack((2, 1), (True, True))
    assert taken == ["decode", "any", "any"]


def test_a_decode_step_past_its_table_is_refused_with_its_rid() -> None:
    tables = BlockTables(BLOCKS, BLOCK, MAX_LEN)
    plan = StepPlan(step_id=1, rids=("a", "b"), num_tokens=(1, 1), token_ids=(5, 6),
                    start_pos=(3, 4), sample=(True, True), num_new_blocks=(1, 1),
                    new_blocks=(1, 2))
    with pytest.raises(ValueError, match="'b': 5 tokens need 2 blocks, block table has 1"):
        packing.pack_plan(plan, tables, tables.apply(plan), MAX_LEN, CPU, _fed)


@st.composite
def growing_plans(draw: st.DrawFn) -> tuple[list[StepPlan], StepPlan]:
    """Plans that give some rids tables, then one more that grows some of them (some past
    their width, some block ids out of range, when drawn so), and new rids among them."""
    n = draw(st.integers(1, 10))
    rids = [f"r{i}" for i in range(n)]
    first = []
    for rid in rids[: draw(st.integers(0, n))]:
        has = draw(st.integers(0, BlockTables(BLOCKS, BLOCK, MAX_LEN).width))
        first.append(StepPlan(step_id=0, rids=(rid,), num_tokens=(1,), token_ids=(1,),
                              start_pos=(0,), sample=(True,), num_new_blocks=(has,),
                              new_blocks=tuple(draw(st.lists(st.integers(0, BLOCKS - 1),
                                                             min_size=has, max_size=has)))))
    order = draw(st.permutations(rids))
    counts = [draw(st.sampled_from([0, 0, 1, 2, 5])) for _ in order]
    top = BLOCKS if draw(st.booleans()) else BLOCKS - 1
    blocks = draw(st.lists(st.integers(0, top), min_size=sum(counts), max_size=sum(counts)))
    grow = StepPlan(step_id=1, rids=tuple(order), num_tokens=(1,) * n, token_ids=(1,) * n,
                    start_pos=(0,) * n, sample=(True,) * n, num_new_blocks=tuple(counts),
                    new_blocks=tuple(blocks))
    return first, grow


@settings(max_examples=examples(300), deadline=None)
@given(growing_plans())
def test_few_new_blocks_are_appended_as_many_are(
        case: tuple[list[StepPlan], StepPlan]) -> None:
    """``BlockTables.apply`` appends a decode step's few new blocks row by row and many in
    whole-batch numpy calls: both leave the same tables and slots, or refuse the plan with
    the same message and change nothing."""
    first, grow = case
    outcomes = []
    for few in (0, 10**6):  # every plan by numpy; every plan row by row
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(packing, "FEW_NEW_BLOCKS", few)
            tables = BlockTables(BLOCKS, BLOCK, MAX_LEN)
            for plan in first:
                tables.apply(plan)
            before = tables.tables.copy(), tables.lens.copy()
            try:
                got: object = tables.apply(grow).tolist()
            except ValueError as exc:
                got = str(exc)
                assert (tables.tables == before[0]).all() and (tables.lens == before[1]).all()
            outcomes.append((got, tables.tables.tolist(), tables.lens.tolist(),
                             dict(tables.slot_of)))
    assert outcomes[0] == outcomes[1]
