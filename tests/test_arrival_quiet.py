"""Overlap scheduling waits out a burst of arrivals (``Scheduler.quiet_s``).

With two steps in flight the Scheduler plans step N+1 as soon as step N is sent; a
request that arrives while N runs then waits for N+1 to return before it can start.
While requests are arriving (within ``quiet_s`` of the last one) it plans no step
ahead. Time here is trio's MockClock, moved by hand: nothing reads the wall clock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import trio.testing
from test_scheduler import answer, request

from actorllm.scheduler.actor import Scheduler
from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import FEED_LAST_SAMPLE, SchedulerInput, StepPlan, TokenBatch

QUIET = 0.1
PROMPT, MAX_TOKENS = 4, 50  # a prefill step, then decode steps enough for the test


Body = Callable[[Mailbox[SchedulerInput], Mailbox[StepPlan], trio.testing.MockClock],
                Awaitable[None]]


def drive(quiet_s: float, body: Body) -> None:
    """Run a Scheduler with two steps in flight and ``quiet_s`` beside ``body``, which
    plays the Tokenizer and the Worker; the Detokenizer's box is drained."""
    clock = trio.testing.MockClock()

    async def main() -> None:
        inbox = Mailbox("s", SchedulerInput, 8)
        worker = Mailbox("w", StepPlan, 8)
        detok = Mailbox("d", TokenBatch, 64)
        sched = Scheduler(inbox, worker, detok, num_blocks=64, block_size=4, max_num_seqs=8,
                          max_num_batched_tokens=64, max_steps_in_flight=2, quiet_s=quiet_s)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run)
            nursery.start_soon(drain, detok)
            await body(inbox, worker, clock)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)


async def drain(box: Mailbox[TokenBatch]) -> None:
    async for _ in box:
        pass


async def planned(worker: Mailbox[StepPlan]) -> list[StepPlan]:
    """Every plan the Scheduler has sent once it has nothing more to do."""
    await trio.testing.wait_all_tasks_blocked()
    plans = []
    while True:
        try:
            plans.append(worker.receive_nowait())
        except trio.WouldBlock:
            return plans


def test_no_step_is_planned_ahead_until_arrivals_have_paused() -> None:
    """The spell runs from the latest arrival: a request that arrives while a step runs
    joins the next step, and steps are planned ahead again once arrivals pause."""
    async def body(inbox: Mailbox[SchedulerInput], worker: Mailbox[StepPlan],
                   clock: trio.testing.MockClock) -> None:
        await inbox.send(request("a", PROMPT, MAX_TOKENS))
        [step0] = await planned(worker)  # nothing in flight: planned at once
        clock.jump(0.6 * QUIET)
        await inbox.send(request("b", PROMPT, MAX_TOKENS))  # a second arrival restarts the spell
        assert await planned(worker) == []  # step 0 runs: nothing is planned ahead of it
        clock.jump(0.6 * QUIET)  # past a's spell, within b's
        await inbox.send(answer(step0))
        [step1] = await planned(worker)  # b joins the step after the one that ran
        assert set(step1.rids) == {"a", "b"}
        assert FEED_LAST_SAMPLE not in step1.token_ids
        clock.jump(QUIET)  # no arrival for QUIET: a step may be planned ahead again
        await inbox.send(answer(step1))
        step2, step3 = await planned(worker)
        assert FEED_LAST_SAMPLE not in step2.token_ids
        assert step3.token_ids == (FEED_LAST_SAMPLE,) * 2  # planned while step 2 runs

    drive(QUIET, body)


def test_with_no_spell_a_step_is_planned_ahead_at_once() -> None:
    """``quiet_s`` 0 is overlap scheduling as before: the step after a request's prefill
    is planned while the prefill runs."""
    async def body(inbox: Mailbox[SchedulerInput], worker: Mailbox[StepPlan],
                   clock: trio.testing.MockClock) -> None:
        await inbox.send(request("a", PROMPT, MAX_TOKENS))
        step0, step1 = await planned(worker)
        assert step0.rids == step1.rids == ("a",)
        assert step1.token_ids == (FEED_LAST_SAMPLE,)

    drive(0.0, body)
