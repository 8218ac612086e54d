"""What every tool-call parser shares: a call, the parser's interface, and the scanning
helpers (``server/tool_parsers.py`` holds the formats, ``server/tool_pythonic.py`` the
Python one)."""

from __future__ import annotations

import json
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


@attrs.frozen
class PartialCall:
    """A call as far as a stream has it: its name is whole, its ``arguments`` are the text
    sure so far (it only grows: raw JSON as the model writes it, or empty until the call
    closes and then the whole object); ``done``: nothing more comes for it."""

    name: str
    arguments: str
    done: bool


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

    def partial_calls(self, text: str) -> list[PartialCall] | None:
        """Streaming, for formats whose calls are not JSON call objects: the calls begun in
        ``text`` so far, in order. None: follow ``regions`` with the JSON call scanner."""


def partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that ``tag`` begins with (not all of it)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


def json_spans(text: str, at: int, sep: str) -> list[tuple[int, int]]:
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


def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
