"""Server settings of the issue-31 features, handed to ``build_app`` as one object.

Kept apart from ``ServerState`` so the features (reasoning, the Responses API's store,
embeddings) add no fields to it: the routes of those features read this instead.
"""

from __future__ import annotations

import attrs

from actorllm.server.reasoning import REASONING_PARSERS, ReasoningParser

POOLINGS = ("last", "mean")


@attrs.define
class Features:
    """``reasoning``: the ``--reasoning-parser`` (None: off); the Responses store's limits
    (``--responses-store-size`` responses, each kept ``--responses-store-ttl`` seconds);
    ``pooling``: how ``/v1/embeddings`` pools the final hidden states."""

    reasoning: ReasoningParser | None = None
    store_size: int = 1000
    store_ttl: float = 3600.0
    pooling: str = "last"

    @classmethod
    def build(cls, *, reasoning_parser: str | None = None, store_size: int = 1000,
              store_ttl: float = 3600.0, pooling: str = "last") -> Features:
        """Check the names and limits; ValueError for an unknown one."""
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}")
        if store_size < 0 or store_ttl <= 0:
            raise ValueError("the responses store needs a size >= 0 and a ttl > 0")
        parser = None if reasoning_parser is None else REASONING_PARSERS[reasoning_parser]
        return cls(parser, store_size, store_ttl, pooling)
