"""Fuzz the HTTP request-validation layer: request bodies into the server's pydantic schemas
and their conversion to engine requests (actorllm/server/schemas.py, convert.py).

Contract: a body that is JSON either becomes ``GenerateRequest``s or is refused with one
of the typed validation errors the server turns into a 4xx: ``pydantic.ValidationError``
(the schema) or ``InvalidRequest`` (the values). Nothing else escapes. And what is
accepted must be able to cross a process boundary intact: its ``GenerateRequest``
round-trips through the codec. (Bodies that are not JSON never get this far: FastAPI
answers them itself.)

Every body is tried as a chat request and as a completion request.

    python fuzz/fuzz_request.py -atheris_runs=20000 fuzz/corpus/request
"""

from __future__ import annotations

import json
from typing import Any

import pydantic
from _harness import main

from actorllm.config import default_model_dir, read_model_info
from actorllm.server.convert import chat_messages, completion_prompts, sampling_params
from actorllm.server.schemas import ChatCompletionRequest, CompletionRequest
from actorllm.wire import codec
from actorllm.wire.messages import GenerateRequest, InvalidRequest

NAME = "request"
INFO = read_model_info(default_model_dir())  # the served model's defaults and vocabulary


def _requests(body: Any, schema: type[ChatCompletionRequest | CompletionRequest]
              ) -> list[GenerateRequest]:
    req = schema.model_validate(body)
    params = sampling_params(req, defaults=INFO.sampling_defaults,
                             vocab_size=INFO.vocab_size)
    if isinstance(req, ChatCompletionRequest):
        return [GenerateRequest("fuzz", params, messages=chat_messages(req.messages),
                                add_generation_prompt=req.add_generation_prompt is not False)]
    out = []
    for prompt in completion_prompts(req.prompt):
        if isinstance(prompt, str):
            out.append(GenerateRequest("fuzz", params, prompt=prompt))
        else:
            out.append(GenerateRequest("fuzz", params, prompt_token_ids=prompt))
    return out


def TestOneInput(data: bytes) -> None:
    try:
        body = json.loads(data)
    except Exception:  # not JSON (or too deep to parse): FastAPI answers 400/422 itself
        return
    for schema in (ChatCompletionRequest, CompletionRequest):
        try:
            reqs = _requests(body, schema)
        except (pydantic.ValidationError, InvalidRequest):
            continue
        for r in reqs:
            # What the Frontend forwards to the Tokenizer: the request itself.
            assert codec.decode(codec.encode(r)) == r, r


if __name__ == "__main__":
    main(TestOneInput)
