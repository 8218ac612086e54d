"""PlanColumns.fill's plain decode rows against Sequence.schedule_into, row by row."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples

from actorllm.scheduler.columns import PlanColumns
from actorllm.scheduler.sequence import Sequence
from actorllm.wire.messages import SamplingParams


@st.composite
def sequences(draw: st.DrawFn) -> Sequence:
    """A sequence at any point of its decode: tokens known or one in flight, blocks sent
    or not, known to the Worker or not, with or without prompt logprobs."""
    prompt = draw(st.lists(st.integers(0, 99), min_size=1, max_size=20))
    out = draw(st.lists(st.integers(0, 99), max_size=6))
    known = len(prompt) + len(out)
    flies = draw(st.integers(0, 1))
    start = known - 1 + flies  # one token to run: the last known, or the one in flight
    blocks = draw(st.lists(st.integers(0, 500), min_size=-(-(start + 1) // 4), max_size=12))
    params = SamplingParams(prompt_logprobs=draw(st.sampled_from([None, None, 1])))
    return Sequence("r", prompt, params, draw(st.integers(0, 40)), frozenset({1}),
                    output_ids=out, block_table=blocks, num_scheduled=start,
                    in_flight=flies, samples_in_flight=flies,
                    worker_knows=draw(st.booleans()),
                    blocks_sent=draw(st.integers(0, len(blocks))),
                    prompt_lps_next=draw(st.integers(0, len(prompt))))


@settings(max_examples=examples(200), deadline=None)
@given(rows=st.lists(sequences(), min_size=1, max_size=6))
def test_fill_writes_what_schedule_into_writes(rows: list[Sequence]) -> None:
    mine, theirs = PlanColumns(), PlanColumns()
    copies = [copy.deepcopy(seq) for seq in rows]
    mine.fill([(seq, 1) for seq in rows])
    for seq in copies:
        seq.schedule_into(theirs, 1)
    for name in PlanColumns.__slots__:
        assert getattr(mine, name) == getattr(theirs, name), name
    for a, b in zip(rows, copies, strict=True):
        for field in ("num_scheduled", "in_flight", "samples_in_flight", "worker_knows",
                      "blocks_sent", "prompt_lps_next"):
            assert getattr(a, field) == getattr(b, field), field
