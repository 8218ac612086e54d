"""OpenAI error bodies: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every failure a client can cause maps to a 4xx here; a 500 means a bug in actorllm.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Send

from actorllm.frontend.actor import DuplicateRequestId
from actorllm.server.response_models import ErrorResponse
from actorllm.wire.messages import FailureCode, InvalidRequest
from actorllm.wire.outputs import RequestError

log = logging.getLogger(__name__)

# status -> the OpenAI error ``type`` (the client maps the status to its exception class)
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


# The error answers routes document in /openapi.json (FastAPI's ``responses=``).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": why} for status, why in (
        (400, "invalid parameters, or a prompt that does not fit"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (409, "the X-Request-Id is in use by a live request"),
        (413, "the body is over --max-request-bytes"),
        (503, "overloaded, or not serving"),
    )
}
# ... and for a generation route, whose 200 may be a stream of server-sent events.
STREAM_RESPONSES = {**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}}


class APIError(Exception):
    """An error the HTTP layer answers with ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})
        if status == 409:
            # The openai client retries a 409 by default; a duplicate id stays a duplicate.
            self.headers.setdefault("x-should-retry", "false")

    def body(self) -> dict[str, Any]:
        """The JSON body, OpenAI's shape."""
        return {"error": {"message": self.message,
                          "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def payload(self) -> bytes:
        """The body as bytes; ASCII-escaped so that no text a client sent can break it."""
        return json.dumps(self.body()).encode()

    def response(self, headers: dict[str, str] | None = None) -> Response:
        return Response(self.payload(), status_code=self.status,
                        media_type="application/json",
                        headers={**self.headers, **(headers or {})})

    async def send(self, send: Send, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Send the whole error response through a raw ASGI ``send``."""
        payload = self.payload()
        raw = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode()),
               *((k.encode(), v.encode()) for k, v in self.headers.items()), *headers]
        await send({"type": "http.response.start", "status": self.status, "headers": raw})
        await send({"type": "http.response.body", "body": payload, "more_body": False})


def invalid(exc: InvalidRequest) -> APIError:
    """A request the engine refuses: 400 (409 for a live duplicate request id)."""
    if isinstance(exc, DuplicateRequestId):
        return APIError(409, str(exc), param=exc.param, code="duplicate_request_id")
    return APIError(400, str(exc), param=exc.param, code="invalid_request")


def from_request_error(exc: RequestError) -> APIError:
    """An engine-side error, before any byte of the response was sent."""
    if exc.code == FailureCode.INVALID_REQUEST:
        return APIError(400, str(exc), param=exc.param, code="invalid_request")
    if exc.code == FailureCode.ENGINE_DEAD:
        return APIError(503, str(exc), code="engine_dead")
    return APIError(500, str(exc), code=exc.code or "internal_error")


def _is_union_tag(part: Any) -> bool:
    # pydantic names the arm of a union that failed ("str", "list[ContentPart]",
    # "function-after[...]", "constrained-str"); a client knows fields, not arms.
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "none", "list",
                                               "dict"} or "[" in part or "-" in part)


def _param(loc: Sequence[Any]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``messages[0].content``."""
    parts = [p for p in loc if p != "body" and not _is_union_tag(p)]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += f".{p}" if out else str(p)
    return out or None


_SPECIFIC = ("value_error", "string_unicode")
_SURROGATE = "must be valid Unicode text (it holds a lone surrogate)"


def telling_error(errors: Sequence[Any]) -> tuple[Any, str | None]:
    """The one of pydantic's ``errors`` (not empty) worth naming, and its field as a
    path (``messages[0].content``; None for the whole value)."""
    # A value our own validators refused (a lone surrogate, ...) says more than the
    # "not a list" of the union arms it also failed. pydantic's JSON parser finds some
    # lone surrogates itself (``string_unicode``); the schema's validator the rest.
    first = next((e for e in errors if e.get("type") in _SPECIFIC), errors[0])
    if first.get("type") == "string_unicode":
        first = {**first, "msg": _SURROGATE}
    return first, _param(first.get("loc", ()))


def validation_error(exc: RequestValidationError) -> APIError:
    """pydantic's complaint about the body, as a 400 naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body", code="invalid_request")
    first, param = telling_error(errors)
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error')}",
                        code="invalid_json")
    where = f"{param}: " if param else ""
    if first.get("type") == "extra_forbidden":
        # Refused rather than ignored: an answer that quietly ignored it would be wrong.
        first = {**first, "msg": "this server does not support this field (see the README's "
                 "table of request fields)"}
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return APIError(400, f"{where}{first.get('msg', 'invalid value')}{more}", param=param,
                    code="invalid_request")


def install_handlers(app: FastAPI) -> None:
    """Route every exception the app can meet to an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest) -> Response:
        return invalid(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed",
                413: "request_too_large"}.get(exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            message = "not found: no such route"
        return APIError(exc.status_code, message, code=code,
                        headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error in a request handler")
        return APIError(500, f"internal error: {type(exc).__name__}",
                        code="internal_error").response()
