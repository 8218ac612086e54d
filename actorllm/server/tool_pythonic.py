"""The ``pythonic`` tool-call format (Llama 3.2 / 4): ``[f(a=1), g(b="x")]``.

The answer is a Python list of calls with literal keyword arguments (Llama 4 may wrap it
in ``<|python_start|>...<|python_end|>``). Its arguments are Python, not JSON, so a
stream cannot pass them on as the model writes them: each call goes out as soon as its
name is written and its first keyword has begun (``f(a=``), and its arguments, as one
JSON object, when its closing parenthesis comes.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from actorllm.server.tool_call import PartialCall, ToolCall

_START = "<|python_start|>"
_OPEN = re.compile(r"\s*(?:<\|python_start\|>)?\s*\[")
# A call's name and opening parenthesis, then how it goes on: a keyword or the close.
_HEAD = re.compile(r"\s*([A-Za-z_]\w*)\s*\(\s*(?:([A-Za-z_]\w*)\s*=|(\)))?")
_QUOTES = "'\""


class PythonicParser:
    """``[f(a=1), g(b="x")]``: a Python list of calls with literal keyword arguments,
    the whole answer."""

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
        if body.startswith("[") or body.startswith(_START):
            return 0, True
        if _START.startswith(body):
            return 0, False  # may still be the tag
        return len(text), False

    def regions(self, text: str) -> list[tuple[int, int]]:
        return []  # not JSON: partial_calls says what each call is so far

    def after_calls(self, text: str) -> str:
        return ""  # the list is the whole answer

    def partial_calls(self, text: str) -> list[PartialCall] | None:
        opened = _OPEN.match(text)
        if opened is None:
            return []
        found: list[PartialCall] = []
        at = opened.end()
        while True:
            head = _HEAD.match(text, at)
            if head is None or head.group(2, 3) == (None, None):
                return found  # no call here, or not known yet to be one
            name = head.group(1)
            end = _closing(text, head.end(1))
            call = None if end is None else _parsed_call(text[head.start(1):end])
            if call is None:  # open, or closed but not a call: its arguments never come
                return [*found, PartialCall(name, "", False)]
            found.append(PartialCall(name, call.arguments, True))
            at = end + len(text[end:]) - len(text[end:].lstrip())
            if not text.startswith(",", at):
                return found
            at += 1


def _closing(text: str, at: int) -> int | None:
    """One past the parenthesis that closes the one at or after ``at`` (None: not yet),
    skipping brackets and quotes in between (a triple quote reads as three strings, which
    is enough to find the end)."""
    depth, quote, escaped = 0, "", False
    for i in range(at, len(text)):
        c = text[i]
        if quote:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = ""
        elif c in _QUOTES:
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _parsed_call(source: str) -> ToolCall | None:
    try:
        return _python_call(ast.parse(source, mode="eval").body)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None


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
