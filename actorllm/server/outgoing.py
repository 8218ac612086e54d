"""One generation response's sends to its client (:class:`Outgoing`).

Each send is timed (``actorllm:socket_blocked_seconds``) and checked against the
connection's :class:`~actorllm.server.timeouts.WriteWatch`: once ``server/timeouts.py``
has cut the connection (the client took nothing for ``--stream-timeout``, or the drain
ran out), the send raises :class:`ClientGone`, after telling the response of a stall.

Once the headers are out, a streamed body's chunks go straight to the connection where
``chunk_writer.direct_writer`` can (past the middleware's sends, hypercorn's stream and
h11), with the same timing, checks and errors as an ASGI send.

The last send of a response is shielded from the response's own cancel scope: within it
hypercorn ends the request cycle (``_maybe_recycle``): it wakes the response's
disconnect watcher, then arms the keep-alive timer, or closes an HTTP/1.0 connection. A
cancel there would skip both and leave the connection open for ever (issue 33). The
write itself keeps its guard, so a shielded send still ends.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from starlette.types import Scope, Send

from actorllm.server import chunk_writer, timeouts
from actorllm.server.errors import APIError
from actorllm.server.job import ClientGone
from actorllm.server.state import ServerState


class Outgoing:
    """The ASGI sends of one response; ``send``, ``scope`` and ``watch`` are set when it
    is called."""

    def __init__(self, state: ServerState, extra_headers: list[tuple[bytes, bytes]], *,
                 on_stalled: Callable[[], None]) -> None:
        self.state, self.extra_headers, self.on_stalled = state, extra_headers, on_stalled
        self.send: Send | None = None
        self.scope: Scope = {}
        self.watch = timeouts.WriteWatch()
        # Writes a body chunk past the ASGI layers, once the headers are out (or None).
        self.direct: chunk_writer.ChunkWriter | None = None

    async def raw(self, message: dict[str, Any]) -> None:
        """One ASGI message; raises ClientGone once the client is gone or was cut."""
        assert self.send is not None
        await self._checked(self.send(message))

    async def _checked(self, sending: Awaitable[None]) -> None:
        start = time.monotonic()
        try:
            await sending
        except OSError as exc:
            raise ClientGone() from exc
        finally:
            waited = time.monotonic() - start
            self.state.engine.metrics.socket_blocked_seconds.inc(waited)
        self.state.engine.metrics.phase["http_write"].inc(waited)
        if self.watch.cut is not None:
            if self.watch.cut == timeouts.STALLED:
                self.on_stalled()
            raise ClientGone()

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The status line and headers (ours, plus the response's own)."""
        await self.raw({"type": "http.response.start", "status": status,
                        "headers": headers + self.extra_headers})
        self.direct = chunk_writer.direct_writer(self.scope)

    async def body(self, data: bytes, more: bool = True) -> None:
        """A piece of the body; ``more=False``: the last one, shielded (module docstring)."""
        if more and self.direct is not None:
            await self._checked(self.direct(data))
            return
        message = {"type": "http.response.body", "body": data, "more_body": more}
        if more:
            await self.raw(message)
            return
        with trio.CancelScope(shield=True):
            await self.raw(message)

    async def error(self, err: APIError) -> None:
        """A whole error response (its last send ends the cycle: shielded, as ``body``)."""
        assert self.send is not None
        with trio.CancelScope(shield=True):
            await err.send(self.send, self.extra_headers)
