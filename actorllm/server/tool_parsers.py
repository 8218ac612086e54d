"""Tool-call parsers: the formats model families write calls in (``--tool-call-parser``).

Each parser reads calls out of a whole answer (``parse``) and tells the streaming reader
(``server/tool_stream.py``) where content ends and where the calls' JSON lies as the
text grows (``split``, ``regions``). The formats:

- ``json``: the answer is a JSON list of ``{"name", "arguments"}`` (the embedded model's
  template, and what ``tool_choice: required`` forces).
- ``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` after optional text.
- ``llama3_json``: Llama 3.x, ``{"name": ..., "parameters": {...}}`` (several separated by
  ``;``), optionally after ``<|python_tag|>``.
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (older models) or
  ``[TOOL_CALLS]name[ARGS]{...}`` once per call (v11+ tokenizers), after optional text
  (``[TOOL_CALLS]`` is a special token: serve with ``skip_special_tokens: false``).
- ``pythonic``: Llama 3.2 / 4 style, ``[f(a=1), g(b="x")]`` (Python literals as
  arguments, ``server/tool_pythonic.py``). Its arguments are not JSON: a stream sends
  each call's name as soon as it is written, its arguments when the call closes.

Formats whose calls are JSON call objects tell the stream where that JSON lies
(``regions``); the others say what each call is so far (``partial_calls``).
"""

from __future__ import annotations

import json
import re

from actorllm.server.tool_call import (
    PartialCall,
    ToolCall,
    ToolParser,
    calls_from,
    json_spans,
    loads,
    partial_tail,
)
from actorllm.server.tool_pythonic import PythonicParser

__all__ = ["PARSERS", "PartialCall", "ToolCall", "ToolParser", "calls_from"]


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

    def partial_calls(self, text: str) -> list[PartialCall] | None:
        return None  # JSON call objects: the call scanner follows them


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

    def partial_calls(self, text: str) -> list[PartialCall] | None:
        return None  # JSON call objects: the call scanner follows them

    def split(self, text: str) -> tuple[int, bool]:
        start = text.find(self.OPEN)
        if start >= 0:
            return start, True
        # Hold back a tail that may be the beginning of "<tool_call>".
        return len(text) - partial_tail(text, self.OPEN), False

    def regions(self, text: str) -> list[tuple[int, int]]:
        # The blocks ``parse`` reads: each from "<tool_call>" to the next "</tool_call>".
        out = []
        at = text.find(self.OPEN)
        while at >= 0:
            start = at + len(self.OPEN)
            close = text.find(self.CLOSE, start)
            if close < 0:  # still open: its end may be the beginning of "</tool_call>"
                out.append((start, len(text) - partial_tail(text, self.CLOSE)))
                break
            out.append((start, close))
            at = text.find(self.OPEN, close + len(self.CLOSE))
        return out


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
        spans = json_spans(text, where[1], ";")
        if not spans or text[spans[-1][1]:].strip():
            return text, []
        calls: list[ToolCall] = []
        for start, end in spans:
            found = calls_from(loads(text[start:end]))
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
        return len(text) - partial_tail(text, self.TAG), False

    def regions(self, text: str) -> list[tuple[int, int]]:
        where = self._start(text)
        return [] if where is None else json_spans(text, where[1], ";")

    def after_calls(self, text: str) -> str:
        return ""  # the calls end the answer (else parse keeps it all as content)
    def partial_calls(self, text: str) -> list[PartialCall] | None:
        return None  # JSON call objects: the call scanner follows them


class MistralParser:
    """Mistral, after optional text, in either of its formats: the JSON list of older
    models, ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, or that of the
    v11+ tokenizers, ``[TOOL_CALLS]name[ARGS]{...}`` once per call."""

    name = "mistral"
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    _NAME = re.compile(r"\s*([\w.\-]+)\s*\[ARGS\]")

    def _listed(self, text: str, at: int) -> bool | None:
        """Whether the calls after the tag at ``at`` are the JSON list (None: not known yet)."""
        body = text[at:].lstrip()
        return None if not body else body[0] in "[{"

    def _named(self, text: str, at: int) -> tuple[list[tuple[str, int, int]], bool]:
        """The ``name[ARGS]{...}`` calls from ``at`` (just past a tag): (name, where its
        arguments begin, how far they reach) each, the last maybe still open; and whether
        the text is all calls so far (False: something else follows one)."""
        found: list[tuple[str, int, int]] = []
        while True:
            match = self._NAME.match(text, at)
            if match is None:
                return found, False
            spans = json_spans(text, match.end(), "\0")
            if not spans or text[spans[0][0]] != "{":  # (a call goes out once its
                return found, False  # arguments object has begun, as in the JSON formats)
            start, end = spans[0]
            found.append((match.group(1), start, end))
            if not isinstance(loads(text[start:end]), dict):
                return found, False  # still open (or not an object)
            at = end + len(text[end:]) - len(text[end:].lstrip())
            if at == len(text):
                return found, True
            if not text.startswith(self.TAG, at):
                return found, False
            at += len(self.TAG)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.TAG)
        if start < 0:
            return text, []
        at = start + len(self.TAG)
        if self._listed(text, at):
            calls = calls_from(loads(text[at:].strip())) or []
        else:
            named, whole = self._named(text, at)
            calls = [ToolCall(name, json.dumps(loads(text[a:b]), ensure_ascii=False))
                     for name, a, b in named] if whole else []
        if not calls:
            return text, []
        content = text[:start].strip()
        return (content or None), calls

    def split(self, text: str) -> tuple[int, bool]:
        start = text.find(self.TAG)
        if start >= 0:
            return start, True
        return len(text) - partial_tail(text, self.TAG), False

    def regions(self, text: str) -> list[tuple[int, int]]:
        start = text.find(self.TAG)
        return [] if start < 0 else [(start + len(self.TAG), len(text))]

    def after_calls(self, text: str) -> str:
        return ""  # the calls end the answer (else parse keeps it all as content)

    def partial_calls(self, text: str) -> list[PartialCall] | None:
        start = text.find(self.TAG)
        if start < 0:
            return []
        at = start + len(self.TAG)
        listed = self._listed(text, at)
        if listed:
            return None  # the JSON list: the call scanner follows it
        if listed is None:
            return []
        named, _ = self._named(text, at)
        return [PartialCall(name, text[a:b], isinstance(loads(text[a:b]), dict))
                for name, a, b in named]


PARSERS: dict[str, ToolParser] = {p.name: p for p in (
    JsonListParser(), HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser())}
