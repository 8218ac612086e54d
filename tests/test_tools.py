"""Tool-call parsers and the streamed tool calls, without a model (``server/tools.py``).

A model-driven test (tests/test_structured.py) covers forced calls; the parsers of
``tool_choice: auto`` read free text, which the embedded model never writes as calls,
so here they get text written by hand. Every stream is cut at every position, and what
the official ``openai`` client reassembles must equal the whole answer's parse.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import stream_chat
from openai.types.chat import ChatCompletion

from actorllm.server.render import ChatRenderer
from actorllm.server.schemas import ChatCompletionRequest
from actorllm.server.tools import PARSERS, plan_tools
from actorllm.wire.outputs import CompletionOutput

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "g"}}]

HERMES = ('Let me look. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n'
          '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
JSON = ' [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]'


def _plan(parser: str, **kw: Any) -> Any:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **kw})
    return plan_tools(body, parser)


@pytest.mark.parametrize(("parser", "text", "content"), [
    ("hermes", HERMES, "Let me look."), ("json", JSON, None)])
def test_parsers_find_the_calls(parser: str, text: str, content: str | None) -> None:
    got, calls = PARSERS[parser].parse(text)
    assert got == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("parser", ["hermes", "json"])
@pytest.mark.parametrize("text", [
    "Plain words, no call.", "[1, 2, 3]", '<tool_call>{"name": 3}</tool_call>',
    "<tool_call>not json", "a < b and [c]", ""])
def test_text_that_is_not_a_call_stays_content(parser: str, text: str) -> None:
    assert PARSERS[parser].parse(text) == (text, [])


# Calls the scanner follows in other shapes, and JSON that turns out not to be calls.
ODD = [
    ("json", '[ { "name" : "f" , "arguments" : { "s": "a\\"}b", "l": [1, {"z": null}] } } ]'),
    ("json", '{"arguments": {"x": 1}, "name": "f"}'),  # a lone call, arguments first
    ("json", '[{"name": "g", "parameters": {"q": true}}]'),
    ("hermes", '<tool_call>[{"name": "f", "arguments": {"x": 2}}, {"name": "g", '
               '"arguments": {}}]</tool_call>'),
    ("json", "[1, 2]"), ("json", '{"foo": 1}'), ("json", '[{"name": "f", "arguments": 3}]'),
]


@pytest.mark.parametrize(("parser", "text"), [("hermes", HERMES), ("json", JSON),
                                              ("hermes", "No <tool_call here, a < b."),
                                              ("json", "Not a call [x]"), *ODD])
def test_streamed_calls_reassemble_to_the_whole_answer(parser: str, text: str) -> None:
    plan = _plan(parser)
    want_content, want_calls = plan.message(text)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text)) if cut == 0 else \
                ([text[:cut], text[cut:]],):
            completion, _ = stream_chat(plan, pieces)
            message = completion.choices[0].message
            calls = message.tool_calls or []
            assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
                [(c.name, json.loads(c.arguments)) for c in want_calls]
            assert (message.content or "").strip() == (want_content or "").strip()
            assert completion.choices[0].finish_reason == ("tool_calls" if want_calls
                                                           else "stop")


@pytest.mark.parametrize(("parser", "text", "choice"), [
    ("hermes", HERMES, "auto"), ("json", JSON, "auto"), ("hermes", JSON.strip(), "required")])
def test_arguments_stream_in_pieces_after_the_name(parser: str, text: str,
                                                   choice: str) -> None:
    # What the openai client expects: a call's first delta has its id, type and name, the
    # later ones only append to its arguments; and they come as the model writes them,
    # not all at the end.
    plan = _plan(parser, tool_choice=choice)
    completion, chunks = stream_chat(plan, list(text))
    seen: dict[int, list[dict[str, Any]]] = {}
    first_at: dict[int, int] = {}
    for at, chunk in enumerate(chunks):
        for delta in chunk["choices"][0]["delta"].get("tool_calls") or []:
            seen.setdefault(delta["index"], []).append(delta)
            first_at.setdefault(delta["index"], at)
    assert sorted(seen) == [0, 1]
    for deltas in seen.values():
        head, *rest = deltas
        assert head["id"].startswith("call_") and head["type"] == "function"
        assert head["function"]["name"] in ("f", "g")
        assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                   for d in rest)
    assert len(seen[0]) > 3  # '{"x": 1}' went out a few characters at a time
    # The first call went out before the second began, long before the end.
    assert first_at[0] < first_at[1] < len(chunks) - 1
    calls = completion.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("f", {"x": 1}), ("g", {})]


def test_content_before_a_call_streams_before_the_end() -> None:
    plan = _plan("hermes")
    _, chunks = stream_chat(plan, ["Let me ", "look. <tool", "_call>{", '"name": "g"',
                                   "}</tool_call>"])
    contents = [c["choices"][0]["delta"].get("content") for c in chunks[1:]]
    assert contents[:2] == ["Let me ", "look. "]  # "<tool" was held back, then never sent


def test_a_call_that_went_out_stays() -> None:
    # Streamed deltas cannot be taken back: text that breaks the block after a whole call
    # went out leaves that call (the whole answer, read at once, finds none), as in vLLM.
    text = '<tool_call>{"name": "f", "arguments": {"x": 1}} trailing</tool_call>'
    assert _plan("hermes").message(text) == (text, [])
    completion, _ = stream_chat(_plan("hermes"), list(text))
    calls = completion.choices[0].message.tool_calls
    assert calls is not None and [(c.function.name, c.function.arguments) for c in calls] == \
        [("f", '{"x": 1}')]
    assert not completion.choices[0].message.content


def test_parallel_off_streams_only_the_first_call() -> None:
    plan = _plan("json", parallel_tool_calls=False)
    completion, _ = stream_chat(plan, list(JSON))
    calls = completion.choices[0].message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == ["f"]


def test_whole_answer_and_parallel_off() -> None:
    plan = _plan("hermes", parallel_tool_calls=False)
    renderer = ChatRenderer(response_id="chatcmpl-x", created=0, model="m", num_choices=1,
                            texts=None, logprobs=False, tools=plan)  # type: ignore[arg-type]
    renderer.choices[0].merged.add(CompletionOutput(0, HERMES, (1,), finish_reason="stop"))
    completion = ChatCompletion.model_validate(renderer.final({"prompt_tokens": 1,
                                                               "completion_tokens": 1,
                                                               "total_tokens": 2}))
    calls = completion.choices[0].message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == ["f"]


def test_forced_modes_constrain_the_output() -> None:
    required = _plan("hermes", tool_choice="required", parallel_tool_calls=False)
    assert required.structured is not None and required.structured.param == "tool_choice"
    schema = json.loads(required.structured.spec)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [a["properties"]["name"]["const"] for a in schema["items"]["anyOf"]] == ["f", "g"]
    named = _plan("json", tool_choice={"type": "function", "function": {"name": "g"}})
    assert named.mode == "named" and json.loads(named.structured.spec)["type"] == "object"
    none = _plan("json", tool_choice="none")
    assert none.structured is None and none.message(JSON) == (JSON, [])


@pytest.mark.parametrize(("text", "content"), [
    ('Let me look.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n'
     "That is all I need.", "Let me look.\nThat is all I need."),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> then '
     '<tool_call>{"name": "g", "arguments": {}}</tool_call> done', "then  done"),
])
def test_hermes_text_after_a_call_block_is_kept_as_content(text: str, content: str) -> None:
    # Decided: text outside the call blocks is the answer's content (before, between and
    # after them), never dropped; streamed, it arrives too, with the calls intact.
    plan = _plan("hermes")
    got, calls = plan.message(text)
    assert got == content
    assert [c.name for c in calls] == (["f"] if text.count("<tool_call>") == 1 else ["f", "g"])
    for cut in (list(text), [text]):
        completion, _ = stream_chat(plan, cut)
        message = completion.choices[0].message
        assert [c.function.name for c in message.tool_calls or []] == [c.name for c in calls]
        assert (message.content or "").strip().split() == content.split()
