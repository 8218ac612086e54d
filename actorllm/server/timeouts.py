"""A write timeout for hypercorn (``--stream-timeout`` at the socket).

hypercorn's trio server writes each response chunk with ``send_all`` inside a shielded
cancel scope and no deadline (``TCPServer.protocol_send``): a client that stops reading
holds the writing task, and with it the connection, for ever; cancelling the app's send
cannot help, the shield is below it. ``install`` replaces that one method with one that
gives the write a deadline (``set_write_timeout`` on the hypercorn config) and, when it
passes, closes the connection, as a broken pipe would. The app sees its send return after
the timeout and the client disconnected (``server/generation.py`` tells the two apart by
the time the send took). Like ``protocol_errors``, it patches a method of a third-party
class, replaced through ``hypercorn_patch.replace_method``, and
``tests/test_slow_clients.py`` fails if an upgrade breaks it.

The same method first tries the write without awaiting (``_write_now``): an SSE event
the socket takes at once (nearly always) then costs one ``write`` call instead of a
lock, a cancel scope and two scheduler round trips. Only what the socket does not take
waits, with the deadline (``tests/test_server_writes.py``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import trio

from actorllm.server.hypercorn_patch import replace_method

log = logging.getLogger(__name__)

_ATTR = "actorllm_write_timeout"


def set_write_timeout(config: Any, seconds: float | None) -> None:
    """Give writes of servers run with this hypercorn ``config`` a deadline (None: none)."""
    setattr(config, _ATTR, seconds)


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
            if timeout is None or not isinstance(event, RawData):
                await original(self, event)
                return
            async with self.send_lock:
                try:
                    # Shielded as hypercorn does (a cancelled app must not cut a chunk in two),
                    # but with a deadline of its own.
                    with trio.CancelScope(shield=True) as scope:
                        scope.deadline = trio.current_time() + timeout
                        await self.stream.send_all(event.data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.protocol.handle(Closed())
                    return
                if not scope.cancelled_caught:
                    return
                log.info("a client took nothing for %.1f s (--stream-timeout): closing", timeout)
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
