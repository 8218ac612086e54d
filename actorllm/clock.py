"""The clock of flow control, shared by the Frontend's pacing and the metrics that read it."""

from __future__ import annotations

import time

import trio


def now() -> float:
    """The clock of flow control: trio's inside a run (the simulation's is a mock clock),
    else monotonic."""
    try:
        return trio.current_time()
    except RuntimeError:
        return time.monotonic()
