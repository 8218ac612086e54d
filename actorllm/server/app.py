"""The ASGI app: OpenAI-compatible routes in front of one :class:`AsyncEngine`.

The app talks to the engine through the Frontend only (``engine.submit`` /
``engine.abort``), plus read-only things the API layer owns by design: the tokenizer for
``/tokenize`` and logprob strings, the model info, and the metrics registry. It runs on
the same trio loop as the actors (hypercorn's trio worker), so handlers never block:
the Worker's forward pass runs in a thread, and so does any tokenizing or templating
of client text (``/tokenize``, ``/detokenize``, the Tokenizer actor's long inputs).

    app = build_app(engine, served_model_name="my-model")
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import trio
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from actorllm import __version__
from actorllm.engine.async_engine import AsyncEngine
from actorllm.server.chat_request import chat_renderer, prepare_chat
from actorllm.server.convert import (
    TokenTexts,
    chat_messages,
    completion_prompts,
    sampling_params,
)
from actorllm.server.errors import APIError, install_handlers
from actorllm.server.feature_routes import register_feature_routes
from actorllm.server.features import Features
from actorllm.server.generation import GenerationResponse, Job
from actorllm.server.render import CompletionRenderer
from actorllm.server.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from actorllm.server.tools import PARSERS, template_tools
from actorllm.tokenizer.actor import PromptEncoder
from actorllm.wire.messages import GenerateRequest, InvalidRequest

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 1024
_MAX_REQUEST_ID = 256
# Paths behind --api-key: the OpenAI routes and the tokenizer ones (as in vLLM), which
# take client text and CPU time.
_PROTECTED = ("/v1/", "/tokenize", "/detokenize")
# Sent with an answer given before the body was read: the unread body would otherwise
# be taken for the next request on the connection, so hypercorn closes it; say so.
_CLOSE = {"connection": "close"}
_T = TypeVar("_T")

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": why} for status, why in (
        (400, "invalid parameters, or a prompt that does not fit"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (409, "the X-Request-Id is in use by a live request"),
        (413, "the body is over --max-request-bytes"),
        (503, "overloaded, or not serving"),
    )
}


class ServerState:
    """What the routes share: the engine, the settings, and the live-request count."""

    def __init__(self, engine: AsyncEngine, *, served_model_name: str, api_key: str | None,
                 max_request_bytes: int, max_pending: int,
                 tool_call_parser: str = "json", body_timeout: float | None = None) -> None:
        self.engine = engine
        self.tool_call_parser = tool_call_parser  # a key of server.tools.PARSERS
        self.body_timeout = body_timeout  # --body-timeout: 408 for a body that stalls
        self.model_name = served_model_name
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        # The engine's one gate: SIGINT/SIGTERM drain it (new work refused, /health 503);
        # each HTTP request reserves its sequences on it, up to --max-pending.
        self.admission = engine.admission
        self.admission.capacity = max_pending
        # Set when --drain-timeout runs out: requests still running end with an error.
        self.drain_expired = trio.Event()
        self.created = int(time.time())
        self.texts = TokenTexts(engine.tokenizer)
        # /tokenize and /detokenize run the tokenizer in threads; this many at once.
        self.tokenizer_threads = trio.CapacityLimiter(2)

    @property
    def serving(self) -> bool:
        return self.refusal() is None

    def refusal(self) -> APIError | None:
        """Why a new request is refused now (503), or None while serving."""
        refused = self.admission.refusal()
        if refused is None:
            return None
        if refused.code == "engine_dead":
            return APIError(503, f"the engine is dead: {refused}; the server "
                            "must be restarted", code="engine_dead")
        return APIError(503, "the server is shutting down", code="shutting_down",
                        headers=_CLOSE)

    async def in_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run tokenizer work off the event loop (a 1 MB prompt takes about a second)."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.tokenizer_threads)

    def check_model(self, model: str | None) -> None:
        """A request may omit ``model``; naming another one is a 404."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")


class _TooLarge(StarletteHTTPException):
    """Raised from ``receive``: FastAPI passes HTTPExceptions through its body reading."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over the limit of {limit} bytes",
                         headers=_CLOSE)


class _BodyTimeout(StarletteHTTPException):
    """Raised from ``receive`` when the body has not arrived within --body-timeout."""

    def __init__(self, limit: float) -> None:
        super().__init__(408, f"the request body did not arrive within {limit:g} s "
                         "(--body-timeout)", headers=_CLOSE)


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
        if (path.startswith(_PROTECTED) or path == "/v1") and not self._authorized(headers):
            await APIError(401, "invalid or missing API key (use Authorization: Bearer KEY)",
                           code="invalid_api_key", headers=_CLOSE).send(send, echo)
            return
        limit = self.state.max_request_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await APIError(413, f"the request body is over the limit of {limit} bytes",
                           code="request_too_large", headers=_CLOSE).send(send, echo)
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


def _request_id(request: Request) -> str:
    """The client's X-Request-Id, checked, or a fresh one."""
    given = request.headers.get("x-request-id")
    if given is None:
        return uuid.uuid4().hex
    if not given or len(given) > _MAX_REQUEST_ID or not all(33 <= ord(c) < 127 for c in given):
        raise APIError(400, f"X-Request-Id must be 1 to {_MAX_REQUEST_ID} visible ASCII "
                       "characters", param="X-Request-Id", code="invalid_request")
    return given


