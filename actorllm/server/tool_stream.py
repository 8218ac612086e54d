"""Streamed tool calls: ``delta.tool_calls`` as the model writes them (``server/tools.py``).

OpenAI's clients rebuild each call from its deltas: the first names it (``index``, ``id``,
``type``, ``function.name``), the later ones append to ``function.arguments``. So a call
goes out as soon as its name is known and its arguments object has begun, then its
arguments follow as the raw text the model writes. :class:`CallScanner` follows the JSON
of the calls character by character to know where each call's name and arguments are;
the parser of the format says where that JSON lies in the text (``ToolParser.regions``:
all of it for the ``json`` list, each block for ``hermes``). Formats whose calls are not
JSON call objects (``mistral``'s ``name[ARGS]{...}``, ``pythonic``) say instead what each
call is so far (``ToolParser.partial_calls``); both come to :class:`PartialCall` lists,
which :class:`ToolStream` turns into deltas.

A call that goes out is committed: if the text later turns out not to be calls after
all (a model that breaks off mid-call), what went out stays, as in vLLM. A call whose
arguments come before its name, or are not an object, waits for its object to close.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from actorllm.server.tool_call import PartialCall, ToolCall, calls_from
from actorllm.server.tools import ToolPlan

_WS = " \t\r\n"
_ARGS = ("arguments", "parameters")  # the key of a call's arguments (Llama 3: parameters)


@attrs.define
class ScannedCall:
    """One call object as it forms: where it is and what is known of it."""

    start: int  # its "{"
    end: int | None = None  # one past its "}", once closed
    name: str | None = None
    args_start: int | None = None  # the "{" of its "arguments" object
    args_end: int | None = None  # one past that object's "}"


class CallScanner:
    """Follows one JSON value, a call object or a list of them, as it arrives.

    ``feed`` reads up to a given end and records each call's name and arguments span.
    Anything that cannot be a list of call objects (a number in the list, text after the
    value) sets ``bad`` and stops it; whether the whole text is calls is ``parse``'s to
    say, at the end.
    """

    def __init__(self, start: int) -> None:
        self.pos = start
        self.calls: list[ScannedCall] = []
        self.bad = False
        self._stack: list[str] = []
        self._base = 0  # depth of the call objects: 1 (a lone object) or 2 (in a list)
        self._in_str = self._esc = False
        self._str_start = 0
        self._state = "top"  # top, list, key, colon, value, in_value, after, done
        self._key: Any = None
        self._value_start = 0
        self._literal = False  # a number, true, false or null at the call's level

    def feed(self, text: str, end: int) -> None:
        """Read ``text[pos:end]``."""
        i = self.pos
        while i < end and not self.bad:
            self._char(text, i)
            i += 1
        self.pos = i

    def _char(self, text: str, i: int) -> None:
        c = text[i]
        at_call = len(self._stack) == self._base and self._state not in ("top", "list", "done")
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                if at_call and self._state == "key":
                    self._key = _loads(text[self._str_start : i + 1])
                    self._state = "colon"
                elif at_call and self._state == "in_value":
                    self._value_end(text, i + 1)
            return
        if self._literal:
            if c not in _WS and c not in ",}":
                return
            self._literal = False
            self._value_end(text, i)
        if c in _WS:
            return
        if self._state == "done":  # text after the value: not calls
            self.bad = True
        elif self._state in ("top", "list"):
            self._outside(c, i)
        elif not at_call:  # inside a value: only the nesting matters
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self._stack.append(c)
            elif c in "}]":
                self._stack.pop()
                if len(self._stack) == self._base:
                    self._value_end(text, i + 1)
        elif self._state == "key":
            if c == '"':
                self._in_str, self._str_start = True, i
            elif c == "}":
                self._close_call(i)
            else:
                self.bad = True
        elif self._state == "colon":
            self.bad = c != ":"
            self._state = "value"
        elif self._state == "value":
            self._state, self._value_start = "in_value", i
            if self._key in _ARGS and c == "{":
                self.calls[-1].args_start = i
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self._stack.append(c)
            else:
                self._literal = True
        elif self._state == "after":
            if c == ",":
                self._state = "key"
            elif c == "}":
                self._close_call(i)
            else:
                self.bad = True

    def _outside(self, c: str, i: int) -> None:
        """Before the value (``top``) or between the calls of the list (``list``)."""
        if c == "{":
            self._base = self._base or 1
            self._stack.append(c)
            self.calls.append(ScannedCall(i))
            self._state = "key"
        elif c == "[" and self._state == "top" and not self._base:
            self._base = 2
            self._stack.append(c)
            self._state = "list"
        elif c == "," and self._state == "list" and self.calls:
            pass
        elif c == "]" and self._state == "list":
            self._stack.pop()
            self._state = "done"
        else:
            self.bad = True

    def _value_end(self, text: str, end: int) -> None:
        call = self.calls[-1]
        if self._key == "name" and text[self._value_start] == '"':
            name = _loads(text[self._value_start : end])
            call.name = name if isinstance(name, str) else None
        elif self._key in _ARGS and call.args_start is not None:
            call.args_end = end
        self._state, self._key = "after", None

    def _close_call(self, i: int) -> None:
        self._stack.pop()
        self.calls[-1].end = i + 1
        self._state = "list" if self._base == 2 else "done"


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


@attrs.define
class ToolStream:
    """One streamed choice of a request with tools: its content and ``delta.tool_calls``."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of text sent as content
    holding: bool = False  # a call may have begun: the text is read as calls
    found: bool = False  # a call went out
    scanners: dict[int, CallScanner] = attrs.Factory(dict)  # by the start of their region
    out: list[int] = attrs.Factory(list)  # per call that went out: its arguments sent
    _opened: bool = False  # named: the call's header went out

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """Content to send now and tool-call deltas, for the next piece of text."""
        self.text += piece
        if self.plan.mode == "named":
            return "", self._named(piece)
        content = ""
        if self.plan.mode == "auto" and not self.holding:
            safe, self.holding = self.plan.parser.split(self.text)
            content = self.text[self.sent:safe] if safe > self.sent else ""
            self.sent = max(self.sent, safe)
        return content, self._calls() if self.holding or self.plan.mode == "required" else []

    def _named(self, piece: str) -> list[dict[str, Any]]:
        # The grammar made the whole output the function's arguments.
        assert self.plan.function is not None
        self.found = True
        if not self._opened:
            self._opened = True
            return [{"index": 0, **ToolCall(self.plan.function, piece).as_dict()}]
        return [{"index": 0, "function": {"arguments": piece}}] if piece else []

    def _scanned(self) -> list[tuple[CallScanner, ScannedCall]]:
        """Every call found so far, in order, the regions read up to their ends."""
        found = []
        for start, end in self.plan.call_parser().regions(self.text):
            scanner = self.scanners.setdefault(start, CallScanner(start))
            scanner.feed(self.text, end)
            found += [(scanner, call) for call in scanner.calls]
            if scanner.bad:
                break  # nothing after text that is not calls goes out as calls
        return found

    def _progress(self) -> list[PartialCall]:
        """The calls as far as they are known, in order (``PartialCall``)."""
        partial = self.plan.call_parser().partial_calls(self.text)
        if partial is not None:
            return partial
        found = []
        for scanner, call in self._scanned():
            if call.name is not None and call.args_start is not None:
                upto = call.args_end if call.args_end is not None else scanner.pos
                found.append(PartialCall(call.name, self.text[call.args_start:upto],
                                         call.end is not None))
            elif call.end is not None:  # closed without streaming: whole, if it is a call
                whole = calls_from(_loads(self.text[call.start:call.end]))
                if not whole:
                    break
                found.append(PartialCall(whole[0].name, whole[0].arguments, True))
            else:
                break
        return found

    def _calls(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        limit = None if self.plan.parallel else 1
        for k, call in enumerate(self._progress()[:limit]):
            if k == len(self.out):  # its header (the arguments sure so far with it)
                deltas.append({"index": k, **ToolCall(call.name, call.arguments).as_dict()})
                self.out.append(len(call.arguments))
            elif len(call.arguments) > self.out[k]:
                deltas.append({"index": k, "function": {
                    "arguments": call.arguments[self.out[k]:]}})
                self.out[k] = len(call.arguments)
            if not call.done:
                break  # calls go out in order
        self.found = self.found or bool(self.out)
        return deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left to send when the choice ends."""
        if self.plan.mode == "named":
            return "", []
        rest = self.text[self.sent:]
        if self.plan.mode == "auto" and not self.holding:
            # Never began a call; anything held back (a partial tag) is content.
            self.sent = len(self.text)
            return rest, []
        deltas = self._calls()
        _, calls = self.plan.message(self.text)
        if not self.out and not calls:
            self.sent = len(self.text)
            return rest, []
        # Arguments that never went out (a pythonic call the stream could not read), and
        # calls the scanner could not follow, go out whole (the content before them went
        # out already: all the parsers keep it first).
        for k in range(min(len(self.out), len(calls))):
            if not self.out[k]:
                deltas.append({"index": k, "function": {"arguments": calls[k].arguments}})
        for k in range(len(self.out), len(calls)):
            deltas.append({"index": k, **calls[k].as_dict()})
        self.found = True
        # Text outside the calls is content, as in the whole answer (sent at the end: it
        # is known to be outside only once every block has closed).
        self.sent = len(self.text)
        return self.plan.call_parser().after_calls(self.text).rstrip(), deltas
