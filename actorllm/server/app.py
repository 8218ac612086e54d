"""The ASGI app: OpenAI-compatible routes in front of one :class:`AsyncEngine`.

The app talks to the engine through the Frontend only (``engine.submit`` /
``engine.abort``), plus read-only things the API layer owns by design: the tokenizer for
``/tokenize`` and logprob strings, the model info, and the metrics registry. It runs on
the same trio loop as the actors (hypercorn's trio worker), so handlers never block:
the Worker's forward pass runs in a thread, and so does any tokenizing or templating
of client text (``/tokenize``, ``/detokenize``, the Tokenizer actor's long inputs).

A request's way through: ``edge.py`` (key, size, id) -> a route in ``routes/`` (its
family's module) -> ``convert.py`` (request in) -> ``generation.py`` (admission through
``state.py``, submit, collect) -> ``render.py`` (OpenAI's shapes) -> ``sse.py``.
``/v1/chat/completions`` and ``/v1/responses`` share one chat path (``chat_request.py``);
``/v1/embeddings`` is a prefill-only pooling request through the same actors.

    app = build_app(engine, served_model_name="my-model")
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI

from actorllm import __version__
from actorllm.engine.async_engine import AsyncEngine
from actorllm.server.edge import EdgeMiddleware
from actorllm.server.errors import install_handlers
from actorllm.server.features import Features
from actorllm.server.routes import chat, completions, embeddings, meta, responses, tokens
from actorllm.server.schemas import TOKEN_ID_MARK
from actorllm.server.state import DEFAULT_MAX_PENDING, ServerState
from actorllm.server.tools import PARSERS

# Every route family; a new one is a module in routes/ with a `router`, listed here.
ROUTERS: tuple[APIRouter, ...] = (meta.router, chat.router, completions.router,
                                  tokens.router, responses.router, embeddings.router)

__all__ = ["DEFAULT_MAX_PENDING", "ROUTERS", "ServerState", "build_app"]


def build_app(engine: AsyncEngine, *, served_model_name: str, api_key: str | None = None,
              max_request_bytes: int = 1 << 20,
              max_pending: int = DEFAULT_MAX_PENDING,
              tool_call_parser: str = "json", body_timeout: float | None = None,
              features: Features | None = None) -> FastAPI:
    """The OpenAI-compatible app for ``engine`` (``app.state.server`` is its ServerState);
    ``features``: the settings of reasoning, the Responses API and embeddings."""
    if tool_call_parser not in PARSERS:
        raise ValueError(f"unknown tool-call parser {tool_call_parser!r}")
    state = ServerState(engine, served_model_name=served_model_name, api_key=api_key,
                        max_request_bytes=max_request_bytes, max_pending=max_pending,
                        tool_call_parser=tool_call_parser, body_timeout=body_timeout,
                        features=features)
    app = FastAPI(title="actorllm", version=__version__,
                  description="An OpenAI-compatible LLM inference server.")
    app.state.server = state
    install_handlers(app)
    app.add_middleware(EdgeMiddleware, state=state)
    for router in ROUTERS:
        app.include_router(router)
    if state.features.tokenizer_info:  # off by default, as in vLLM: it shows the template
        app.include_router(tokens.info_router)
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
        _bound_token_ids(schema, app.state.server.engine.info.vocab_size)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _bound_token_ids(node: Any, vocab_size: int) -> None:
    """Give every token id in the schema its real bound: the vocabulary's size (the
    models in ``schemas.py`` only know it is a non-negative integer)."""
    if isinstance(node, dict):
        if node.pop(TOKEN_ID_MARK, False):
            node["maximum"] = vocab_size - 1
        for value in node.values():
            _bound_token_ids(value, vocab_size)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size)
