"""The tool-call parsers of each model family, and ``$defs`` in forced tool schemas (issue 31).

Each parser gets text in its family's exact format, read whole and streamed (cut at
every position and a character at a time), and the calls the official ``openai``
client rebuilds from the stream must equal the whole answer's. ``hoist_refs`` is checked
by compiling the ``required`` grammar of schemas that ``openai.pydantic_function_tool``
writes and matching calls against it.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import jsonschema
import openai
import pytest
from helpers import stream_chat
from pydantic import BaseModel

from actorllm.server.schemas import ChatCompletionRequest
from actorllm.server.tool_stream import ToolStream
from actorllm.server.tools import PARSERS, hoist_refs, plan_tools

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]

# (parser, text as the family writes it, the content, the calls)
CASES = [
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}', None, [("f", {"x": 1})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; '
                    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     None, [("f", {"x": 1}), ("get_weather", {"city": "Paris"})]),
    ("llama3_json", 'Checking.<|python_tag|>{"name": "get_weather", "parameters": '
                    '{"city": "a;b}"}}', "Checking.", [("get_weather", {"city": "a;b}"})]),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, '
                '{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     None, [("f", {"x": 1}), ("get_weather", {"city": "Paris"})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": 2}}]', "Sure.",
     [("f", {"x": 2})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1}', None, [("f", {"x": 1})]),
    ("mistral", 'Sure.[TOOL_CALLS]f[ARGS]{"x": 2}[TOOL_CALLS]get_weather[ARGS]'
                '{"city": "a[ARGS]}[TOOL_CALLS]"}', "Sure.",
     [("f", {"x": 2}), ("get_weather", {"city": "a[ARGS]}[TOOL_CALLS]"})]),
    ("pythonic", '[f(x=1), get_weather(city="San Francisco")]', None,
     [("f", {"x": 1}), ("get_weather", {"city": "San Francisco"})]),
    ("pythonic", "<|python_start|>[get_weather(city='Paris, \"FR\"')]<|python_end|>", None,
     [("get_weather", {"city": 'Paris, "FR"'})]),
    ("pythonic", "[f(x=[1, {'a': None, 'b': True}])]", None,
     [("f", {"x": [1, {"a": None, "b": True}]})]),
]

NOT_CALLS = [
    ("llama3_json", "The answer is {x}."), ("llama3_json", '{"name": "f"} trailing'),
    ("llama3_json", "{not json"), ("mistral", "[TOOL_CALLS] nope"),
    ("mistral", "plain [words]"), ("mistral", '[TOOL_CALLS]f{"x": 1}'),
    ("mistral", "[TOOL_CALLS]f[ARGS][1]"), ("mistral", "[TOOL_CALLS]f [ARGS] nope"),
    ("pythonic", "[1, 2]"), ("pythonic", "[f(1)]"),
    ("pythonic", "[f(x=y)]"), ("pythonic", "Some words [f(x=1)]"), ("pythonic", "[f(x=1"),
]


def _plan(parser: str, **kw: Any) -> Any:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **kw})
    return plan_tools(body, parser)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_answer(parser: str, text: str, content: str | None,
                      calls: list[tuple[str, Any]]) -> None:
    got_content, got = PARSERS[parser].parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize(("parser", "text"), NOT_CALLS)
def test_text_that_is_not_calls_stays_content(parser: str, text: str) -> None:
    assert PARSERS[parser].parse(text) == (text, [])
    completion, _ = stream_chat(_plan(parser), list(text))
    message = completion.choices[0].message
    if parser == "llama3_json" and text.startswith('{"name"'):
        return  # a whole call object went out before the trailing text: it stays
    if parser == "pythonic" and text.startswith("[f(x="):
        # The name went out when the keyword began; what went out stays (as in vLLM),
        # and the arguments that never parsed do not follow.
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] \
            == [("f", "")]
        return
    assert not message.tool_calls and message.content == text


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_calls_reassemble(parser: str, text: str, content: str | None,
                                   calls: list[tuple[str, Any]]) -> None:
    plan = _plan(parser)
    cuts = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        completion, _ = stream_chat(plan, pieces)
        choice = completion.choices[0]
        got = choice.message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls
        assert (choice.message.content or "").strip() == (content or "")
        assert choice.finish_reason == "tool_calls"
        if content is None:
            assert choice.message.content is None  # the opening delta's content is null


@pytest.mark.parametrize(("parser", "text"), [
    (p, t) for p, t, _, c in CASES if p in ("llama3_json", "mistral") and len(c) == 2])
def test_json_families_stream_arguments_in_pieces(parser: str, text: str) -> None:
    _, chunks = stream_chat(_plan(parser), list(text))
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
    first = [d for d in deltas if d["index"] == 0]
    assert first[0]["function"]["name"] == "f" and len(first) > 3


def _when(parser: str, text: str) -> tuple[dict[int, int], dict[int, int]]:
    """Fed a character at a time: after how many characters each call's header went out,
    and each call's last piece of arguments."""
    stream = ToolStream(_plan(parser))
    heads: dict[int, int] = {}
    args: dict[int, int] = {}
    for n in range(1, len(text) + 1):
        for delta in stream.feed(text[n - 1])[1]:
            if "id" in delta:
                heads[delta["index"]] = n
            if delta["function"].get("arguments"):
                args[delta["index"]] = n
    return heads, args


