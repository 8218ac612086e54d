"""Reasoning parsers: a model's thinking kept apart from its answer (``--reasoning-parser``).

Reasoning models write their thinking first, between tags, then the answer. The server
gives the thinking as ``message.reasoning_content`` (streamed: ``delta.reasoning_content``)
and the rest as ``content``; tool calls and the Responses API read the content only.

The ``<think>...</think>`` family ships in two flavours:

- ``qwen3``: there is reasoning only if the output opens with ``<think>``.
- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output starts
  inside the reasoning (an opening tag the model writes anyway is dropped); an output that
  never closes it is all reasoning.

Whitespace right after ``</think>`` is not part of the content. Structured output of
every kind (JSON, a regex, choices, a grammar, forced tool calls) holds after the
reasoning: the constraint is framed by a grammar that lets the thinking come first
(:meth:`ThinkParser.wrap`). A regex that itself opens with ``<think>`` spells the
reasoning out, so it covers the whole output as written. More parsers are added to
:data:`REASONING_PARSERS`.
"""

from __future__ import annotations

import json
from typing import Protocol

import attrs

from actorllm.wire.messages import StructuredOutput


class ReasoningStream(Protocol):
    """One choice's output as it streams: which part is reasoning, which is content."""

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content to send now for the next ``piece`` (``final``:
        the output ends with it, so nothing is held back)."""


class ReasoningParser(Protocol):
    name: str

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output's reasoning (None: it has none) and content (None: none)."""

    def stream(self) -> ReasoningStream:
        """A fresh reader for one streamed choice."""

    def wrap(self, spec: StructuredOutput) -> StructuredOutput:
        """``spec`` made to hold after the reasoning part."""


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that ``tag`` begins with (not all of it)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


@attrs.frozen
class ThinkParser:
    """The ``<think>...</think>`` family; ``opened``: the prompt opened the tag already."""

    name: str
    opened: bool
    start_tag: str = "<think>"
    end_tag: str = "</think>"

    def split(self, text: str) -> tuple[str | None, str | None]:
        body = text.lstrip()
        if body.startswith(self.start_tag):
            body = body[len(self.start_tag):]
        elif not self.opened:
            return None, text or None
        reasoning, closed, content = body.partition(self.end_tag)
        if not closed:
            return reasoning, None
        return reasoning, content.lstrip() or None

    def stream(self) -> ReasoningStream:
        return _ThinkStream(self)

    def wrap(self, spec: StructuredOutput) -> StructuredOutput:
        if spec.frame is not None or (
                spec.kind == "regex" and spec.spec.removeprefix("^").startswith(self.start_tag)):
            return spec  # a pattern that spells the reasoning out covers the whole output
        opener = f'"{self.start_tag}"?' if self.opened else f'"{self.start_tag}"'
        # A Lark frame for llguidance: the thought runs up to the closing tag (`stop`),
        # then the client's constraint, whatever its kind (text/structured.py).
        frame = (f"start: think? @body\n"
                 f"think: {opener} thought /[ \\t\\r\\n]*/\n"
                 f"thought[stop={json.dumps(self.end_tag)}]: /(?s:.*)/\n")
        return attrs.evolve(spec, frame=frame)


@attrs.define
class _ThinkStream:
    parser: ThinkParser
    state: str = "start"  # start, reasoning, gap (whitespace after the end tag), content
    held: str = ""  # text not yet sent: it may be part of a tag

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        text = self.held + piece
        self.held = ""
        reasoning = content = ""
        p = self.parser
        if self.state == "start":
            body = text.lstrip()
            if body.startswith(p.start_tag):
                text, self.state = body[len(p.start_tag):], "reasoning"
            elif p.start_tag.startswith(body) and not final:
                self.held = text  # whitespace, or the tag's beginning: undecided yet
                return "", ""
            elif p.opened:
                text, self.state = body, "reasoning"
            else:
                self.state = "content"
        if self.state == "reasoning":
            at = text.find(p.end_tag)
            if at < 0:
                keep = 0 if final else _partial_tail(text, p.end_tag)
                self.held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            reasoning, text, self.state = text[:at], text[at + len(p.end_tag):], "gap"
        if self.state == "gap":
            text = text.lstrip()
            if not text:
                return reasoning, ""
            self.state = "content"
        return reasoning, content + text


REASONING_PARSERS: dict[str, ReasoningParser] = {
    p.name: p for p in (ThinkParser("qwen3", opened=False),
                        ThinkParser("deepseek_r1", opened=True))}
