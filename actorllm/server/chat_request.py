"""A chat request made ready for the engine: the one path of ``/v1/chat/completions`` and
``/v1/responses`` (which converts its input items to chat messages first).

Sampling parameters, the tool plan, the reasoning parser's wrapping of a JSON
constraint, the messages and the template's variables become one :class:`Job`, and the
:class:`ChatRenderer` that reads its outputs.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import attrs

from actorllm.server.convert import chat_messages, sampling_params
from actorllm.server.job import Job
from actorllm.server.logprobs import TokenTexts
from actorllm.server.reasoning import ReasoningParser
from actorllm.server.render import ChatRenderer
from actorllm.server.schemas import ChatCompletionRequest
from actorllm.server.state import ServerState
from actorllm.server.tools import ToolPlan, plan_tools
from actorllm.wire.messages import GenerateRequest, InvalidRequest, SamplingParams

# apply_chat_template's own arguments: chat_template_kwargs may not set them.
_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


@attrs.frozen
class PreparedChat:
    job: Job
    params: SamplingParams
    tools: ToolPlan | None


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str] | None:
    """The variables a Jinja chat template reads from outside (None: it does not parse)."""
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return None


def template_kwargs(given: dict[str, Any] | None, template: Any = None) -> str | None:
    """``chat_template_kwargs`` as the JSON the Tokenizer hands the template. A variable
    the template does not read would be ignored silently, so it is refused (as any field
    this server does not honour); ``enable_thinking`` works where the template reads it."""
    if not given:
        return None
    reserved = sorted(_RESERVED & set(given))
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}",
                             "chat_template_kwargs")
    known = template_variables(template) if isinstance(template, str) else None
    unread = sorted(set(given) - known) if known is not None else []
    if unread:
        raise InvalidRequest(f"chat_template_kwargs: the chat template does not read "
                             f"{', '.join(unread)}", "chat_template_kwargs")
    return json.dumps(given, ensure_ascii=False)


def prepare_chat(body: ChatCompletionRequest, rid: str, state: ServerState) -> PreparedChat:
    """The engine request of ``body``; raises InvalidRequest naming the request's field."""
    info, reasoning = state.engine.info, state.features.reasoning
    params = sampling_params(body, defaults=info.sampling_defaults, vocab_size=info.vocab_size)
    tools = plan_tools(body, state.tool_call_parser)
    if tools is not None and tools.structured is not None:
        if params.structured is not None:
            raise InvalidRequest(f"tool_choice {body.tool_choice!r} forces the output; "
                                 f"it cannot be combined with {params.structured.param}",
                                 "tool_choice")
        params = attrs.evolve(params, structured=tools.structured)
    if reasoning is not None and params.structured is not None:
        params = attrs.evolve(params, structured=reasoning.wrap(params.structured))
    request = GenerateRequest(rid, params, messages=chat_messages(body.messages),
                              add_generation_prompt=body.add_generation_prompt is not False,
                              arrival_time=time.monotonic(),
                              return_prompt_ids=bool(body.return_token_ids),
                              tools=None if tools is None else tools.tools_json,
                              template_kwargs=template_kwargs(
                                  body.chat_template_kwargs,
                                  getattr(state.engine.tokenizer, "chat_template", None)))
    return PreparedChat(Job(request), params, tools)


def chat_renderer(prepared: PreparedChat, body: ChatCompletionRequest, *, response_id: str,
                  model: str, texts: TokenTexts,
                  reasoning: ReasoningParser | None) -> ChatRenderer:
    """The renderer of a prepared chat request's outputs."""
    tools = prepared.tools
    return ChatRenderer(response_id=response_id, created=int(time.time()), model=model,
                        num_choices=prepared.params.n, texts=texts,
                        logprobs=prepared.params.logprobs is not None,
                        prompt_logprobs=body.prompt_logprobs,
                        token_ids=bool(body.return_token_ids),
                        tools=None if tools is None or tools.mode == "none" else tools,
                        reasoning=reasoning)
