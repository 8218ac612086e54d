"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API.

A request becomes a chat request (``server/responses.py``), is prepared on the chat path
(``server/chat_request.py``), and its output is shaped by ``server/responses_stream.py``;
finished responses go to the app's store (``ServerState.response_store``).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from actorllm.server.chat_request import chat_renderer, prepare_chat
from actorllm.server.errors import ERROR_RESPONSES, STREAM_RESPONSES
from actorllm.server.generation import GenerationResponse
from actorllm.server.responses import (
    PARAMS,
    chat_request,
    envelope_of,
    input_messages,
    output_messages,
)
from actorllm.server.responses_schema import ResponsesRequest
from actorllm.server.responses_stream import ResponsesRenderer
from actorllm.server.state import request_id, state_of
from actorllm.wire.messages import InvalidRequest

router = APIRouter()


@router.post("/v1/responses", responses=STREAM_RESPONSES)
async def responses(body: ResponsesRequest, request: Request) -> Response:
    """OpenAI's Responses API; ``stream: true`` answers with its typed events."""
    state = state_of(request)
    state.check_model(body.model)
    store = state.response_store
    history = [] if body.previous_response_id is None else \
        store.get(body.previous_response_id)[1]
    chat_body = chat_request(body, history)
    base = request_id(request)
    try:
        chat = prepare_chat(chat_body, base, state)
    except InvalidRequest as exc:
        param = (exc.param or "").split("[")[0]
        raise InvalidRequest(str(exc), PARAMS.get(param, exc.param)) from None
    response_id = base if base.startswith("resp_") else f"resp_{base}"
    chat_r = chat_renderer(chat, chat_body, response_id=response_id,
                           model=state.model_name, texts=state.texts,
                           reasoning=state.features.reasoning)
    conversation = history + input_messages(body.input)

    def keep(response: dict[str, Any]) -> None:
        if body.store is not False:
            store.put(response, conversation + output_messages(response["output"]))

    renderer = ResponsesRenderer(chat_r, envelope_of(body, response_id, int(time.time()),
                                                     state.model_name), keep)
    return GenerationResponse(state, [chat.job], renderer, stream=bool(body.stream),
                              include_usage=bool(body.stream), request_id=base,
                              param_names=dict(PARAMS))


@router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    """A stored response (404 when unknown or expired)."""
    return state_of(request).response_store.get(response_id)[0]
