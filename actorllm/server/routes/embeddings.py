"""``POST /v1/embeddings``: one prefill-only pooling request per input (``--pooling``),
through the same actors as a completion; ``server/embeddings.py`` shapes the answer."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from actorllm.embed import pooling_params
from actorllm.server.convert import completion_prompts, prompt_request
from actorllm.server.embeddings import EmbeddingRenderer, EmbeddingRequest
from actorllm.server.errors import ERROR_RESPONSES
from actorllm.server.generation import GenerationResponse
from actorllm.server.job import Job
from actorllm.server.state import request_id, state_of
from actorllm.wire.messages import InvalidRequest

router = APIRouter()


@router.post("/v1/embeddings", responses=ERROR_RESPONSES)
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """Pooled final hidden states, one per input, normalized (``server/embeddings.py``)."""
    state = state_of(request)
    state.check_model(body.model)
    # (a 400 naming the field, before any input is tokenized)
    params = pooling_params(state.features.pooling, body.truncate_prompt_tokens)
    try:
        prompts = completion_prompts(body.input)
    except InvalidRequest as exc:
        raise InvalidRequest(str(exc), "input") from None
    base = request_id(request)
    now = time.monotonic()
    jobs = []
    for i, prompt in enumerate(prompts):
        jobs.append(Job(prompt_request(base, i, len(prompts), params, prompt, now),
                        index_base=i))
    renderer = EmbeddingRenderer(jobs, model=state.model_name,
                                 encoding=body.encoding_format or "float",
                                 normalize=state.features.normalize)
    return GenerationResponse(state, jobs, renderer, stream=False, include_usage=False,
                              request_id=base, param_names={"prompt": "input"})
