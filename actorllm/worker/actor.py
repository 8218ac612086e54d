"""The Worker actor: StepPlan in from its inbox, StepResult out, one step at a time.

It owns a :class:`~actorllm.worker.runner.ModelRunner` (weights, KV cache, sampling
state) and runs its steps in a thread so the event loop it shares with other actors
keeps turning (DESIGN.md section 2).
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable

import attrs
import trio

from actorllm.wire.mailbox import Inbox, Outbox
from actorllm.wire.messages import StepPlan, StepResult
from actorllm.worker.ranks import RankDied
from actorllm.worker.runner import ModelRunner

# How long the loop waits, at most, for an idle step thread to take the plan it was just
# given (Worker._feed): the GIL hand-off. Longer only when the OS is slow to wake the
# thread; then the loop goes on and the thread waits for the GIL as before.
HANDOFF_S = 0.002


class Worker:
    """The Worker actor: runs each StepPlan from its inbox and sends the StepResult on."""

    def __init__(
        self, runner: ModelRunner, inbox: Inbox[StepPlan], results: Outbox[StepResult],
        warmup: Callable[[], object] | None = None,
    ) -> None:
        """``warmup``: run once in the step thread before its first plan (the thread whose
        heap arena and OpenMP team the steps use: topology/warmup.py)."""
        self.runner = runner
        self.warmup = warmup
        self.inbox = inbox
        self.results = results
        # True while the step thread waits for a plan, from when it hands its result to
        # the loop (see _steps). The Worker's own: written by its thread, read by its feed
        # task for the hand-over (_feed); a bool, so no lock. Other actors hear of the
        # wait by message (StepResult.plan_wait_s).
        self._thread_idle = False
        # Set by the step thread when it takes a plan (see _feed).
        self._plan_taken = threading.Event()
        # Set once the step thread waits for its first plan (after any warm-up), or the
        # actor has stopped: open_engine waits for it before it takes requests.
        self.ready = trio.Event()

    async def run(self) -> None:
        """Serve plans until the inbox closes, in a thread of their own that runs them back
        to back: with two steps in flight the next starts the moment one ends, not when
        this event loop, busy with other actors, turns. Results return in order
        (``run_sync_soon`` keeps its callbacks' order) and leave from here."""
        try:
            await self._run()
        finally:
            self.ready.set()  # a Worker that stopped or failed keeps no one waiting

    async def _run(self) -> None:
        # A runner may outlive an engine (LLM reuses it): forget an earlier one's rids.
        self.runner.drop_all()
        ranks = self.runner.ranks
        plans: queue.SimpleQueue[StepPlan | None] = queue.SimpleQueue()
        done, results = trio.open_memory_channel[StepResult](math.inf)  # <= steps in flight
        try:
            async with trio.open_nursery() as nursery:
                if ranks is not None:  # a rank's death kills this actor, hence the engine
                    nursery.start_soon(ranks.watch)
                nursery.start_soon(self._feed, plans)
                nursery.start_soon(self._steps, plans, done)
                async for result in results:
                    if ranks is not None:
                        await ranks.check()  # a step that broke the group is fatal
                    await self.results.send(result)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # watch() and the step may both see one death at once: report it, not a group.
            died = group.subgroup(RankDied)
            if died is None:
                raise
            first: BaseException = died
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from group

    async def _feed(self, plans: queue.SimpleQueue[StepPlan | None]) -> None:
        """Pass each plan to the step thread. One given to a thread that waits for it is
        handed over with the GIL: the loop blocks (GIL released) until the thread has it,
        at most HANDOFF_S. Why: the thread needs the GIL to pack the plan before its
        forward pass lets go of it, and a loop that went straight on to the Detokenizer's
        and Frontend's work for the step before held it all that while (CPython passes
        the GIL to a waiting thread only when its holder blocks, or after the 5 ms switch
        interval), so that work ran between the plan and the forward pass instead of
        during it (issue 28)."""
        try:
            async for plan in self.inbox:
                idle = self._thread_idle
                self._plan_taken.clear()
                plans.put(plan)
                if idle:
                    self._plan_taken.wait(HANDOFF_S)
        except BaseException:  # cancelled or failed: the thread stops after its step
            with contextlib.suppress(queue.Empty):
                while True:
                    plans.get_nowait()
            raise
        finally:
            plans.put(None)

    async def _steps(self, plans: queue.SimpleQueue[StepPlan | None],
                     done: trio.MemorySendChannel[StepResult]) -> None:
        token = trio.lowlevel.current_trio_token()
        ranks = self.runner.ranks

        def next_plan() -> tuple[StepPlan | None, float]:
            waited = 0.0
            try:
                plan = plans.get_nowait()
            except queue.Empty:
                t0 = time.perf_counter()
                self._thread_idle = True
                plan = plans.get()
                waited = time.perf_counter() - t0
            if self._thread_idle:
                self._thread_idle = False
                self._plan_taken.set()
            return plan, waited

        def loop() -> None:
            if self.warmup is not None:
                self.warmup()
            token.run_sync_soon(self.ready.set)
            while True:
                plan, waited = next_plan()
                if plan is None:
                    return
                result = self.runner.execute(plan)
                if waited:  # said in the result, not shared: the pacing hears it by message
                    result = attrs.evolve(result, plan_wait_s=waited)
                # Counted as waiting from here on: the result's wake-up gives the loop the
                # GIL, and the loop keeps it while it commits and plans, so this thread
                # gets no further than run_sync_soon before the next plan exists. A feed
                # that did not count it as waiting went on to the Detokenizer and
                # Frontend while the thread stood there (see _feed).
                self._thread_idle = True
                token.run_sync_soon(done.send_nowait, result)
                if ranks is not None and ranks.broken is not None:
                    return  # the ranks are out of step: no further step may run

        with done:
            await trio.to_thread.run_sync(loop)

    def drain_problems(self) -> list[str]:
        """Rids whose sampling state is still held (empty after a drain: invariant 4)."""
        n = self.runner.num_states
        return [f"worker holds sampling state for {n} rids"] if n else []
