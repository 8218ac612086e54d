"""Server-sent events, the way OpenAI streams: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``.

Events are encoded with orjson: compact, UTF-8 as is (``ensure_ascii=False``), the same
JSON values as the standard library's. A stream's chunks share their envelope (id,
object, created, model), so a renderer encodes it once per response
(:func:`chunk_framing`) and each chunk only its choice.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # Tell buffering proxies (nginx) to pass each event on at once.
    (b"x-accel-buffering", b"no"),
]


def dumps(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON. orjson refuses what the standard library takes
    (a dict with keys that are not strings, a lone surrogate it cannot encode either):
    that goes the slow way, so the outcome is the same as ``json.dumps``'s."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event holding ``payload`` as compact JSON."""
    return b"data: " + dumps(payload) + b"\n\n"


def chunk_framing(envelope: dict[str, Any]) -> tuple[bytes, bytes]:
    """The bytes before and after the choices of every chunk event with ``envelope`` (its
    fields in order, then ``choices``): ``head + dumps(choice) + tail`` is the event of
    ``{**envelope, "choices": [choice]}``."""
    body = dumps(envelope)
    return b"data: " + body[:-1] + b',"choices":[', b"]}\n\n"
