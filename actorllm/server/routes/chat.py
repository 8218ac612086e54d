"""``/v1/chat/completions``: messages through the model's template, tools, whole or as SSE."""

from __future__ import annotations

import time

import attrs
from fastapi import APIRouter, Request
from starlette.responses import Response

from actorllm.server.convert import chat_messages, include_usage, sampling_params
from actorllm.server.errors import STREAM_RESPONSES
from actorllm.server.generation import GenerationResponse
from actorllm.server.job import Job
from actorllm.server.render import ChatRenderer
from actorllm.server.response_models import ChatCompletionResponse
from actorllm.server.schemas import ChatCompletionRequest
from actorllm.server.state import request_id, state_of
from actorllm.server.tools import plan_tools
from actorllm.wire.messages import GenerateRequest, InvalidRequest

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses=STREAM_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """Chat through the model's template; ``stream: true`` answers with SSE chunks."""
    state = state_of(request)
    state.check_model(body.model)
    info = state.engine.info
    params = sampling_params(body, defaults=info.sampling_defaults, vocab_size=info.vocab_size)
    tools = plan_tools(body, state.tool_call_parser)
    if tools is not None and tools.structured is not None:
        if params.structured is not None:
            raise InvalidRequest(f"tool_choice {body.tool_choice!r} forces the output; "
                                 f"it cannot be combined with {params.structured.param}",
                                 "tool_choice")
        params = attrs.evolve(params, structured=tools.structured)
    messages = chat_messages(body.messages)
    base = request_id(request)
    job = Job(GenerateRequest(base, params, messages=messages,
                              add_generation_prompt=body.add_generation_prompt is not False,
                              arrival_time=time.monotonic(),
                              tools=None if tools is None else tools.tools_json))
    renderer = ChatRenderer(response_id=f"chatcmpl-{base}", created=int(time.time()),
                            model=state.model_name, num_choices=params.n,
                            texts=state.texts, logprobs=params.logprobs is not None,
                            prompt_logprobs=body.prompt_logprobs,
                            tools=None if tools is None or tools.mode == "none" else tools)
    names = ({"max_tokens": "max_completion_tokens"}
             if body.max_completion_tokens is not None else {})
    names["logprobs"] = "top_logprobs"
    return GenerationResponse(state, [job], renderer, stream=bool(body.stream),
                              include_usage=include_usage(body), request_id=base,
                              param_names=names)
