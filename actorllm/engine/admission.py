"""Admission control: whether new work is taken, and how much is held. One object.

The engine owns it (``AsyncEngine.admission``); the HTTP server reserves sequences on it
for each request and releases them when the request is done. Its life is a small state
machine of its own::

    OPEN --drain()--> DRAINING --stop()--> STOPPED
      \\________________________\\--kill(reason)--> DEAD

``DRAINING`` refuses new work while what is held finishes; ``DEAD`` (a process of the
engine died) refuses everything with the reason. Nothing here waits: the callers decide
how long to drain.

What is held is engine work: the server releases a request's sequences when the engine is
done with them, not when its client has read them, so clients that stop reading cannot
keep ``capacity`` full. What they have not read counts instead against the byte mark
(``max_pending_bytes``, read from the Frontend through ``pending_bytes``): over it, new
work is refused as overloaded until readers catch up or time out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import trio

from actorllm.wire.messages import RefusalCode


class Gate(enum.Enum):
    OPEN = "open"
    DRAINING = "draining"
    STOPPED = "stopped"
    DEAD = "dead"


class Refused(Exception):
    """New work is not taken now; ``code`` says why (the server maps it to an API error)."""

    def __init__(self, code: RefusalCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Admission:
    """The gate and the count of engine sequences held by callers (``capacity`` caps it)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity  # None: no cap (the Python API); the server sets one
        self.held = 0
        self.gate = Gate.OPEN
        self.reason: str | None = None  # why DEAD or STOPPED
        self.died = trio.Event()  # set by kill(): what a server restarts for
        # Output waiting for readers, in bytes, and the most new work may find waiting.
        self.pending_bytes: Callable[[], int] = lambda: 0
        self.max_pending_bytes: int | None = None

    @property
    def open(self) -> bool:
        return self.gate is Gate.OPEN

    @property
    def draining(self) -> bool:
        return self.gate is Gate.DRAINING

    def refusal(self) -> Refused | None:
        """Why new work is refused now, or None while open."""
        if self.gate is Gate.DEAD:
            return Refused(RefusalCode.ENGINE_DEAD, self.reason or "the engine is dead")
        if self.gate is not Gate.OPEN:
            return Refused(RefusalCode.SHUTTING_DOWN, self.reason or "the engine is shutting down")
        return None

    def reserve(self, cost: int) -> None:
        """Hold ``cost`` sequences; raises :class:`Refused` when closed or full."""
        refused = self.refusal()
        if refused is not None:
            raise refused
        if self.capacity is not None:
            if cost > self.capacity:
                raise Refused(RefusalCode.TOO_LARGE, f"the request needs {cost} sequences "
                              f"(prompts x n), more than the server's limit of {self.capacity}")
            if self.held + cost > self.capacity:
                raise Refused(RefusalCode.OVERLOADED, f"the server is overloaded ({self.held} "
                              "sequences pending); retry later")
            waiting = self.pending_bytes()
            if self.max_pending_bytes is not None and waiting > self.max_pending_bytes:
                raise Refused(RefusalCode.OVERLOADED, f"the server is overloaded ({waiting} "
                              "bytes of output wait for slow clients); retry later")
        self.held += cost

    def release(self, cost: int) -> None:
        """Give back what :meth:`reserve` held."""
        if not 0 <= cost <= self.held:
            raise ValueError(f"releasing {cost} of {self.held} held sequences")
        self.held -= cost

    def drain(self) -> None:
        """Refuse new work; what is held may finish."""
        if self.gate is Gate.OPEN:
            self.gate = Gate.DRAINING

    def stop(self, reason: str = "the engine has shut down") -> None:
        """An orderly end: refuse everything from now on."""
        if self.gate in (Gate.OPEN, Gate.DRAINING):
            self.gate, self.reason = Gate.STOPPED, reason

    def kill(self, reason: str) -> bool:
        """The engine died; False if it had already died or stopped (nothing changes)."""
        if self.gate in (Gate.DEAD, Gate.STOPPED):
            return False
        self.gate, self.reason = Gate.DEAD, reason
        self.died.set()
        return True
