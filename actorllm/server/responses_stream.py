"""Responses API shapes (``POST /v1/responses``) made from a chat renderer's output.

:class:`ResponsesRenderer` wraps the :class:`ChatRenderer` of the same request, so tool
calls and reasoning are read exactly as for chat; it turns the chat deltas into the
Responses API's typed events (one output item at a time: ``output_item.added``, its
deltas, its ``.done`` events, ``output_item.done``) and the whole answer into a
``response`` object whose output is reasoning, message and ``function_call`` items.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from actorllm.server import sse
from actorllm.server.render import ChatRenderer, JobView
from actorllm.wire.outputs import CompletionOutput, RequestOutput


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat ``usage`` in the Responses API's names."""
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def text_item(kind: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A ``message`` (assistant ``output_text``) or ``reasoning`` output item."""
    if kind == "message":
        return {"type": "message", "id": _id("msg"), "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [],
                             "logprobs": []}]}
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def message_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as output items: reasoning, text, then calls."""
    items = []
    if message.get("reasoning_content") is not None:
        items.append(text_item("reasoning", message["reasoning_content"]))
    if message.get("content"):
        items.append(text_item("message", message["content"]))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append(call_item(call["id"], fn["name"], fn["arguments"]))
    return items


class ResponsesRenderer:
    """A :class:`~actorllm.server.render.Renderer` for ``/v1/responses``.

    ``envelope(status, output, usage)`` makes the response object around the output;
    ``on_done`` is handed the finished response (the store keeps it)."""

    def __init__(self, chat: ChatRenderer, envelope: Callable[..., dict[str, Any]],
                 on_done: Callable[[dict[str, Any]], None]) -> None:
        self.chat, self.envelope, self.on_done = chat, envelope, on_done
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.finish: str | None = None

    def completion_tokens(self) -> int:
        return self.chat.completion_tokens()

    def _status(self, finish: str | None) -> tuple[str, dict[str, Any] | None]:
        if finish == "length":
            return "incomplete", {"reason": "max_output_tokens"}
        return "completed", None

    def _done(self, output: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        status, details = self._status(self.finish)
        response = self.envelope(status, output, responses_usage(usage), details)
        self.on_done(response)
        return response

    # --- whole -------------------------------------------------------------------------

    def final(self, usage: dict[str, Any]) -> dict[str, Any]:
        choice = self.chat.final(usage)["choices"][0]
        self.finish = choice["finish_reason"]
        return self._done(message_items(choice["message"]), usage)

    # --- streamed ----------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def prelude(self, firsts: Sequence[RequestOutput | None]) -> list[dict[str, Any]]:
        response = self.envelope("in_progress", [], None, None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def add(self, job: JobView, out: CompletionOutput) -> list[dict[str, Any]] | None:
        chunk = self.chat.add(job, out)
        events: list[dict[str, Any]] = []
        for choice in (chunk or {}).get("choices", ()):
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice["finish_reason"] is not None:
                self.finish = choice["finish_reason"]
                events += self._close()
        return events or None

    def add_event(self, job: JobView, out: CompletionOutput) -> bytes | None:
        """As :meth:`add`, its events as SSE bytes (None: nothing to tell yet)."""
        events = self.add(job, out)
        return None if events is None else sse.events(events)

    def usage_chunk(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        response = self._done(self.items, usage)
        kind = "response.completed" if response["status"] == "completed" else \
            "response.incomplete"
        return [*events, self._event(kind, response=response)]

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _open_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.items.append(item)
        self.open = item
        shown = copy.deepcopy(item)
        part = None
        if "content" in item:
            part, shown["content"] = copy.deepcopy(item["content"][0]), []
        events.append(self._event("response.output_item.added",
                                  output_index=len(self.items) - 1, item=shown))
        if part is not None:
            events.append(self._event("response.content_part.added", **self._where(item),
                                      content_index=0, part=part))
        return events

    def _text(self, kind: str, piece: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            events += self._open_item(text_item(kind, "", "in_progress"))
        assert self.open is not None
        self.open["content"][0]["text"] += piece
        name = "output_text" if kind == "message" else "reasoning_text"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(f"response.{name}.delta", **self._where(self.open),
                                  content_index=0, delta=piece, **extra))
        return events

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        fn = delta.get("function") or {}
        if "id" in delta:  # a call's first delta names it
            events += self._open_item(call_item(delta["id"], fn.get("name", ""), "",
                                                "in_progress"))
        calls = [i for i in self.items if i["type"] == "function_call"]
        item = calls[min(delta["index"], len(calls) - 1)]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta",
                                      **self._where(item), delta=fn["arguments"]))
        return events

    def _close(self) -> list[dict[str, Any]]:
        """The ``.done`` events of the item being streamed, if any."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        where = self._where(item)
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **where,
                                      name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            name = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(self._event(f"response.{name}.done", **where, content_index=0,
                                      text=part["text"], **extra))
            events.append(self._event("response.content_part.done", **where,
                                      content_index=0, part=copy.deepcopy(part)))
        events.append(self._event("response.output_item.done",
                                  output_index=where["output_index"], item=copy.deepcopy(item)))
        return events
