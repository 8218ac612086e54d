"""Streamed tool calls through a real server and the official ``openai`` client (issue 16).

The embedded model never writes a tool call by itself, so for ``tool_choice: auto`` its
text is forced into each parser's format with a regex (vLLM's ``structured_outputs``):
what is tested is the server's reading of that text as it streams, as the client sees it.
``required`` is forced by the server's own grammar. The client's ``stream()`` helper
rebuilds the calls from the deltas and parses their arguments (strict tools), and its
events show whether the arguments arrived piece by piece.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from test_server import ServerProcess

from actorllm.config import default_model_dir

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "strict": True, "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}

_CALLS = (r'\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,6}", '
          r'"unit": "(c|f)"\}\}', r'\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}')
# What a model trained on each format would write, as a regex over the whole answer.
FORMATS = {
    "json": r"\[" + ", ".join(_CALLS) + r"\]",
    "hermes": r"Let me check\. " + "\n".join(f"<tool_call>{c}</tool_call>" for c in _CALLS),
}


@pytest.fixture(scope="module", params=["json", "hermes"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, openai.OpenAI]]:
    parser = request.param
    # No write pacing (server/pacing.py): on a slow host it may hold a reader while the
    # whole call is generated, and the arguments then arrive merged into one piece; what
    # is tested here is the parser's streaming, not when the writes happen.
    srv = ServerProcess(Path(default_model_dir()), "--tool-call-parser", parser,
                        "--served-model-name", "m", "--max-stream-hold", "0",
                        log_dir=tmp_path_factory.mktemp(parser))
    for ready in srv.serve_module():
        yield parser, openai.OpenAI(base_url=ready.url + "/v1", api_key="x", max_retries=0,
                                    timeout=120)


def _stream(client: openai.OpenAI, **kw: Any) -> tuple[Any, dict[int, int]]:
    """The client's final completion and how many argument deltas each call had."""
    pieces: dict[int, int] = {}
    with client.chat.completions.stream(
            model="m", messages=[{"role": "user", "content": "Weather and time in Paris?"}],
            tools=[WEATHER, TIME], max_tokens=120, seed=1, **kw) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces[event.index] = pieces.get(event.index, 0) + 1
        return stream.get_final_completion(), pieces


def _check(completion: Any, names: list[str]) -> None:
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == names
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        assert call.function.parsed_arguments == args  # the client parsed them too
    assert len({c.id for c in calls}) == len(calls)


def test_auto_calls_stream_through_the_client(served: tuple[str, openai.OpenAI]) -> None:
    parser, client = served
    completion, pieces = _stream(client, tool_choice="auto",
                                 extra_body={"structured_outputs": {"regex": FORMATS[parser]}})
    _check(completion, ["get_weather", "get_time"])
    content = completion.choices[0].message.content
    assert (content or "").strip() == ("Let me check." if parser == "hermes" else "")
    assert pieces[0] > 1 and pieces[1] > 1, pieces  # arguments arrived piece by piece


def test_required_calls_stream_through_the_client(served: tuple[str, openai.OpenAI]) -> None:
    _, client = served
    completion, pieces = _stream(client, tool_choice="required", parallel_tool_calls=False)
    choice = completion.choices[0]
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    _check(completion, [choice.message.tool_calls[0].function.name])
    assert pieces[0] > 1, pieces
    # Not streamed, the same request gives the same call (greedy: same seed, same text).
    whole = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather and time in Paris?"}],
        tools=[WEATHER, TIME], max_tokens=120, seed=1, tool_choice="required",
        parallel_tool_calls=False)
    (call,) = whole.choices[0].message.tool_calls or []
    streamed = choice.message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == \
        (streamed.function.name, streamed.function.arguments)


class Color(StrEnum):
    red = "red"
    blue = "blue"


class Size(BaseModel):
    width: int
    height: int


class Paint(BaseModel):
    """Paint a rectangle."""

    color: Color
    size: Size


def test_required_with_pydantic_tool_definitions(served: tuple[str, openai.OpenAI]) -> None:
    # pydantic_function_tool writes the enum and the nested model as $defs + $ref, which
    # must resolve inside the grammar that forces the list of calls (issue 31).
    _, client = served
    kw: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Paint"}],
                          "tools": [openai.pydantic_function_tool(Paint)],
                          "tool_choice": "required", "parallel_tool_calls": False,
                          "max_tokens": 80, "seed": 1}
    whole = client.chat.completions.create(**kw)
    (call,) = whole.choices[0].message.tool_calls or []
    assert call.function.name == "Paint"
    Paint.model_validate_json(call.function.arguments)
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content is None  # the stream opened with content: null, none followed
    (streamed,) = message.tool_calls or []
    assert isinstance(streamed.function.parsed_arguments, Paint)  # the client's own parse
    assert streamed.function.arguments == call.function.arguments