def test_pythonic_calls_go_out_as_they_form() -> None:
    text = '[f(x=1), get_weather(city="San (Francisco)")]'
    heads, args = _when("pythonic", text)
    assert heads == {0: len("[f(x="), 1: len("[f(x=1), get_weather(city=")}
    assert args == {0: len("[f(x=1)"), 1: len(text) - 1}  # each at its ")", not the "]"


def test_mistral_named_calls_go_out_as_they_form() -> None:
    text = '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]get_weather[ARGS]{"city": "P"}'
    heads, args = _when("mistral", text)
    assert heads == {0: len("[TOOL_CALLS]f[ARGS]{"),
                     1: len('[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]get_weather[ARGS]{')}
    assert args == {0: len('[TOOL_CALLS]f[ARGS]{"x": 1}'), 1: len(text)}


class Color(StrEnum):
    red = "red"
    blue = "blue"


class Size(BaseModel):
    width: int
    height: int


class Paint(BaseModel):
    color: Color
    size: Size


class Node(BaseModel):
    label: str
    children: list[Node]


def test_hoisted_definitions_keep_their_meaning() -> None:
    tools = [openai.pydantic_function_tool(Paint), openai.pydantic_function_tool(Node),
             {"type": "function", "function": {"name": "p", "parameters": {
                 "type": "object", "properties": {"a": {"$ref": "#/properties/b"},
                                                  "b": {"type": "integer"}}}}}]
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "tools": tools,
        "tool_choice": "required"})
    schema = json.loads(plan_tools(body, "json").structured.spec)
    good = [{"name": "Paint", "arguments": {"color": "red",
                                            "size": {"width": 1, "height": 2}}},
            {"name": "Node", "arguments": {"label": "a", "children": [
                {"label": "b", "children": []}]}},
            {"name": "p", "arguments": {"a": 1}}]
    jsonschema.validate(good, schema)  # the references resolve in the combined document
    for bad in ({"name": "Paint", "arguments": {"color": "green",
                                                "size": {"width": 1, "height": 2}}},
                {"name": "Node", "arguments": {"label": "a", "children": [{"label": 1}]}},
                {"name": "p", "arguments": {"a": "x"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], schema)


def test_a_schema_without_references_is_left_alone() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    defs: dict[str, Any] = {}
    assert hoist_refs(schema, "f", defs) is schema and defs == {}


def test_the_required_grammar_compiles_with_definitions() -> None:
    from actorllm.config import default_model_dir
    from actorllm.text.hf import load_hf_tokenizer
    from actorllm.text.structured import LLGuidanceBackend, _grammar_text

    tools = [openai.pydantic_function_tool(Paint), openai.pydantic_function_tool(Node)]
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "tools": tools,
        "tool_choice": "required"})
    spec = plan_tools(body, "json").structured
    tok = load_hf_tokenizer(str(default_model_dir()))
    backend = LLGuidanceBackend(tok, len(tok), [tok.eos_token_id])
    backend.check(spec)
    import llguidance

    for text, ok in (('[{"name": "Paint", "arguments": {"color": "blue", "size": '
                      '{"width": 3, "height": 4}}}]', True),
                     ('[{"name": "Paint", "arguments": {"color": "green"', False)):
        matcher = llguidance.LLMatcher(backend._tokenizer(), _grammar_text(spec), log_level=0)
        consumed = matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
        assert bool(consumed and matcher.is_accepting()) == ok
