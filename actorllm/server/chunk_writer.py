"""A streamed response's body chunks written straight to hypercorn's connection.

Sent the ASGI way, each SSE chunk passes the ``send`` wrappers of five middleware
layers (Starlette's, FastAPI's and the edge's), hypercorn's ``HTTPStream.app_send`` and
``H11Protocol.stream_send``, and h11, which frames it as an HTTP/1.1 chunk, before the
one ``write``. Once the status line is out, none of them does anything to a body chunk
but pass it on (the wrappers only note the start message), yet together they cost the
loop about half as much as the ``write`` itself (py-spy, embedded model, 64 streams:
docs/architecture.md, "Writing's share of the loop").

:func:`direct_writer` gives a response that has sent its headers a writer that frames
the chunk as h11's ``ChunkedWriter`` would (``<hex length>\\r\\n<data>\\r\\n``) and hands
it to the connection's own send (``TCPServer.protocol_send``, with the write timeout of
``timeouts.py``). It checks, once, that everything below is what it knows: hypercorn's
HTTP/1.1 stream and protocol, an h11 connection in ``SEND_BODY`` with a chunked writer,
a method that has a body. Anything else (another server, HTTP/2, a ``Content-Length``
response, a hypercorn that moved things) gets None, and the response sends the ASGI
way. The last chunk always goes the ASGI way: ending the message is h11's business (its
state moves to ``DONE`` and hypercorn recycles the connection).

The server's own send is found in the scope (:data:`SCOPE_KEY`), put there by the
outermost app (:class:`KeepServerSend`, around the whole middleware stack).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)

SCOPE_KEY = "actorllm.server_send"

ChunkWriter = Callable[[bytes], Awaitable[None]]


class KeepServerSend:
    """The outermost ASGI app: keeps the server's ``send`` in the scope (:data:`SCOPE_KEY`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SCOPE_KEY] = send
        await self.app(scope, receive, send)


def _hypercorn_types() -> tuple[Any, ...] | None:
    try:
        import h11
        from h11._writers import ChunkedWriter
        from hypercorn.events import RawData
        from hypercorn.protocol.h11 import H11Protocol
        from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
        from hypercorn.utils import suppress_body
    except ImportError:
        return None
    return h11, ChunkedWriter, RawData, H11Protocol, ASGIHTTPState, HTTPStream, suppress_body


_TYPES = _hypercorn_types()


def direct_writer(scope: Scope) -> ChunkWriter | None:
    """A writer of body chunks straight to the connection, for a response whose status
    line and headers are out; None where the stack below is not the one it knows."""
    send = scope.get(SCOPE_KEY)
    if _TYPES is None or send is None:
        return None
    h11, chunked_writer, raw_data, h11_protocol, asgi_state, http_stream, suppress_body = _TYPES
    stream = getattr(send, "__self__", None)
    protocol = getattr(getattr(stream, "send", None), "__self__", None)
    if not (isinstance(stream, http_stream) and isinstance(protocol, h11_protocol)):
        return None
    conn = getattr(protocol, "connection", None)
    if (type(conn) is not h11.Connection or conn.our_state is not h11.SEND_BODY
            or type(getattr(conn, "_writer", None)) is not chunked_writer
            or getattr(stream, "state", None) is not asgi_state.RESPONSE
            or suppress_body(stream.scope["method"], int(stream.response["status"]))):
        return None
    protocol_send = protocol.send

    async def write(data: bytes) -> None:
        if not data:  # an empty chunk would end the body
            return
        if stream.closed:  # the client went: the ASGI way, exactly as before
            await send({"type": "http.response.body", "body": data, "more_body": True})
            return
        await protocol_send(raw_data(data=b"%x\r\n%b\r\n" % (len(data), data)))

    return write
