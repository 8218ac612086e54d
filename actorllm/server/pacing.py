"""How often streamed responses write: a bounded share of the loop (:class:`WritePacer`).

In the ``single`` topology one trio loop runs the HTTP streams and the engine's actors
(Scheduler, Detokenizer, Frontend), and the Worker's thread waits for the Scheduler's
next plan. Left alone, every step wakes every stream: each takes one token, renders one
chunk and makes one write, and the next step is planned only after all of them have had
their turn. At 128 streams and more that turn is most of the step, so the engine ran at
the speed of one write per stream per token (a py-spy profile: the loop busy, the
Worker's thread waiting for plans ~70 % of the time). In ``engine`` the Scheduler runs in
another process, gets ahead on its own, and each write carries the tokens of several
steps (9 on average at saturation).

The pacer gives ``single`` the same shape. Every streamed response charges the time it
spends taking, rendering and writing (:meth:`WritePacer.charge`); before it waits for
its next output it asks for its turn (:meth:`WritePacer.turn`). Charges run up a debt
that time spent on anything else pays back second for second; while the loop owes,
readers wait for it to be paid, then all go together, each taking everything its
collector merged meanwhile. So writing gets at most about 1/:data:`PACE` of a busy
loop's time, and the rest goes to the engine's steps. A lightly loaded server owes
little: a reader is held only when its output comes before the debt of the last writes
is paid, that is when writing is a large part of a step.

A hold pays only where the engine waits for this loop, so a reader that owes is held
only then (``engine_waits``, :func:`actorllm.topology.placement.waits_for_loop`): while
the Worker waited for the plan of its latest step (it says so in its ``StepResult``, and
the Scheduler passes it on in the stats that reach the Frontend with every step's
outputs: a message, so it holds alike in ``single`` and in ``engine``'s parent, whose
Worker is in the child), or requests or a step's outputs wait in this process's
Tokenizer, Detokenizer or Frontend inbox. Where the loop keeps up with the steps (a
model whose forward is most of a step) every step writes, and the stream's gaps stay one
step long.

Only the time between writes changes, never what is written: the chunks of a stream
merge exactly as they do for a slow client (``Merged.add``). The wait is cancellable by
the drain cut like any wait for output, and is bounded by ``--max-stream-hold``
(:data:`MAX_HOLD` by default; 0 turns pacing off).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

# A second spent writing is owed back as this many seconds of the loop's time, that one
# included: writing gets at most 1/PACE of the loop while it is busy. 8 measured best on
# the near-zero-compute model at 256 streams (2 at most doubled a write's tokens; 8 gave
# 3-7 tokens a write and 2-3x fewer microseconds of loop per token; docs/architecture.md).
PACE = 8.0
# The longest a reader is held for its turn (seconds): bounds the extra inter-token
# latency the pacing can add, whatever one turn cost.
MAX_HOLD = 0.1
# The most one charge counts (seconds). A reader's take, render and write cost ~0.1 ms; one
# that took longer waited for a full socket (a slow client) while the loop ran others,
# and that wait is not the loop's time.
MAX_CHARGE = 0.002
# How long an answer of ``engine_waits`` stands (seconds). The readers of one wake-up ask
# one after the other, and each asking read three inboxes' statistics (~7 % of the loop's
# Python time at 64 streams, py-spy); the signal itself comes a step late, with the
# step's outputs, so an answer a millisecond old is as good.
WAITS_FRESH = 0.001


class WritePacer:
    """The loop's debt of writing time, shared by the server's streamed responses."""

    def __init__(self, max_hold: float = MAX_HOLD,
                 engine_waits: Callable[[], bool] | None = None) -> None:
        """``engine_waits``: whether the engine waits for this loop now (None: always
        assumed, the pacing by the debt alone)."""
        # The longest a reader is held (``--max-stream-hold``); 0: never, every step writes.
        self.max_hold = max_hold
        self.engine_waits = engine_waits
        # When the debt is paid (trio time): writing since then is within its share.
        self.paid_at = 0.0
        # When the readers held now are let go together (trio time).
        self._release_at = 0.0
        self.held = 0  # readers made to wait for a turn, in all (a count, for tests)
        self._waits = False  # engine_waits' last answer, standing until _waits_until
        self._waits_until = -1.0

    def charge(self, seconds: float) -> None:
        """A reader spent the last ``seconds`` taking, rendering and writing: the loop owes
        ``PACE - 1`` times as much to everything else. Time spent writing pays nothing
        back, so the readers of one wake-up, one after the other, owe the sum of what they
        spent."""
        t, seconds = trio.current_time(), min(seconds, MAX_CHARGE)
        self.paid_at = min(max(self.paid_at, t - seconds) + PACE * seconds, t + self.max_hold)

    async def turn(self) -> None:
        """Return once the loop owes no writing time (at once when it owes none, or when
        the engine is not waiting for the loop: holding the write would win it nothing).

        The readers held meanwhile all sleep until the same instant, the debt as the first
        of them found it, so trio wakes them in one batch and their writes go together."""
        now = trio.current_time()
        if now >= self.paid_at:
            return
        if now >= self._release_at and self.engine_waits is not None and (
                not self._engine_waits(now)):
            return  # (a reader joining a batch already held goes with it)
        if now >= self._release_at:  # the first reader held since the last release
            self._release_at = self.paid_at
        self.held += 1
        await trio.sleep_until(self._release_at)

    def _engine_waits(self, now: float) -> bool:
        """``engine_waits()``, asked at most once per :data:`WAITS_FRESH`."""
        assert self.engine_waits is not None
        if now >= self._waits_until:
            self._waits, self._waits_until = self.engine_waits(), now + WAITS_FRESH
        return self._waits
