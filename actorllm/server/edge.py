"""The edge, before routing: API key, body size and time, ``X-Request-Id`` echo (pure ASGI)."""

from __future__ import annotations

import hmac

import trio
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from actorllm.server.errors import APIError
from actorllm.server.state import CLOSE, ServerState

# Path prefixes behind --api-key: the OpenAI routes and the tokenizer ones (as in vLLM),
# which take client text and CPU time ("/tokenize" covers /tokenizer_info too).
_PROTECTED = ("/v1/", "/tokenize", "/detokenize")


class _TooLarge(StarletteHTTPException):
    """Raised from ``receive``: FastAPI passes HTTPExceptions through its body reading."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over the limit of {limit} bytes",
                         headers=CLOSE)


class _BodyTimeout(StarletteHTTPException):
    """Raised from ``receive`` when the body has not arrived within --body-timeout."""

    def __init__(self, limit: float) -> None:
        super().__init__(408, f"the request body did not arrive within {limit:g} s "
                         "(--body-timeout)", headers=CLOSE)


class EdgeMiddleware:
    """Pure ASGI, before routing: API key, body size, ``X-Request-Id`` echo.

    A 401 or 413 given here is sent before the body is read, with ``Connection: close``:
    reading a body we refuse would cost up to --max-request-bytes per attempt.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        rid = headers.get(b"x-request-id")
        echo = [(b"x-request-id", rid)] if rid is not None else []

        async def send_echo(message: Message) -> None:
            if echo and message["type"] == "http.response.start":
                raw = list(message.get("headers", ()))
                if not any(k.lower() == b"x-request-id" for k, _ in raw):
                    message = {**message, "headers": raw + echo}
            await send(message)

        path = scope["path"]
        if ((path.startswith(_PROTECTED) or path == "/v1") and not self._authorized(headers)
                and not _wrong_method(scope)):
            await APIError(401, "invalid or missing API key (use Authorization: Bearer KEY)",
                           code="invalid_api_key", headers=CLOSE).send(send, echo)
            return
        limit = self.state.max_request_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await APIError(413, f"the request body is over the limit of {limit} bytes",
                           code="request_too_large", headers=CLOSE).send(send, echo)
            return
        seen = 0
        body_limit = self.state.body_timeout
        # The whole body must be in by then (a slowloris sends a byte now and then, so a
        # timeout per read would not do); after the body, receive() waits freely (it is
        # how a response hears of a disconnect).
        body_deadline = None if body_limit is None else trio.current_time() + body_limit
        body_done = False

        async def receive_limited() -> Message:
            nonlocal seen, body_done
            if body_deadline is not None and not body_done:
                with trio.move_on_at(body_deadline) as scope:
                    message = await receive()
                if scope.cancelled_caught:
                    raise _BodyTimeout(body_limit)
                body_done = message["type"] != "http.request" or not message.get(
                    "more_body", False)
            else:
                message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(limit)
            return message

        await self.app(scope, receive_limited, send_echo)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        key = self.state.api_key
        if key is None:
            return True
        given = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                  key.encode())


def _wrong_method(scope: Scope) -> bool:
    """The path is a route's, the method none of its: routing answers 405 (Allow: ...),
    key or not (whether a method exists is public, in /openapi.json)."""
    app = scope.get("app")
    routes = getattr(getattr(app, "router", None), "routes", ())
    matches = [route.matches(scope)[0] for route in routes]
    return Match.PARTIAL in matches and Match.FULL not in matches