def build_app(engine: AsyncEngine, *, served_model_name: str, api_key: str | None = None,
              max_request_bytes: int = 1 << 20,
              max_pending: int = DEFAULT_MAX_PENDING,
              tool_call_parser: str = "json", body_timeout: float | None = None,
              features: Features | None = None) -> FastAPI:
    """The OpenAI-compatible app for ``engine`` (``app.state.server`` is its ServerState);
    ``features``: the settings of reasoning, the Responses API and embeddings."""
    features = features or Features()
    if tool_call_parser not in PARSERS:
        raise ValueError(f"unknown tool-call parser {tool_call_parser!r}")
    state = ServerState(engine, served_model_name=served_model_name, api_key=api_key,
                        max_request_bytes=max_request_bytes, max_pending=max_pending,
                        tool_call_parser=tool_call_parser, body_timeout=body_timeout)
    app = FastAPI(title="actorllm", version=__version__,
                  description="An OpenAI-compatible LLM inference server.")
    app.state.server = state
    install_handlers(app)
    app.add_middleware(EdgeMiddleware, state=state)
    info = engine.info
    # /tokenize refuses and templates exactly as the Tokenizer actor does.
    encoder = PromptEncoder(engine.tokenizer, info)

    @app.get("/health", response_class=Response, responses={
        200: {"description": "serving (an empty body)", "content": {}},
        503: {"model": ErrorResponse, "description": "shutting down (`shutting_down`) or "
              "the engine is dead (`engine_dead`)"}})
    async def health() -> Response:
        """200 (empty) while the engine serves; 503 when it is draining or dead."""
        refusal = state.refusal()
        if refusal is not None:
            raise refusal
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        """Prometheus text format; gauges are refreshed from the latest scheduler stats."""
        engine.update_gauges()
        return Response(generate_latest(engine.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "actorllm", "root": info.path, "max_model_len": info.max_model_len}]}

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat through the model's template; ``stream: true`` answers with SSE chunks."""
        state.check_model(body.model)
        base = _request_id(request)
        chat = prepare_chat(body, base, state, features)
        renderer = chat_renderer(chat, body, response_id=f"chatcmpl-{base}",
                                 model=state.model_name, texts=state.texts,
                                 reasoning=features.reasoning)
        job = chat.job
        names = ({"max_tokens": "max_completion_tokens"}
                 if body.max_completion_tokens is not None else {})
        names["logprobs"] = "top_logprobs"
        return GenerationResponse(state, [job], renderer, stream=bool(body.stream),
                                  include_usage=_include_usage(body), request_id=base,
                                  param_names=names)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Complete a string, token ids, or a list of either (choice = prompt * n + i)."""
        state.check_model(body.model)
        params = sampling_params(body, defaults=info.sampling_defaults,
                                 vocab_size=info.vocab_size)
        prompts = completion_prompts(body.prompt)
        base = _request_id(request)
        now = time.monotonic()
        jobs = []
        for i, prompt in enumerate(prompts):
            rid = base if len(prompts) == 1 else f"{base}-{i}"
            if isinstance(prompt, str):
                req = GenerateRequest(rid, params, prompt=prompt, arrival_time=now)
                echo = prompt
            else:
                req = GenerateRequest(rid, params, prompt_token_ids=prompt, arrival_time=now)
                echo = ""
                if body.echo:
                    _check_vocab(engine, prompt, "prompt")
                    echo = await state.in_thread(_decode, engine, prompt)
            jobs.append(Job(req, index_base=i * params.n, echo=echo if body.echo else "",
                            echo_skips_special=isinstance(prompt, str)))
        echo_k = body.logprobs if body.echo else None
        n = body.n or 1
        renderer = CompletionRenderer(response_id=f"cmpl-{base}", created=int(time.time()),
                                      model=state.model_name,
                                      num_choices=len(prompts) * params.n, texts=state.texts,
                                      logprobs=body.logprobs is not None,
                                      prompt_logprobs=body.prompt_logprobs, echo_logprobs=echo_k,
                                      best_of=(n, params.n) if params.n != n else None)
        return GenerationResponse(state, jobs, renderer, stream=bool(body.stream),
                                  include_usage=_include_usage(body), request_id=base)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """Token ids of a prompt, or of chat messages through the template."""
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("give exactly one of prompt or messages", "prompt")
        if body.tools and body.messages is None:
            raise InvalidRequest("tools are rendered with messages, not a prompt", "tools")
        messages = None if body.messages is None else chat_messages(body.messages)
        # The same rendering as a chat completion's, so the counts agree.
        tools = json.loads(template_tools(body.tools)) if body.tools else None
        ids = await state.in_thread(
            encoder.token_ids, body.prompt, messages, body.add_generation_prompt is not False,
            body.add_special_tokens is not False, tools)
        return {"count": len(ids), "max_model_len": info.max_model_len,
                "tokens": [int(t) for t in ids]}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        """The text of token ids (special tokens included)."""
        state.check_model(body.model)
        ids = tuple(body.tokens)
        _check_vocab(engine, ids, "tokens")
        return {"prompt": await state.in_thread(_decode, engine, ids)}

    register_feature_routes(app, state, features, _request_id, _ERRORS)
    _document_400_not_422(app)
    return app


def _document_400_not_422(app: FastAPI) -> None:
    """FastAPI documents 422 for a bad body; this server answers 400 (OpenAI's status)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()
        for item in schema.get("paths", {}).values():
            for op in item.values():
                responses = op.get("responses", {})
                if responses.pop("422", None) is not None and "400" not in responses:
                    responses["400"] = {"description": "invalid request",
                                        "content": {"application/json": {"schema": {
                                            "$ref": "#/components/schemas/ErrorResponse"}}}}
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _check_vocab(engine: AsyncEngine, ids: tuple[int, ...], param: str) -> None:
    bad = [t for t in ids if not 0 <= t < engine.info.vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is not in the vocabulary "
                             f"(size {engine.info.vocab_size})", param)


def _decode(engine: AsyncEngine, ids: tuple[int, ...]) -> str:
    return str(engine.tokenizer.decode(list(ids), skip_special_tokens=False))

