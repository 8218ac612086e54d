"""Accepting a burst of connections in one turn of the event loop.

trio's ``SocketListener.accept`` takes one connection and then yields (it is a schedule
point), and ``trio.serve_listeners``, hypercorn's accept loop, calls it once per
connection. The loop it yields to is the engine's too: at saturation every turn renders
and writes the streams already running, so when 256 clients connected at once the last
was accepted seconds after the first, and that wait was most of its time to first token
(issue 28; docs/architecture.md, "Wake-ups per burst"). ``install`` replaces the method
with one that, after its ordinary accept (which waits, and yields, as before), takes every
connection the kernel has already queued without yielding, and hands them out on the
next calls before it accepts again; closing the listener closes those not yet handed
out, so a server that stops between the two leaves no descriptor open. Like
``timeouts``, it replaces methods of a third-party class through
``hypercorn_patch.replace_method``; ``tests/test_saturation.py`` fails if an upgrade
breaks it.
"""

from __future__ import annotations

import socket
import weakref
from collections import deque
from typing import Any

import trio

from actorllm.server.hypercorn_patch import replace_method

# The most connections taken from the kernel's queue in one turn.
BURST = 256

# Connections accepted ahead, per listener, in the order the kernel queued them.
_ready: weakref.WeakKeyDictionary[Any, deque[trio.SocketStream]] = weakref.WeakKeyDictionary()


def install() -> bool:
    """Make ``trio.SocketListener.accept`` take a burst per turn; False if it cannot."""

    def make(original: Any) -> Any:
        async def accept(self: Any) -> trio.SocketStream:
            ready = _ready.get(self)
            if ready:
                return ready.popleft()
            stream = await original(self)
            more = queued(self.socket)
            if more:
                _ready.setdefault(self, deque()).extend(more)
            return stream

        return accept

    def make_close(original: Any) -> Any:
        async def aclose(self: Any) -> None:
            ready = _ready.pop(self, None)
            try:
                while ready:
                    await trio.aclose_forcefully(ready.popleft())
            finally:
                await original(self)

        return aclose

    return replace_method(trio.SocketListener, "accept", make,
                          without="accepting a burst of connections in one turn") and \
        replace_method(trio.SocketListener, "aclose", make_close,
                       without="closing connections accepted ahead")


def queued(listening: Any, limit: int = BURST) -> list[trio.SocketStream]:
    """The connections waiting in ``listening``'s queue, taken without waiting. The
    listener's descriptor is borrowed for the calls (and given back, not closed); an error
    stops the burst and is left for the next ordinary accept to meet and report."""
    fd = listening.fileno()
    if fd < 0:
        return []
    raw = socket.socket(fileno=fd)
    out: list[trio.SocketStream] = []
    try:
        raw.setblocking(False)
        while len(out) < limit:
            try:
                conn, _ = raw.accept()
            except OSError:  # BlockingIOError: none left
                break
            out.append(trio.SocketStream(trio.socket.from_stdlib_socket(conn)))
    finally:
        raw.detach()
    return out
