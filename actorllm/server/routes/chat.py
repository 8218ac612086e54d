"""``/v1/chat/completions``: messages through the model's template, tools, reasoning, whole
or as SSE. The request is prepared on the path ``/v1/responses`` shares
(``server/chat_request.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from actorllm.server.chat_request import chat_renderer, prepare_chat
from actorllm.server.convert import include_usage
from actorllm.server.errors import STREAM_RESPONSES
from actorllm.server.generation import GenerationResponse
from actorllm.server.response_models import ChatCompletionResponse
from actorllm.server.schemas import ChatCompletionRequest
from actorllm.server.state import request_id, state_of

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses=STREAM_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """Chat through the model's template; ``stream: true`` answers with SSE chunks."""
    state = state_of(request)
    state.check_model(body.model)
    base = request_id(request)
    chat = prepare_chat(body, base, state)
    renderer = chat_renderer(chat, body, response_id=f"chatcmpl-{base}",
                             model=state.model_name, texts=state.texts,
                             reasoning=state.features.reasoning)
    names = ({"max_tokens": "max_completion_tokens"}
             if body.max_completion_tokens is not None else {})
    names["logprobs"] = "top_logprobs"
    return GenerationResponse(state, [chat.job], renderer, stream=bool(body.stream),
                              include_usage=include_usage(body), request_id=base,
                              param_names=names)
