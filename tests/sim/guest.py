"""Running trio under a synchronous test driver (see tests/sim/harness.py)."""


from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable

import outcome
import trio
import trio.testing

# --- running trio under a synchronous driver --------------------------------------------------


def _leaf(exc: BaseException) -> BaseException:
    """The one real error inside nested single-member exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class GuestLoop:
    """A trio run in guest mode, stepped by hand (see the module docstring)."""

    MAX_TICKS = 100_000  # a settle that needs more is a livelock, not a slow test

    def __init__(self, main: Callable[[], Awaitable[None]]) -> None:
        self._queue: deque[Callable[[], object]] = deque()
        self.result: outcome.Outcome[None] | None = None
        self.clock = trio.testing.MockClock(autojump_threshold=0)
        trio.lowlevel.start_guest_run(
            main,
            run_sync_soon_threadsafe=self._queue.append,
            done_callback=self._done,
            clock=self.clock,
        )

    def _done(self, result: outcome.Outcome[None]) -> None:
        self.result = result

    def run_until(self, predicate: Callable[[], bool]) -> None:
        """Run trio's callbacks until ``predicate()``; re-raise if the run died."""
        for _ in range(self.MAX_TICKS):
            if predicate():
                return
            if self.result is not None:
                self._raise()
            self._queue.popleft()()
        raise RuntimeError("the simulation did not settle (livelock?)")

    def _raise(self) -> None:
        assert self.result is not None
        try:
            self.result.unwrap()
        except BaseException as exc:
            raise _leaf(exc) from None
        raise RuntimeError("the trio run ended while the simulation was still using it")

    def finish(self) -> None:
        """Run to the end (the caller has cancelled everything); re-raise a failure."""
        self.run_until(lambda: self.result is not None)
        try:
            self.result.unwrap()  # type: ignore[union-attr]
        except BaseException as exc:
            raise _leaf(exc) from None
