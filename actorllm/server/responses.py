"""OpenAI's Responses API on the chat completions path: a request's conversion to chat.

The routes are in ``server/routes/responses.py``.

A request's ``input`` items (messages, ``function_call``, ``function_call_output``) and
``instructions`` become chat messages, its tools, ``tool_choice``, ``text.format`` and
sampling fields a :class:`ChatCompletionRequest`; from there it is a chat request
(``server/chat_request.py``): the same conversion, tools, reasoning and rendering, one
engine request. ``server/responses_stream.py`` shapes the output.

``store`` (the default) keeps each finished response (``server/response_store.py``), so a
later request can continue it with ``previous_response_id`` (its conversation, without
its ``instructions``, comes before the new input) or fetch it with ``GET
/v1/responses/{id}``; an unknown or expired id is a 404.
"""

from __future__ import annotations

from typing import Any

import pydantic

from actorllm.server.responses_schema import ResponsesRequest
from actorllm.server.schemas import ChatCompletionRequest
from actorllm.wire.messages import InvalidRequest

# Chat names of the fields a Responses request spells otherwise.
PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
          "messages": "input", "response_format": "text.format"}


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
        raise InvalidRequest(f"{PARAMS.get(loc, loc)}: {first['msg']}",
                             PARAMS.get(loc, loc)) from None


def envelope_of(body: ResponsesRequest, response_id: str, created: int,
                model: str) -> Any:
    """The response object around a given output: ``envelope(status, output, usage,
    incomplete)``, the request's settings echoed as OpenAI does."""
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
