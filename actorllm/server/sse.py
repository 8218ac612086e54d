"""Server-sent events, the way OpenAI streams: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # Tell buffering proxies (nginx) to pass each event on at once.
    (b"x-accel-buffering", b"no"),
]


def event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event holding ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":"),
                                  ensure_ascii=False).encode("utf-8") + b"\n\n"
