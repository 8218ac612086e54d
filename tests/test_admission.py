"""The admission gate: one object for the engine's and the server's refusals."""

from __future__ import annotations

import pytest

from actorllm.engine.admission import Admission, Gate, Refused


def test_reserve_and_release_count_against_the_capacity() -> None:
    gate = Admission(capacity=4)
    gate.reserve(3)
    with pytest.raises(Refused) as full:
        gate.reserve(2)
    assert full.value.code == "overloaded" and gate.held == 3
    with pytest.raises(Refused) as never:
        gate.reserve(5)
    assert never.value.code == "too_large"
    gate.release(3)
    gate.reserve(4)
    assert gate.held == 4
    with pytest.raises(ValueError):
        gate.release(5)


def test_drain_refuses_new_work_but_lets_held_work_go() -> None:
    gate = Admission()
    gate.reserve(2)
    gate.drain()
    assert gate.draining and gate.refusal() is not None
    with pytest.raises(Refused) as refused:
        gate.reserve(1)
    assert refused.value.code == "shutting_down"
    gate.release(2)
    assert gate.held == 0


def test_death_is_final_and_an_orderly_stop_is_not_a_death() -> None:
    gate = Admission()
    gate.stop()
    assert not gate.kill("late") and not gate.died.is_set()
    assert gate.gate is Gate.STOPPED
    other = Admission()
    assert other.kill("the engine child exited") and other.died.is_set()
    assert not other.kill("second")
    refused = other.refusal()
    assert refused is not None and refused.code == "engine_dead"
    assert str(refused) == "the engine child exited"
