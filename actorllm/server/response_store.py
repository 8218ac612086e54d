"""The Responses API's store: finished responses kept for ``previous_response_id`` and
``GET /v1/responses/{id}``, bounded in count (``--responses-store-size``) and age
(``--responses-store-ttl``), oldest dropped first; in memory, so lost on restart.

One per app, owned by its :class:`~actorllm.server.state.ServerState`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from actorllm.server.errors import APIError


class ResponseStore:
    """Finished responses and the conversations that led to them, bounded in count and age."""

    def __init__(self, size: int, ttl: float) -> None:
        self.size, self.ttl = size, ttl
        self._items: OrderedDict[str, tuple[float, dict[str, Any], list[dict[str, Any]]]] = \
            OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep ``response``; ``conversation``: its chat messages, input and output."""
        self._items[response["id"]] = (time.monotonic(), response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The response and its conversation; a 404 APIError when unknown or expired."""
        now = time.monotonic()
        while self._items:  # the oldest first: drop what has expired
            oldest = next(iter(self._items.values()))
            if now - oldest[0] <= self.ttl:
                break
            self._items.popitem(last=False)
        hit = self._items.get(response_id)
        if hit is None:
            raise APIError(404, f"Response with id '{response_id}' not found.",
                           param="previous_response_id", code="not_found")
        return hit[1], hit[2]
