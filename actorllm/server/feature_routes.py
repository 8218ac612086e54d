"""The routes of the issue-31 features, added to the app in one call from ``build_app``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from actorllm.server.embeddings import register_embeddings
from actorllm.server.features import Features
from actorllm.server.responses import register_responses


def register_feature_routes(app: FastAPI, state: Any, features: Features,
                            request_id: Callable[[Request], str],
                            errors: dict[int | str, dict[str, Any]]) -> None:
    """``/v1/responses`` (and its GET) and ``/v1/embeddings``; ``errors``: the error
    answers to document (the app's own)."""
    register_responses(app, state, features, request_id, errors)
    register_embeddings(app, state, features, request_id, errors)
