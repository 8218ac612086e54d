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

A parser is the format one family of models writes calls in (``server/tool_parsers.py``:
``json``, ``hermes``, ``llama3_json``, ``mistral``, ``pythonic``). Streaming reads the calls
as they form (``server/tool_stream.py``).

A tool's schema may use ``$defs``/``$ref`` (``openai.pydantic_function_tool`` writes them
for enums and nested models). The ``required`` grammar nests every tool's schema in one
document, where ``#/$defs/...`` would no longer resolve, so each tool's definitions are
hoisted to the root under the tool's name and its references rewritten (``hoist_refs``).
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from actorllm.server.schemas import ChatCompletionRequest, NamedToolChoice, ToolDef
from actorllm.server.tool_parsers import PARSERS, ToolCall, ToolParser, calls_from
from actorllm.wire.messages import InvalidRequest, StructuredOutput

# Re-exported: the parsers lived here first.
__all__ = ["PARSERS", "ToolCall", "ToolParser", "ToolPlan", "calls_from", "plan_tools",
           "template_tools"]


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
    defs: dict[str, Any] = {}
    call = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f.name}, "arguments": hoist_refs(_function_schema(f.parameters),
                                                           f.name, defs)},
        "required": ["name", "arguments"], "additionalProperties": False} for f in tools]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return ToolPlan("required", tools_json, PARSERS[parser], parallel=parallel,
                    structured=StructuredOutput("json", json.dumps(schema), "tool_choice"))


_DEF_KEYS = ("$defs", "definitions")


def hoist_refs(schema: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` made fit to sit anywhere inside a larger document whose root ``$defs``
    is ``defs``: its own definitions move there as ``{prefix}.{name}``, and its local
    references (``#/$defs/X``, ``#/definitions/X``, or any other ``#...`` pointer, which
    then points into a copy of the whole schema kept as ``defs[prefix]``) are rewritten.
    A schema without local references comes back as it is."""
    if not _has_local_ref(schema):
        return schema
    body = {k: v for k, v in schema.items() if k not in _DEF_KEYS}
    whole = False

    def ref(target: str) -> str:
        nonlocal whole
        parts = target[1:].split("/")
        if len(parts) >= 3 and parts[1] in _DEF_KEYS and parts[0] == "":
            return "#/$defs/" + "/".join([f"{prefix}.{parts[2]}", *parts[3:]])
        whole = True  # a pointer into the schema itself: it needs a home under $defs
        return f"#/$defs/{prefix}" + target[1:]

    for key in _DEF_KEYS:
        for name, sub in (schema.get(key) or {}).items():
            defs[f"{prefix}.{name}"] = _rewrite(sub, ref)
    body = _rewrite(body, ref)
    if whole:
        defs[prefix] = body
        return {"$ref": f"#/$defs/{prefix}"}
    return body


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, dict):
        target = node.get("$ref")
        if isinstance(target, str) and target.startswith("#"):
            return True
        return any(_has_local_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_local_ref(v) for v in node)
    return False


def _rewrite(node: Any, ref: Any) -> Any:
    """A copy of ``node`` with each local ``$ref`` string mapped through ``ref``."""
    if isinstance(node, dict):
        out = {k: _rewrite(v, ref) for k, v in node.items()}
        target = node.get("$ref")
        if isinstance(target, str) and target.startswith("#"):
            out["$ref"] = ref(target)
        return out
    if isinstance(node, list):
        return [_rewrite(v, ref) for v in node]
    return node
