"""What the server says about itself: ``/health``, ``/version``, ``/metrics``, ``/v1/models``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from actorllm import __version__
from actorllm.server.errors import ERROR_RESPONSES
from actorllm.server.response_models import ErrorResponse, ModelList
from actorllm.server.state import state_of

router = APIRouter()


@router.get("/health", response_class=Response, responses={
    200: {"description": "serving (an empty body)", "content": {}},
    503: {"model": ErrorResponse, "description": "shutting down (`shutting_down`), "
          "the engine is dead (`engine_dead`), or an engine process's heartbeats are "
          "late (`engine_unresponsive`: it may recover, or be killed)"}})
async def health(request: Request) -> Response:
    """200 (empty) while the engine serves; 503 when it is draining, dead or frozen."""
    problem = state_of(request).health()
    if problem is not None:
        raise problem
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus text format; gauges are refreshed from the latest scheduler stats."""
    engine = state_of(request).engine
    engine.update_gauges()
    return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    info = state.engine.info
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created,
        "owned_by": "actorllm", "root": info.path, "max_model_len": info.max_model_len}]}
