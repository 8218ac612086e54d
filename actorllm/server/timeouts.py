"""A write timeout for hypercorn (``--stream-timeout`` at the socket).

hypercorn's trio server writes each response chunk with ``send_all`` inside a shielded
cancel scope and no deadline (``TCPServer.protocol_send``): a client that stops reading
holds the writing task, and with it the connection, for ever; cancelling the app's send
cannot help, the shield is below it. ``install`` replaces that one method with one whose
waiting write is watched by a guard (``_guard``): when the client has taken nothing for
the timeout (``set_write_timeout`` on the hypercorn config), it cuts the write and closes
the connection, as a broken pipe would. Like ``protocol_errors``, it patches a method of a
third-party class, replaced through ``hypercorn_patch.replace_method``, and
``tests/test_slow_clients.py`` fails if an upgrade breaks it.

"Taken nothing" is measured at the socket, not by how long one write waited: a slow but
steady reader behind a large kernel send buffer can keep one write waiting far longer than
the timeout (Linux wakes a writer only once a third of the buffer is free), and it must
not be cut. The guard watches the bytes the client acknowledged (``TCP_INFO``'s
``tcpi_bytes_acked``, Linux); any increase restarts its clock and is reported to the
response through its :class:`WriteWatch`, which also tells the response that its
connection was cut and why (``server/generation.py``). Where ``TCP_INFO`` is missing the
clock runs from the start of the write, as before.

Shutdown bounds every write too: once the config's cut event is set (``set_write_timeout``'s
``cut``, at the end of ``--drain-timeout``), a write that waits is cut at once, so that
stalled readers cannot hold the process past the drain (issue 33).

The same method first tries the write without awaiting (``_write_now``): an SSE event
the socket takes at once (nearly always) then costs one ``write`` call instead of a
lock, a cancel scope and two scheduler round trips. Only what the socket does not take
waits, with the guard (``tests/test_server_writes.py``).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

from actorllm.server.hypercorn_patch import replace_method

log = logging.getLogger(__name__)

_ATTR = "actorllm_write_timeout"
_CUT_ATTR = "actorllm_write_cut"
_PEER_ATTR = "_actorllm_peer"
# How often a waiting write's guard looks at the socket (at most; less for small timeouts).
_POLL = 0.5
# struct tcp_info (linux/tcp.h): the u64 tcpi_bytes_acked sits at this offset (the
# struct only ever grows at its end).
_BYTES_ACKED_AT = 120

STALLED = "stream_timeout"
SHUTDOWN = "shutting_down"


class WriteWatch:
    """What one response hears from its connection's waiting writes.

    ``on_progress``: called when the client took bytes while a write waited (the response
    counts it as reading). ``cut``: why the connection was cut (``STALLED`` or
    ``SHUTDOWN``), or None.
    """

    def __init__(self, on_progress: Callable[[], None] | None = None) -> None:
        self.on_progress = on_progress
        self.cut: str | None = None


# The live responses' watches, by client address (the scope's "client", the socket's
# peer): one connection answers one request at a time.
_watches: dict[Any, WriteWatch] = {}


@contextmanager
def watch_writes(client: Any, on_progress: Callable[[], None] | None = None,
                 ) -> Iterator[WriteWatch]:
    """A :class:`WriteWatch` for the connection of ``client`` (an ASGI scope's
    ``client``), for the ``with`` block; a dummy when the client is unknown."""
    watch = WriteWatch(on_progress)
    key = tuple(client) if client else None
    if key is None:
        yield watch
        return
    # The newest response on a connection is the one writing (a finished one may still
    # be cleaning up while the next request on the connection starts).
    _watches[key] = watch
    try:
        yield watch
    finally:
        if _watches.get(key) is watch:
            del _watches[key]


def set_write_timeout(config: Any, seconds: float | None, cut: trio.Event | None = None,
                      ) -> None:
    """Cut writes of servers run with this hypercorn ``config`` once the client has taken
    nothing for ``seconds`` (None: never), or at once after ``cut`` is set."""
    setattr(config, _ATTR, seconds)
    setattr(config, _CUT_ATTR, cut)


def _bytes_acked(sock: socket.socket) -> int | None:
    """How many bytes the peer has acknowledged; None where the OS does not say."""
    opt = getattr(socket, "TCP_INFO", None)
    if opt is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, opt, 256)
    except OSError:
        return None
    if len(info) < _BYTES_ACKED_AT + 8:
        return None
    return int(struct.unpack_from("=Q", info, _BYTES_ACKED_AT)[0])


def _peer(server: Any) -> Any:
    """The client address of a hypercorn ``TCPServer``, as its requests' scopes give it."""
    peer = getattr(server, _PEER_ATTR, None)
    if peer is None:
        from hypercorn.utils import parse_socket_addr

        try:
            sock = server.stream.socket
            peer = parse_socket_addr(sock.family, sock.getpeername())
        except (AttributeError, OSError):
            peer = ()
        setattr(server, _PEER_ATTR, peer)
    return peer


