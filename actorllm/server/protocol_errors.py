"""OpenAI error bodies for the errors hypercorn answers itself, before any ASGI call.

A malformed request line, a bad ``Content-Length`` or headers over hypercorn's limit
(431) never reach the app: h11 refuses the bytes and hypercorn answers with an empty
body. The ASGI layer cannot change that, so this module replaces that one method of
hypercorn's HTTP/1.1 protocol (``H11Protocol._send_error_response``) with one that
sends the same status and headers plus OpenAI's body. It is a private method of a
third-party class: ``install`` checks that it and the method it relies on exist, and
leaves hypercorn alone (logging why) if they do not;
``tests/test_server.py::test_protocol_errors_have_openai_bodies`` fails if a hypercorn
upgrade makes it stop working.

HTTP/2 is not served. Its flow-control window would let a client hold a stream's output
without the socket ever filling, past every slow-client protection (the write timeout,
the pause on unread bytes), and rapid reset would make stream churn cheap for the
client and dear for the server. hypercorn serves HTTP/2 over cleartext two ways, both
turned off here (``_refuse_http2``): an ``Upgrade: h2c`` header is ignored (the request
is answered in HTTP/1.1, as RFC 9110 allows), and a prior-knowledge preface
(``PRI * HTTP/2.0``) gets an HTTP/1.1 400 and the connection is closed, before any
HTTP/2 frame is read. There is no TLS, so ALPN never offers h2 either (the config also
lists only ``http/1.1``). ``tests/test_http_defects.py`` sends both.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from actorllm.server.errors import APIError
from actorllm.server.hypercorn_patch import replace_method

_MESSAGES = {
    400: "malformed HTTP request",
    413: "the request is too large",
    431: "the request headers are too large",
}
HTTP2_REFUSED = "HTTP/2 is not served: use HTTP/1.1"


def error_body(status: int, message: str | None = None) -> bytes:
    """The body for a protocol-level refusal with ``status``."""
    message = message or _MESSAGES.get(status, "the HTTP request was refused")
    return APIError(status, message, code="bad_http_request").payload()


def install() -> bool:
    """Give hypercorn's own error responses an OpenAI body and refuse HTTP/2; False if
    either cannot be done."""
    try:
        import h11
        from hypercorn.protocol.h11 import H11Protocol
    except ImportError:  # pragma: no cover - hypercorn is a dependency
        return False

    def make(_: Any) -> Any:
        async def send_error_response(self: Any, status_code: int,
                                      message: str | None = None) -> None:
            body = error_body(status_code, message)
            headers = [(b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
            await self._send_h11_event(h11.Response(
                status_code=status_code,
                headers=list(chain(headers, self.config.response_headers("h11")))))
            await self._send_h11_event(h11.Data(data=body))
            await self._send_h11_event(h11.EndOfMessage())

        return send_error_response

    bodies = replace_method(H11Protocol, "_send_error_response", make,
                            needs=("_send_h11_event",),
                            without="hypercorn's protocol errors keep their empty bodies")
    return _refuse_http2() and bodies


def _refuse_http2() -> bool:
    """Make hypercorn's HTTP/1.1 protocol refuse both ways into HTTP/2 (module docstring)."""
    try:
        from hypercorn.events import Closed
        from hypercorn.protocol import ProtocolWrapper
        from hypercorn.protocol.h11 import (
            H2CProtocolRequiredError,
            H2ProtocolAssumedError,
            H11Protocol,
        )
    except ImportError:  # pragma: no cover - hypercorn is a dependency
        return False

    def make_check(_: Any) -> Any:
        async def check_protocol(self: Any, event: Any) -> None:
            # hypercorn's own check answers `Upgrade: h2c` with a 101: not doing so is the
            # refusal. Only the preface is still raised, for `handle` below to answer.
            if event.method == b"PRI" and event.target == b"*" and event.http_version == b"2.0":
                raise H2ProtocolAssumedError(b"")

        return check_protocol

    def make_handle(_: Any) -> Any:
        async def handle(self: Any, event: Any) -> None:
            try:
                await self.protocol.handle(event)
            except (H2ProtocolAssumedError, H2CProtocolRequiredError):
                # Raised before any stream was created: no app call, nothing to abort.
                if isinstance(self.protocol, H11Protocol):
                    await self.protocol._send_error_response(400, HTTP2_REFUSED)
                await self.send(Closed())

        return handle

    checked = replace_method(H11Protocol, "_check_protocol", make_check,
                             without="HTTP/2 is served after an Upgrade: h2c (issue 33)")
    handled = replace_method(ProtocolWrapper, "handle", make_handle,
                             without="HTTP/2 is served after a prior-knowledge preface")
    return checked and handled
