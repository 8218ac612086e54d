"""The streamed responses' share of the loop (``server/pacing.py``): a reader is held only
while the loop owes writing time, every held reader goes at once when it is paid, and the
hold is bounded (time is trio's MockClock: nothing reads the wall clock); a held stream
loses nothing and merges what came meanwhile."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from helpers import Call, app_for

from actorllm.engine.async_engine import AsyncEngine
from actorllm.scheduler.totals import StepTotals
from actorllm.server import pacing
from actorllm.server.pacing import WritePacer
from actorllm.topology.placement import waits_for_loop
from actorllm.wire.codec import decode, encode
from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import SchedulerStats, StepPlan, StepResult, TokenBatch


def _run(fn: object) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))  # type: ignore[arg-type]


def test_a_reader_that_owes_nothing_is_not_held():
    async def main() -> None:
        pacer = WritePacer()
        await pacer.turn()  # nothing charged yet
        pacer.charge(0.0)
        await pacer.turn()
        assert pacer.held == 0

    _run(main)


def test_a_charge_holds_the_next_turn_until_pace_times_it_has_passed():
    async def main() -> None:
        pacer = WritePacer()
        cost = 0.001
        await trio.sleep(1.0)  # the writing happened in the last `cost` seconds
        start = trio.current_time()
        pacer.charge(cost)
        await pacer.turn()
        waited = trio.current_time() - start
        assert pacer.held == 1
        # Writing ended at `start`: the loop owes PACE - 1 times what it took.
        assert abs(waited - (pacing.PACE - 1) * cost) < 1e-9

    _run(main)


def test_readers_of_one_wake_up_owe_the_sum_and_go_together():
    async def main() -> None:
        pacer = WritePacer()
        await trio.sleep(1.0)
        cost, readers = 0.0005, 4
        woke: list[float] = []
        clock = trio.lowlevel.current_clock()
        assert isinstance(clock, trio.testing.MockClock)
        for _ in range(readers):  # back to back, as one wake-up's readers run
            clock.jump(cost)
            pacer.charge(cost)
        end = trio.current_time()

        async def reader() -> None:
            await pacer.turn()
            woke.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            for _ in range(readers):
                nursery.start_soon(reader)
        assert pacer.held == readers
        assert len(set(woke)) == 1  # one opening for all of them
        expected = (pacing.PACE - 1) * cost * readers
        assert abs(woke[0] - end - expected) < 1e-9

    _run(main)


def test_time_spent_on_other_work_pays_the_debt():
    async def main() -> None:
        pacer = WritePacer()
        await trio.sleep(1.0)
        pacer.charge(0.001)
        await trio.sleep(pacing.PACE * 0.001)  # the engine's steps ran meanwhile
        await pacer.turn()
        assert pacer.held == 0

    _run(main)


def test_the_hold_is_bounded_and_a_blocked_write_counts_little():
    async def main() -> None:
        pacer = WritePacer()
        await trio.sleep(10.0)
        for _ in range(1000):  # far more writing than MAX_HOLD can pay back
            pacer.charge(1.0)  # a write that waited on a full socket for a second
        start = trio.current_time()
        await pacer.turn()
        assert trio.current_time() - start <= pacing.MAX_HOLD + 1e-9

    _run(main)


def test_a_held_reader_can_be_cancelled():
    async def main() -> None:
        pacer = WritePacer()
        await trio.sleep(1.0)
        pacer.charge(pacing.MAX_CHARGE)
        with trio.CancelScope() as scope:
            scope.cancel()
            await pacer.turn()
        assert scope.cancelled_caught
        # A later reader is not stuck behind the cancelled one.
        await pacer.turn()

    _run(main)


def test_a_hold_of_zero_never_holds():
    async def main() -> None:
        pacer = WritePacer(max_hold=0.0)  # --max-stream-hold 0
        await trio.sleep(1.0)
        for _ in range(10):
            pacer.charge(pacing.MAX_CHARGE)
            await pacer.turn()
        assert pacer.held == 0

    _run(main)


def test_a_reader_held_later_goes_with_the_first():
    async def main() -> None:
        pacer = WritePacer()
        await trio.sleep(1.0)
        pacer.charge(0.001)
        woke: list[float] = []

        async def reader(charge_first: bool) -> None:
            if charge_first:  # writes after the first was held: the debt grows
                pacer.charge(0.001)
            await pacer.turn()
            woke.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader, False)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(reader, True)
        assert pacer.held == 2 and len(set(woke)) == 1

    _run(main)


def test_a_reader_is_held_only_while_the_engine_waits_for_the_loop():
    async def main() -> None:
        waits = False
        pacer = WritePacer(engine_waits=lambda: waits)
        await trio.sleep(1.0)
        pacer.charge(0.001)
        start = trio.current_time()
        await pacer.turn()  # owes, but the Worker has a plan to run: holding wins nothing
        assert pacer.held == 0 and trio.current_time() == start
        waits = True  # now the engine waits for the loop: the debt is paid first
        await trio.sleep(pacing.WAITS_FRESH)  # (the last answer stands that long)
        start = trio.current_time()
        pacer.charge(0.001)
        await pacer.turn()
        assert pacer.held == 1 and trio.current_time() > start

    _run(main)


def test_the_readers_of_one_wake_up_ask_whether_the_engine_waits_once():
    async def main() -> None:
        asked = 0

        def waits() -> bool:
            nonlocal asked
            asked += 1
            return False

        pacer = WritePacer(engine_waits=waits)
        await trio.sleep(1.0)
        for _ in range(64):  # one wake-up: each reader charges, then asks for its turn
            pacer.charge(0.0001)
            await pacer.turn()
        assert asked == 1 and pacer.held == 0
        await trio.sleep(pacing.WAITS_FRESH)
        pacer.charge(0.0001)
        await pacer.turn()
        assert asked == 2  # a later wake-up asks again

    _run(main)


def test_the_engine_waits_for_the_loop_when_a_worker_waited_for_its_plan_or_work_waits():
    """The signal comes by message: the Scheduler's latest stats, as the Frontend got them
    (the same in ``single`` and across ZeroMQ in ``engine``), or this process's inboxes."""
    stats = SchedulerStats()
    detok: Mailbox[TokenBatch] = Mailbox("detokenizer", TokenBatch, capacity=4)
    other: Mailbox[StepPlan] = Mailbox("worker", StepPlan, capacity=4)
    boxes: dict[str, Mailbox[Any]] = {"detokenizer": detok, "worker": other}

    def waits() -> bool:
        return waits_for_loop(lambda: stats, boxes)

    assert not waits()
    other.send_nowait(StepPlan(1))  # a plan waiting for the Worker is not the loop's work
    assert not waits()
    stats = SchedulerStats(worker_waited=1)  # the latest step's plan came late
    assert waits()
    stats = SchedulerStats(worker_waited=0, plan_wait_s=3.0)  # (a total: not "now")
    assert not waits()
    detok.send_nowait(TokenBatch.of([]))  # a step's outputs wait for the loop
    assert waits()
    tok: Mailbox[StepPlan] = Mailbox("tokenizer", StepPlan, capacity=4)  # (any type)
    tok.send_nowait(StepPlan(2))  # requests wait to be tokenized: a burst arriving
    assert waits_for_loop(lambda: stats, {"tokenizer": tok})


