"""The deterministic simulation: the real actors under every interleaving hypothesis can
find, with every invariant of DESIGN.md §3 checked after every step (see tests/sim/).

The three configurations differ in what they stress: ``default`` (preemption, chunked
prefill, some backpressure), ``tight`` (one-message mailboxes, a pool that holds barely
one full sequence, two running sequences at most), ``roomy`` (no pressure: big batches).
Their CI shares add up to 2,000 examples; ``--hypothesis-profile=long`` runs 10x deeper.
"""

from __future__ import annotations

from typing import Any

from hypothesis.stateful import run_state_machine_as_test
from sim import SimConfig, make_machine
from sim.profiles import sim_settings

TIGHT = SimConfig(num_blocks=5, max_num_seqs=2, max_num_batched_tokens=4, capacity=1,
                  worker_capacity=1)
ROOMY = SimConfig(num_blocks=64, max_num_seqs=16, max_num_batched_tokens=64, capacity=16)


def test_lifecycle_default(tiny_tokenizer: Any) -> None:
    run_state_machine_as_test(make_machine(tiny_tokenizer), settings=sim_settings(900))


def test_lifecycle_tight(tiny_tokenizer: Any) -> None:
    run_state_machine_as_test(make_machine(tiny_tokenizer, TIGHT), settings=sim_settings(700))


def test_lifecycle_roomy(tiny_tokenizer: Any) -> None:
    run_state_machine_as_test(make_machine(tiny_tokenizer, ROOMY), settings=sim_settings(400))