async def _guard(server: Any, timeout: float | None, cut: trio.Event | None,
                 scope: trio.CancelScope) -> str:
    """Cancel ``scope`` (the waiting write) once the client has acknowledged nothing for
    ``timeout`` s, or once ``cut`` is set; returns why. Runs until cancelled otherwise."""
    sock = getattr(server.stream, "socket", None)
    acked = None if sock is None else _bytes_acked(sock)
    quiet_since = trio.current_time()
    step = _POLL if timeout is None else min(_POLL, timeout / 4)
    why = SHUTDOWN
    while cut is None or not cut.is_set():
        # Wake at the next look, or exactly when the timeout would run out.
        wake = trio.current_time() + step
        if timeout is not None:
            wake = min(wake, quiet_since + timeout)
        with trio.move_on_at(wake):
            if cut is not None:
                await cut.wait()
            else:
                await trio.sleep_forever()
        if cut is not None and cut.is_set():
            break
        now = trio.current_time()
        seen = None if sock is None else _bytes_acked(sock)
        if seen is not None and seen != acked:
            acked, quiet_since = seen, now
            watch = _watches.get(_peer(server))
            if watch is not None and watch.on_progress is not None:
                watch.on_progress()
        elif timeout is not None and now - quiet_since >= timeout:
            why = STALLED
            break
    watch = _watches.get(_peer(server))
    if watch is not None:
        watch.cut = why
    scope.cancel()
    return why


def install() -> bool:
    """Make hypercorn's trio writes honour ``set_write_timeout``; False if it cannot."""
    try:
        from hypercorn.events import Closed, RawData
        from hypercorn.trio.tcp_server import TCPServer
    except ImportError:  # pragma: no cover - hypercorn is a dependency
        return False

    def make(original: Any) -> Any:
        async def protocol_send(self: Any, event: Any) -> None:
            if isinstance(event, RawData) and not self.send_lock.locked():
                sent = _write_now(self.stream, event.data)
                if sent == len(event.data):
                    return
                if sent:
                    event = RawData(data=event.data[sent:])
            timeout = getattr(self.config, _ATTR, None)
            cut = getattr(self.config, _CUT_ATTR, None)
            if (timeout is None and cut is None) or not isinstance(event, RawData):
                await original(self, event)
                return
            async with self.send_lock:
                try:
                    # Shielded as hypercorn does (a cancelled app must not cut a chunk in two);
                    # only the guard cancels it, and then the connection is closed.
                    with trio.CancelScope(shield=True) as scope:
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(_guard, self, timeout, cut, scope)
                            await self.stream.send_all(event.data)
                            nursery.cancel_scope.cancel()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.protocol.handle(Closed())
                    return
                if not scope.cancelled_caught:
                    return
                if cut is not None and cut.is_set():
                    log.info("shutting down: closing a connection whose client is not reading")
                else:
                    log.info("a client took nothing for %.1f s (--stream-timeout): closing",
                             timeout)
                with trio.CancelScope(shield=True):
                    try:
                        await self.stream.aclose()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    await self.protocol.handle(Closed())

        return protocol_send

    return replace_method(TCPServer, "protocol_send", make, without="no write timeout")


def _write_now(stream: Any, data: bytes) -> int:
    """Write what the socket takes at once, without a trip through trio's scheduler.

    A streamed token is a few hundred bytes and the socket's buffer almost always has
    room: then ``send_all``'s lock, shielded scope and two checkpoints cost more than the
    write itself. Only a plain TCP stream whose lock is free comes here (the caller
    checks the lock; nothing can write between that check and this synchronous call);
    what the socket does not take, and any error, is left to the awaited path, which
    waits with the deadline and reports a broken connection as hypercorn does.
    """
    if _POSIX and isinstance(stream, trio.SocketStream):
        fd = stream.socket.fileno()
        if fd >= 0:
            try:
                return os.write(fd, data)
            except OSError:
                return 0
    return 0


_POSIX = os.name == "posix"