def test_the_worker_waited_flag_travels_from_the_step_result_to_the_frontend():
    """The Worker's ``plan_wait_s`` reaches the stats the pacing reads: the Scheduler's
    totals keep the latest step's flag (and the running sum), and the codec carries both
    across ZeroMQ for ``engine``."""
    totals = StepTotals()
    totals.add_result(StepResult(1, plan_wait_s=0.004), rows=3)
    assert totals.fields()["worker_waited"] == 1
    totals.add_result(StepResult(2), rows=3)  # the next plan was queued in time
    stats = SchedulerStats(**totals.fields())
    assert stats.worker_waited == 0 and stats.plan_wait_s == 0.004
    # A short wait beside a long step is the plan's own latency (no overlap), not the loop.
    totals.add_result(StepResult(3, plan_wait_s=0.001, forward_s=0.02), rows=3)
    assert totals.fields()["worker_waited"] == 0
    totals.add_result(StepResult(4, plan_wait_s=0.001, forward_s=0.002), rows=3)
    batch = TokenBatch.of([], stats=SchedulerStats(**totals.fields()))
    back = decode(encode(batch))
    assert back.stats.worker_waited == 1 and back.stats.plan_wait_s == pytest.approx(0.006)


class _HeldUntilReleased(WritePacer):
    """A pacer that holds every turn until the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.release = trio.Event()

    async def turn(self) -> None:
        self.held += 1
        await self.release.wait()


async def test_a_held_stream_merges_what_came_meanwhile(engine: AsyncEngine) -> None:
    app = app_for(engine)
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = await Call("/v1/completions", body).run(app)
    text = whole.json()["choices"][0]["text"]
    pacer = app.state.server.pacer = _HeldUntilReleased()
    call = Call("/v1/completions", {**body, "stream": True})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call.run, app)
        with trio.fail_after(30):
            while not pacer.held:  # the first token is out; the reader waits its turn
                await trio.sleep(0.001)
            assert await engine.wait_drained(30.0) == []  # the engine is done meanwhile
        pacer.release.set()
    assert call.status == 200 and call.done
    chunks = [json.loads(e)["choices"][0] for e in call.events()[:-1]]
    # The first token, then everything else with the finish in one chunk.
    assert len(chunks) == 2
    assert chunks[1]["finish_reason"] == "length"
    assert "".join(c["text"] for c in chunks) == text
