"""Tool calling for ``/v1/chat/completions``: what the request asks, and calls read back.

``tool_choice`` decides how the output is made and read (as vLLM does):

- ``none``: plain text; nothing is parsed.
- ``auto`` (the default with tools): the model writes freely and the server's tool-call
  parser (``--tool-call-parser``) finds calls in the text.
- ``required``: structured output forces a JSON list of ``{"name", "arguments"}`` objects,
  one per call (one at most without ``parallel_tool_calls``), each matching its tool's
  schema; the list is read back as the calls.
- a named function: structured output forces that function's ``parameters`` schema; the
  whole output is the call's arguments.

A parser is the format one family of models writes calls in. Two ship: ``json`` (the
embedded model's template: the answer is a JSON list of ``{"name", "arguments"}``) and
``hermes`` (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, many open models).
Streaming reads the calls as they form (``server/tool_stream.py``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Protocol

import attrs

from actorllm.server.schemas import ChatCompletionRequest, NamedToolChoice, ToolDef
from actorllm.wire.messages import InvalidRequest, StructuredOutput


@attrs.frozen
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = attrs.field(factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def calls_from(items: Any) -> list[ToolCall] | None:
    """``[{"name": str, "arguments": object}, ...]`` -> calls; None for anything else."""
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls


class ToolParser(Protocol):
    """Reads tool calls out of a model's text, whole or as it streams."""

    name: str

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content left and the calls found (none: the whole text is content)."""

    def split(self, text: str) -> tuple[int, bool]:
        """Streaming: how much of ``text`` (all the output so far) is surely content, and
        whether a call may have begun (then the rest is read as calls, never content,
        unless it turns out at the end that there were none)."""

    def regions(self, text: str) -> list[tuple[int, int]]:
        """Streaming: the spans of ``text`` (all the output so far) that hold the calls'
        JSON, in order; the last may still be growing (its end is how far it is sure)."""

    def after_calls(self, text: str) -> str:
        """Text after the first call that is in no call (content that ``parse`` keeps, and
        a stream sends at its end)."""


class JsonListParser:
    """The answer is a JSON list of calls (a lone call object too), and nothing else."""

    name = "json"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body[:1] in ("[", "{"):
            try:
                calls = calls_from(json.loads(body))
            except ValueError:
                calls = None
            if calls:
                return None, calls
        return text, []

    def split(self, text: str) -> tuple[int, bool]:
        body = text.lstrip()
        if not body:
            return 0, False  # only whitespace yet: it may still open a list
        if body[0] in "[{":
            return 0, True
        return len(text), False

    def regions(self, text: str) -> list[tuple[int, int]]:
        return [(0, len(text))]

    def after_calls(self, text: str) -> str:
        return ""  # the answer is the list and nothing else


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, after optional text.

    Text outside the blocks (before the first, between them, after the last) is the
    answer's content: a model may say something after its calls, and dropping that
    without a word would lose it.
    """

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.OPEN)
        if start < 0:
            return text, []
        calls: list[ToolCall] = []
        for block in self._BLOCK.findall(text[start:]):
            try:
                found = calls_from(json.loads(block.strip()))
            except ValueError:
                found = None
            if not found:
                return text, []  # a malformed call: the text stays the answer
            calls += found
        content = (text[:start] + self.after_calls(text)).strip()
        return (content or None), calls

    def after_calls(self, text: str) -> str:
        start = text.find(self.OPEN)
        return "" if start < 0 else self._BLOCK.sub("", text[start:])

    def split(self, text: str) -> tuple[int, bool]:
        start = text.find(self.OPEN)
        if start >= 0:
            return start, True
        # Hold back a tail that may be the beginning of "<tool_call>".
        return len(text) - _partial_tail(text, self.OPEN), False

    def regions(self, text: str) -> list[tuple[int, int]]:
        # The blocks ``parse`` reads: each from "<tool_call>" to the next "</tool_call>".
        out = []
        at = text.find(self.OPEN)
        while at >= 0:
            start = at + len(self.OPEN)
            close = text.find(self.CLOSE, start)
            if close < 0:  # still open: its end may be the beginning of "</tool_call>"
                out.append((start, len(text) - _partial_tail(text, self.CLOSE)))
                break
            out.append((start, close))
            at = text.find(self.OPEN, close + len(self.CLOSE))
        return out


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that ``tag`` begins with (not all of it)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


PARSERS: dict[str, ToolParser] = {p.name: p for p in (JsonListParser(), HermesParser())}


@attrs.frozen
class ToolPlan:
    """What a request's tools mean for its prompt, its constraint and its output."""

    mode: str  # "none", "auto", "required", "named"
    tools_json: str  # the tool definitions handed to the chat template
    parser: ToolParser
    function: str | None = None  # mode "named"
    parallel: bool = True
    structured: StructuredOutput | None = None

    def call_parser(self) -> ToolParser:
        """The format of the calls: ``required`` forces the JSON list, whatever the model's."""
        return PARSERS["json"] if self.mode == "required" else self.parser

    def message(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer's ``content`` and ``tool_calls``."""
        if self.mode == "named":
            assert self.function is not None
            return None, [ToolCall(self.function, text)]
        if self.mode == "none":
            return text, []
        content, calls = self.call_parser().parse(text)
        return content, calls if self.parallel else calls[:1]


def _function_schema(params: dict[str, Any] | None) -> dict[str, Any]:
    return params if params else {"type": "object", "properties": {}}


def template_tools(tools: list[ToolDef]) -> str:
    """The tool definitions for the chat template, as JSON (the HF convention: each
    ``{"type": "function", "function": {...}}``); InvalidRequest for repeated names."""
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: function names must be unique", "tools")
    return json.dumps([t.model_dump(exclude_none=True) for t in tools], ensure_ascii=False)


def plan_tools(body: ChatCompletionRequest, parser: str) -> ToolPlan | None:
    """The request's tool plan, or None when it has no tools. Raises InvalidRequest."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise InvalidRequest("tool_choice needs tools", "tool_choice")
        return None
    tools = [t.function for t in body.tools]
    names = [f.name for f in tools]
    tools_json = template_tools(body.tools)
    parallel = body.parallel_tool_calls is not False
    mode = "auto" if choice is None else choice if isinstance(choice, str) else "named"
    if mode in ("none", "auto"):
        return ToolPlan(mode, tools_json, PARSERS[parser], parallel=parallel)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequest(f"tool_choice: no tool is named {choice.function.name!r}",
                                 "tool_choice")
        fn = tools[names.index(choice.function.name)]
        spec = json.dumps(_function_schema(fn.parameters))
        return ToolPlan("named", tools_json, PARSERS[parser], function=fn.name,
                        parallel=parallel,
                        structured=StructuredOutput("json", spec, "tool_choice"))
    call = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f.name}, "arguments": _function_schema(f.parameters)},
        "required": ["name", "arguments"], "additionalProperties": False} for f in tools]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return ToolPlan("required", tools_json, PARSERS[parser], parallel=parallel,
                    structured=StructuredOutput("json", json.dumps(schema), "tool_choice"))
