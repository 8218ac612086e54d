"""``/v1/completions``: text or token-id prompts, several at once (choice = prompt * n + i)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from actorllm.server.convert import (
    completion_prompts,
    include_usage,
    prompt_request,
    sampling_params,
)
from actorllm.server.errors import STREAM_RESPONSES
from actorllm.server.generation import GenerationResponse
from actorllm.server.job import Job
from actorllm.server.render import CompletionRenderer
from actorllm.server.response_models import CompletionResponse
from actorllm.server.schemas import CompletionRequest
from actorllm.server.state import request_id, state_of

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse, responses=STREAM_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Response:
    """Complete a string, token ids, or a list of either (choice = prompt * n + i)."""
    state = state_of(request)
    state.check_model(body.model)
    info = state.engine.info
    params = sampling_params(body, defaults=info.sampling_defaults, vocab_size=info.vocab_size)
    prompts = completion_prompts(body.prompt)
    base = request_id(request)
    now = time.monotonic()
    jobs = []
    for i, prompt in enumerate(prompts):
        req = prompt_request(base, i, len(prompts), params, prompt, now,
                             bool(body.return_token_ids))
        echo = ""
        if body.echo and isinstance(prompt, str):
            echo = prompt
        elif body.echo:
            state.check_vocab(prompt, "prompt")
            echo = await state.decode(prompt)
        jobs.append(Job(req, index_base=i * params.n, echo=echo,
                        echo_skips_special=isinstance(prompt, str)))
    n = body.n or 1
    renderer = CompletionRenderer(response_id=f"cmpl-{base}", created=int(time.time()),
                                  model=state.model_name,
                                  num_choices=len(prompts) * params.n, texts=state.texts,
                                  logprobs=body.logprobs is not None,
                                  prompt_logprobs=body.prompt_logprobs,
                                  echo_logprobs=body.logprobs if body.echo else None,
                                  token_ids=bool(body.return_token_ids),
                                  best_of=(n, params.n) if params.n != n else None)
    return GenerationResponse(state, jobs, renderer, stream=bool(body.stream),
                              include_usage=include_usage(body), request_id=base)
