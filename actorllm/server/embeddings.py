"""``POST /v1/embeddings``: pooled, normalized final hidden states of the prompts.

Each input is one engine request with nothing to generate (``max_tokens`` 0) and
``SamplingParams.pooling`` set (the last token's hidden state, the mean over the prompt,
or the first token's): it goes through the same actors and state machine as a
completion, so admission, batching, abort and metrics apply. The Worker pools the
final hidden states of the prefill (``worker/pooling.py``) and the request's finish
carries the vector to the collector; here it is L2-normalized and encoded. The route is
in ``server/routes/embeddings.py``.

The pooling is ``--pooling``, else what the model's sentence-transformers config says
(``modules.json`` and its ``Pooling`` module's ``config.json``: ``server/features.py``),
else the last token; with such a config, vectors are normalized only if it has a
``Normalize`` module (as sentence-transformers itself does).
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field

from actorllm.server.job import Job
from actorllm.server.render import JobView
from actorllm.server.schemas import _INT64_MAX, TokenIds, _int, _Request
from actorllm.wire.outputs import CompletionOutput, RequestOutput

_Text = Annotated[str, Field(min_length=1)]


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings``: a string, strings, token ids, or lists of token ids."""

    model: str | None = None
    input: (_Text | Annotated[list[_Text], Field(min_length=1, max_length=2048)] | TokenIds
            | Annotated[list[TokenIds], Field(min_length=1, max_length=2048)])
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: None = Field(None, description="the model's own size only")
    truncate_prompt_tokens: _int(-1, _INT64_MAX) | None = Field(
        None, description="vLLM extension: embed only each input's last k tokens (-1: as "
        "many as the context holds)")
    user: str | None = Field(None, description="accepted, ignored (an end-user label)")


def normalized(values: tuple[float, ...]) -> list[float]:
    """``values`` scaled to unit L2 norm (a zero vector stays zero)."""
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values] if norm > 0 else list(values)


def embedding(pooled: tuple[float, ...], normalize: bool) -> list[float]:
    """A pooled hidden state as returned: unit length if ``normalize``."""
    return normalized(pooled) if normalize else list(pooled)


def encode(vector: list[float], encoding: str) -> list[float] | str:
    """As OpenAI sends it: floats, or base64 of little-endian float32."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


class EmbeddingRenderer:
    """The ``list`` of embeddings of ``jobs`` (read from their collectors at the end)."""

    def __init__(self, jobs: list[Job], *, model: str, encoding: str,
                 normalize: bool = True) -> None:
        self.jobs, self.model, self.encoding = jobs, model, encoding
        self.normalize = normalize

    def prelude(self, firsts: Sequence[RequestOutput | None]) -> list[dict[str, Any]]:
        return []

    def add(self, job: JobView, out: CompletionOutput) -> None:
        return None

    def add_event(self, job: JobView, out: CompletionOutput) -> None:
        return None

    def completion_tokens(self) -> int:
        return 0

    def final(self, usage: dict[str, Any]) -> dict[str, Any]:
        data = []
        for i, job in enumerate(self.jobs):
            assert job.collector is not None
            vector = embedding(job.collector.pooled, self.normalize)
            data.append({"object": "embedding", "index": i,
                         "embedding": encode(vector, self.encoding)})
        return {"object": "list", "data": data, "model": self.model,
                "usage": {"prompt_tokens": usage["prompt_tokens"],
                          "total_tokens": usage["prompt_tokens"]}}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("embeddings are never streamed")
