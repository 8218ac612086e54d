"""``POST /v1/responses`` (OpenAI's Responses API) on the chat completions path.

A request's ``input`` items (messages, ``function_call``, ``function_call_output``) and
``instructions`` become chat messages, its tools, ``tool_choice``, ``text.format`` and
sampling fields a :class:`ChatCompletionRequest`; from there it is a chat request
(``server/chat_request.py``): the same conversion, tools, reasoning and rendering, one
engine request. ``server/responses_stream.py`` shapes the output.

``store`` (the default) keeps each finished response in a bounded in-memory store, so a
later request can continue it with ``previous_response_id`` (its conversation, without
its ``instructions``, comes before the new input) or fetch it with ``GET
/v1/responses/{id}``. The store holds ``--responses-store-size`` responses, each for
``--responses-store-ttl`` seconds, oldest dropped first; it is lost on restart. An
unknown or expired id is a 404.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from starlette.responses import Response

from actorllm.server.chat_request import chat_renderer, prepare_chat
from actorllm.server.errors import APIError
from actorllm.server.features import Features
from actorllm.server.generation import GenerationResponse
from actorllm.server.responses_schema import ResponsesRequest
from actorllm.server.responses_stream import ResponsesRenderer
from actorllm.server.schemas import ChatCompletionRequest
from actorllm.wire.messages import InvalidRequest

# Chat names of the fields a Responses request spells otherwise.
_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "messages": "input", "response_format": "text.format"}


class ResponseStore:
    """Finished responses and the conversations that led to them, bounded in count and age."""

    def __init__(self, size: int, ttl: float) -> None:
        self.size, self.ttl = size, ttl
        self._items: OrderedDict[str, tuple[float, dict[str, Any], list[dict[str, Any]]]] = \
            OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep ``response``; ``conversation``: its chat messages, input and output."""
        self._items[response["id"]] = (time.monotonic(), response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The response and its conversation; a 404 APIError when unknown or expired."""
        now = time.monotonic()
        while self._items:  # the oldest first: drop what has expired
            oldest = next(iter(self._items.values()))
            if now - oldest[0] <= self.ttl:
                break
            self._items.popitem(last=False)
        hit = self._items.get(response_id)
        if hit is None:
            raise APIError(404, f"Response with id '{response_id}' not found.",
                           param="previous_response_id", code="not_found")
        return hit[1], hit[2]


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (input_text / output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of parts", where)
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or \
                not isinstance(part.get("text"), str):
            raise InvalidRequest(f"content part type {kind!r} is not supported; only text",
                                 f"{where}.content[{j}]")
        pieces.append(part["text"])
    return "".join(pieces)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (dicts in the shape of ``ChatMessageIn``)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"{where}.role must be user, system, developer or "
                                     f"assistant, got {role!r}", f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where),
                                 "arguments": _field(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":  # calls of one turn: one message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":  # earlier thinking is not fed back (templates drop it)
            raise InvalidRequest(f"input item type {kind!r} is not supported",
                                 f"{where}.type")
    return out


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the assistant message that continues the chat."""
    text = "".join(c["text"] for item in output if item["type"] == "message"
                   for c in item["content"])
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    if not text and not calls:
        return []
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request a Responses request amounts to."""
    messages = ([{"role": "system", "content": body.instructions}]
                if body.instructions is not None else [])
    chat: dict[str, Any] = {"messages": messages + history + input_messages(body.input),
                            "stream": bool(body.stream), "temperature": body.temperature,
                            "top_p": body.top_p,
                            "max_completion_tokens": body.max_output_tokens,
                            "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        chat["tools"] = [{"type": "function",
                          "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    choice = body.tool_choice
    chat["tool_choice"] = choice if isinstance(choice, str) or choice is None else \
        {"type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "description": fmt.description, "schema": fmt.schema_,
            "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        loc = str(first["loc"][0]) if first.get("loc") else "input"
        raise InvalidRequest(f"{_PARAMS.get(loc, loc)}: {first['msg']}",
                             _PARAMS.get(loc, loc)) from None


def _envelope(body: ResponsesRequest, response_id: str, created: int,
              model: str) -> Any:
    """The response object's fields around a given output."""
    echo = {
        "instructions": body.instructions, "model": model,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str) else
                        body.tool_choice.model_dump() if body.tool_choice is not None else "auto"),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature, "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "text": ({"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
                 if body.text is not None and body.text.format is not None
                 else {"format": {"type": "text"}}),
        "metadata": body.metadata or {}, "store": body.store is not False,
        "reasoning": None, "truncation": "disabled", "error": None,
    }

    def envelope(status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                 incomplete: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": response_id, "object": "response", "created_at": created,
                "status": status, "incomplete_details": incomplete, "output": output,
                "usage": usage, **echo}

    return envelope


def register_responses(app: FastAPI, state: Any, features: Features,
                       request_id: Callable[[Request], str],
                       errors: dict[int | str, dict[str, Any]]) -> None:
    """Add ``POST /v1/responses`` and ``GET /v1/responses/{id}`` to ``app``
    (``request_id``: the app's reading of X-Request-Id)."""
    store = ResponseStore(features.store_size, features.store_ttl)

    @app.post("/v1/responses",
              responses={**errors, 200: {"content": {"text/event-stream": {}}}})
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API; ``stream: true`` answers with its typed events."""
        state.check_model(body.model)
        history = [] if body.previous_response_id is None else \
            store.get(body.previous_response_id)[1]
        chat_body = chat_request(body, history)
        base = request_id(request)
        try:
            chat = prepare_chat(chat_body, base, state, features)
        except InvalidRequest as exc:
            param = (exc.param or "").split("[")[0]
            raise InvalidRequest(str(exc), _PARAMS.get(param, exc.param)) from None
        response_id = base if base.startswith("resp_") else f"resp_{base}"
        chat_r = chat_renderer(chat, chat_body, response_id=response_id,
                               model=state.model_name, texts=state.texts,
                               reasoning=features.reasoning)
        conversation = history + input_messages(body.input)

        def keep(response: dict[str, Any]) -> None:
            if body.store is not False:
                store.put(response, conversation + output_messages(response["output"]))

        renderer = ResponsesRenderer(chat_r, _envelope(body, response_id, int(time.time()),
                                                       state.model_name), keep)
        return GenerationResponse(state, [chat.job], renderer, stream=bool(body.stream),
                                  include_usage=bool(body.stream), request_id=base,
                                  param_names=dict(_PARAMS))

    @app.get("/v1/responses/{response_id}", responses=errors)
    async def get_response(response_id: str) -> dict[str, Any]:
        """A stored response (404 when unknown or expired)."""
        return store.get(response_id)[0]
