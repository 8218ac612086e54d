"""``/tokenize`` and ``/detokenize``: the model's tokenizer, run in threads off the loop;
``GET /tokenizer_info``, its configuration, where the server is started with
``--enable-tokenizer-info-endpoint`` (``info_router``: the app includes it only then)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request

from actorllm.server.convert import chat_messages
from actorllm.server.errors import ERROR_RESPONSES
from actorllm.server.response_models import (
    DetokenizeResponse,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from actorllm.server.schemas import DetokenizeRequest, TokenizeRequest
from actorllm.server.state import state_of
from actorllm.server.tools import template_tools
from actorllm.wire.messages import InvalidRequest

router = APIRouter()
info_router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """Token ids of a prompt, or of chat messages through the template."""
    state = state_of(request)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("give exactly one of prompt or messages", "prompt")
    if body.tools and body.messages is None:
        raise InvalidRequest("tools are rendered with messages, not a prompt", "tools")
    messages = None if body.messages is None else chat_messages(body.messages)
    # The same rendering as a chat completion's, so the counts agree.
    tools = json.loads(template_tools(body.tools)) if body.tools else None
    ids = await state.in_thread(
        state.encoder.token_ids, body.prompt, messages, body.add_generation_prompt is not False,
        body.add_special_tokens is not False, tools)
    return {"count": len(ids), "max_model_len": state.engine.info.max_model_len,
            "tokens": [int(t) for t in ids]}


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    """The text of token ids (special tokens included)."""
    state = state_of(request)
    state.check_model(body.model)
    ids = tuple(body.tokens)
    state.check_vocab(ids, "tokens")
    return {"prompt": await state.decode(ids)}


@info_router.get("/tokenizer_info", response_model=TokenizerInfoResponse,
                 responses=ERROR_RESPONSES)
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """The tokenizer's configuration, as vLLM serves it: lm-evaluation-harness's
    ``local-completions`` finds it and then tokenizes through ``/tokenize`` and
    ``/detokenize``, with no copy of the tokenizer on the client's side."""
    tokenizer = state_of(request).engine.tokenizer
    # (file paths say nothing a client can use; special tokens are given by their text)
    info = {k: _plain(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
            if not k.endswith("_file")}
    info["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)  # --chat-template's, if given
    info.pop("chat_template", None)
    if template is not None:
        info["chat_template"] = _plain(template)
    return info


def _plain(value: Any) -> Any:
    """``value`` as JSON can carry it: a special token as its text, other objects as str."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    content = getattr(value, "content", None)  # tokenizers' AddedToken
    return content if isinstance(content, str) else str(value)
