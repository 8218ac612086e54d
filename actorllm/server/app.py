"""The ASGI app: OpenAI-compatible routes in front of one :class:`AsyncEngine`.

The app talks to the engine through the Frontend only (``engine.submit`` /
``engine.abort``), plus read-only things the API layer owns by design: the tokenizer for
``/tokenize`` and logprob strings, the model info, and the metrics registry. It runs on
the same trio loop as the actors (hypercorn's trio worker), so handlers never block:
the Worker's forward pass runs in a thread.

    app = build_app(engine, served_model_name="my-model")
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from actorllm import __version__
from actorllm.engine import AsyncEngine
from actorllm.messages import GenerateRequest, InvalidRequest
from actorllm.server.convert import (
    TokenTexts,
    chat_messages,
    completion_prompts,
    sampling_params,
)
from actorllm.server.errors import APIError, install_handlers
from actorllm.server.generation import (
    ChatRenderer,
    CompletionRenderer,
    GenerationResponse,
    Job,
)
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

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 1024
_MAX_REQUEST_ID = 256

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
                 max_request_bytes: int, max_pending: int) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.max_pending = max_pending
        self.inflight = 0  # engine sequences held by HTTP requests (the overload cap)
        self.draining = False  # set on SIGINT/SIGTERM: refuse new work, /health says 503
        self.created = int(time.time())
        self.texts = TokenTexts(engine.tokenizer)

    @property
    def serving(self) -> bool:
        return self.engine.alive and not self.draining

    def check_model(self, model: str | None) -> None:
        """A request may omit ``model``; naming another one is a 404."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")


class _TooLarge(StarletteHTTPException):
    """Raised from ``receive``: FastAPI passes HTTPExceptions through its body reading."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over the limit of {limit} bytes")


class EdgeMiddleware:
    """Pure ASGI, before routing: API key (``/v1``), body size, ``X-Request-Id`` echo."""

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

        if scope["path"].startswith("/v1") and not self._authorized(headers):
            await APIError(401, "invalid or missing API key (use Authorization: Bearer KEY)",
                           code="invalid_api_key").send(send, echo)
            return
        limit = self.state.max_request_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await APIError(413, f"the request body is over the limit of {limit} bytes",
                           code="request_too_large").send(send, echo)
            return
        seen = 0

        async def receive_limited() -> Message:
            nonlocal seen
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
              max_pending: int = DEFAULT_MAX_PENDING) -> FastAPI:
    """The OpenAI-compatible app for ``engine`` (``app.state.server`` is its ServerState)."""
    state = ServerState(engine, served_model_name=served_model_name, api_key=api_key,
                        max_request_bytes=max_request_bytes, max_pending=max_pending)
    app = FastAPI(title="actorllm", version=__version__,
                  description="An OpenAI-compatible LLM inference server.")
    app.state.server = state
    install_handlers(app)
    app.add_middleware(EdgeMiddleware, state=state)
    info = engine.info

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        """200 while the engine serves; 503 when it is starting, draining or dead."""
        if not state.serving:
            raise APIError(503, "not serving", code="not_serving")
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
        params = sampling_params(body, defaults=info.generation_defaults,
                                 vocab_size=info.vocab_size)
        messages = chat_messages(body.messages)
        base = _request_id(request)
        job = Job(GenerateRequest(base, params, messages=messages,
                                  add_generation_prompt=body.add_generation_prompt is not False,
                                  arrival_time=time.monotonic()))
        renderer = ChatRenderer(response_id=f"chatcmpl-{base}", created=int(time.time()),
                                model=state.model_name, num_choices=params.n,
                                texts=state.texts, logprobs=params.logprobs is not None,
                                prompt_logprobs=body.prompt_logprobs)
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
        params = sampling_params(body, defaults=info.generation_defaults,
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
                echo = _decode(engine, prompt, "prompt") if body.echo else ""
            jobs.append(Job(req, index_base=i * params.n, echo=echo if body.echo else "",
                            echo_skips_special=isinstance(prompt, str)))
        echo_k = params.logprobs if body.echo else None
        renderer = CompletionRenderer(response_id=f"cmpl-{base}", created=int(time.time()),
                                      model=state.model_name,
                                      num_choices=len(prompts) * params.n, texts=state.texts,
                                      logprobs=params.logprobs is not None,
                                      prompt_logprobs=body.prompt_logprobs, echo_logprobs=echo_k)
        return GenerationResponse(state, jobs, renderer, stream=bool(body.stream),
                                  include_usage=_include_usage(body), request_id=base)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """Token ids of a prompt, or of chat messages through the template."""
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("give exactly one of prompt or messages", "prompt")
        tok = engine.tokenizer
        # The tokenizer is called on the loop thread on purpose: the Tokenizer actor uses
        # the same object there, and HF fast tokenizers must not be used concurrently.
        if body.prompt is not None:
            ids = list(tok(body.prompt, add_special_tokens=body.add_special_tokens is not False)
                       .input_ids)
        else:
            convo = [{"role": m.role, "content": m.content}
                     for m in chat_messages(body.messages or [])]
            try:
                out = tok.apply_chat_template(
                    convo, add_generation_prompt=body.add_generation_prompt is not False,
                    tokenize=True)
            except Exception as exc:  # a template may raise anything
                raise InvalidRequest(f"chat template failed: {exc}", "messages") from None
            ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        return {"count": len(ids), "max_model_len": info.max_model_len,
                "tokens": [int(t) for t in ids]}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        return {"prompt": _decode(engine, tuple(body.tokens))}

    return app


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _decode(engine: AsyncEngine, ids: tuple[int, ...], param: str = "tokens") -> str:
    bad = [t for t in ids if not 0 <= t < engine.info.vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is not in the vocabulary "
                             f"(size {engine.info.vocab_size})", param)
    return engine.tokenizer.decode(list(ids), skip_special_tokens=False)

