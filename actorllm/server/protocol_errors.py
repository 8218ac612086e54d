"""OpenAI error bodies for the errors hypercorn answers itself, before any ASGI call.

A malformed request line, a bad ``Content-Length`` or headers over hypercorn's limit
(431) never reach the app: h11 refuses the bytes and hypercorn answers with an empty
body. The ASGI layer cannot change that, so this module replaces that one method of
hypercorn's HTTP/1.1 protocol (``H11Protocol._send_error_response``) with one that
sends the same status and headers plus OpenAI's body. It is a private method of a
third-party class: ``install`` checks that it and the method it relies on exist, and
leaves hypercorn alone (logging why) if they do not;
``tests/test_server.py::test_protocol_errors_have_openai_bodies`` fails if a hypercorn
upgrade makes it stop working. HTTP/2 is not served (no TLS), so only h11 matters.
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


def error_body(status: int) -> bytes:
    """The body for a protocol-level refusal with ``status``."""
    message = _MESSAGES.get(status, "the HTTP request was refused")
    return APIError(status, message, code="bad_http_request").payload()


def install() -> bool:
    """Give hypercorn's own error responses an OpenAI body; False if it cannot."""
    try:
        import h11
        from hypercorn.protocol.h11 import H11Protocol
    except ImportError:  # pragma: no cover - hypercorn is a dependency
        return False

    def make(_: Any) -> Any:
        async def send_error_response(self: Any, status_code: int) -> None:
            body = error_body(status_code)
            headers = [(b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
            await self._send_h11_event(h11.Response(
                status_code=status_code,
                headers=list(chain(headers, self.config.response_headers("h11")))))
            await self._send_h11_event(h11.Data(data=body))
            await self._send_h11_event(h11.EndOfMessage())

        return send_error_response

    return replace_method(H11Protocol, "_send_error_response", make,
                          needs=("_send_h11_event",),
                          without="hypercorn's protocol errors keep their empty bodies")
