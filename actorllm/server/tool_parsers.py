"""Tool-call parsers: the formats model families write calls in (``--tool-call-parser``).

Each parser reads calls out of a whole answer (``parse``) and tells the streaming reader
(``server/tool_stream.py``) where content ends and where the calls' JSON lies as the
text grows (``split``, ``regions``). The formats:

- ``json``: the answer is a JSON list of ``{"name", "arguments"}`` (the embedded model's
  template, and what ``tool_choice: required`` forces).
- ``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` after optional text.
- ``llama3_json``: Llama 3.x, ``{"name": ..., "parameters": {...}}`` (several separated by
  ``;``), optionally after ``<|python_tag|>``.
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` after optional
  text (``[TOOL_CALLS]`` is a special token: serve with ``skip_special_tokens: false``).
- ``pythonic``: Llama 3.2 / 4 style, ``[f(a=1), g(b="x")]`` (Python literals as
  arguments). Its calls are not JSON, so a stream sends them whole at the end.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from typing import Any, Protocol

import attrs


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


def _json_spans(text: str, at: int, sep: str) -> list[tuple[int, int]]:
    """The JSON objects or arrays from ``at`` on, separated by ``sep`` and whitespace; the
    last may still be open (its span then runs to the end of ``text``)."""
    spans: list[tuple[int, int]] = []
    i, n = at, len(text)
    while True:
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i >= n or text[i] not in "{[":
            return spans
        start, depth, in_str, esc = i, 0, False, False
        while i < n:
            c = text[i]
            if in_str:
                esc, in_str = (False, in_str) if esc else (c == "\\", c != '"')
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        if i >= n:
            spans.append((start, n))
            return spans
        i += 1
        spans.append((start, i))
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i >= n or text[i] != sep:
            return spans
        i += 1


class Llama3JsonParser:
    """Llama 3.x: ``{"name": "f", "parameters": {...}}``, several joined by ``;``, the
    whole answer (after ``<|python_tag|>`` when the model writes that tag)."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def _start(self, text: str) -> tuple[int, int] | None:
        """Where the content ends and the calls begin, or None when no call begins."""
        tag = text.find(self.TAG)
        if tag >= 0:
            return tag, tag + len(self.TAG)
        body = text.lstrip()
        return (0, len(text) - len(body)) if body.startswith("{") else None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        where = self._start(text)
        if where is None:
            return text, []
        spans = _json_spans(text, where[1], ";")
        if not spans or text[spans[-1][1]:].strip():
            return text, []
        calls: list[ToolCall] = []
        for start, end in spans:
            found = calls_from(_loads(text[start:end]))
            if not found:
                return text, []
            calls += found
        content = text[:where[0]].strip()
        return (content or None), calls

    def split(self, text: str) -> tuple[int, bool]:
        where = self._start(text)
        if where is not None:
            return where[0], True
        if not text.strip():
            return 0, False
        return len(text) - _partial_tail(text, self.TAG), False

    def regions(self, text: str) -> list[tuple[int, int]]:
        where = self._start(text)
        return [] if where is None else _json_spans(text, where[1], ";")

    def after_calls(self, text: str) -> str:
        return ""  # the calls end the answer (else parse keeps it all as content)


class MistralParser:
    """Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`` after optional text."""

    name = "mistral"
    TAG = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.TAG)
        if start < 0:
            return text, []
        calls = calls_from(_loads(text[start + len(self.TAG):].strip()))
        if not calls:
            return text, []
        content = text[:start].strip()
        return (content or None), calls

    def split(self, text: str) -> tuple[int, bool]:
        start = text.find(self.TAG)
        if start >= 0:
            return start, True
        return len(text) - _partial_tail(text, self.TAG), False

    def regions(self, text: str) -> list[tuple[int, int]]:
        start = text.find(self.TAG)
        return [] if start < 0 else [(start + len(self.TAG), len(text))]

    def after_calls(self, text: str) -> str:
        return ""  # the list ends the answer (else parse keeps it all as content)


class PythonicParser:
    """``[f(a=1), g(b="x")]``: a Python list of calls with literal keyword arguments,
    the whole answer (Llama 4 may wrap it in ``<|python_start|>...<|python_end|>``)."""

    name = "pythonic"
    _WRAP = re.compile(r"^\s*(?:<\|python_start\|>)?(.*?)(?:<\|python_end\|>)?\s*$", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        match = self._WRAP.match(text)
        body = match.group(1).strip() if match else ""
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError):
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            call = _python_call(node)
            if call is None:
                return text, []
            calls.append(call)
        return None, calls

    def split(self, text: str) -> tuple[int, bool]:
        body = text.lstrip()
        if not body:
            return 0, False
        if body.startswith("[") or body.startswith("<|python_start|>"):
            return 0, True
        if "<|python_start|>".startswith(body):
            return 0, False  # may still be the tag
        return len(text), False

    def regions(self, text: str) -> list[tuple[int, int]]:
        return []  # not JSON: the calls go out whole when the answer ends

    def after_calls(self, text: str) -> str:
        return ""  # the list is the whole answer


def _python_call(node: ast.expr) -> ToolCall | None:
    """``f(a=1, b="x")`` -> a call; None for anything else (positional arguments, names)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        return None
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        arguments = json.dumps(args, ensure_ascii=False)
    except (TypeError, ValueError):  # a set, bytes or complex number: not JSON
        return None
    return ToolCall(node.func.id, arguments)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


PARSERS: dict[str, ToolParser] = {p.name: p for p in (
    JsonListParser(), HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser())}
