"""``LLM.embed``: vLLM's offline embeddings, the vectors ``/v1/embeddings`` serves.

A prompt is prefilled as a pooling request (``SamplingParams(max_tokens=0, pooling=...)``,
``worker/pooling.py``) through the same actors as a generation; its finish carries the
pooled final hidden state. The pooling and whether vectors are scaled to unit length are
chosen as the server chooses them (``server/features.Features.build``).
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from actorllm.wire.messages import InvalidRequest, SamplingParams


class PooledResult(Protocol):
    """What :func:`embedded` reads of a pooling request's result (``llm.GenerationResult``)."""

    @property
    def rid(self) -> str: ...
    @property
    def prompt(self) -> Any: ...
    @property
    def pooled(self) -> tuple[float, ...]: ...
    @property
    def prompt_token_ids(self) -> tuple[int, ...]: ...
    @property
    def error(self) -> str | None: ...


@attrs.frozen
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: one prompt's vector."""

    embedding: list[float]


@attrs.frozen
class EmbeddingResult:
    """vLLM's ``EmbeddingRequestOutput``: ``outputs.embedding`` is the vector (empty when
    ``error`` says why there is none)."""

    rid: str
    prompt: Any  # as given to LLM.embed
    outputs: EmbeddingOutput
    prompt_token_ids: tuple[int, ...]
    error: str | None = None

    @property
    def request_id(self) -> str:
        return self.rid


def pooling_params(pooling: str | None, truncate_prompt_tokens: int | None) -> SamplingParams:
    """A pooling request's parameters (prefill only), checked: raises InvalidRequest
    naming the first bad field. ``LLM.embed`` and ``/v1/embeddings`` both take them here."""
    params = SamplingParams(max_tokens=0, pooling=pooling,
                            truncate_prompt_tokens=truncate_prompt_tokens)
    params.validate()
    return params


def embedding_params(model_dir: str, pooling: str | None, truncate_prompt_tokens: int | None
                     = None) -> tuple[SamplingParams, bool]:
    """The pooling request's parameters and whether its vectors are normalized: ``pooling``
    (``last``, ``mean``, ``cls``), else the model's sentence-transformers config, else the
    last token; ``truncate_prompt_tokens``: pool only each prompt's last k tokens (-1: as
    many as the context holds). Raises ValueError for a pooling or truncation that is not
    supported."""
    from actorllm.server.features import Features, sentence_transformers_pooling

    features = Features.build(pooling=pooling,
                              model_pooling=sentence_transformers_pooling(model_dir))
    try:
        params = pooling_params(features.pooling, truncate_prompt_tokens)
    except InvalidRequest as exc:
        raise ValueError(str(exc)) from None
    return params, features.normalize


def embedded(result: PooledResult, normalize: bool) -> EmbeddingResult:
    """A pooling request's result as vLLM shapes an embedding."""
    from actorllm.server.embeddings import embedding

    return EmbeddingResult(result.rid, result.prompt,
                           EmbeddingOutput(embedding(result.pooled, normalize)),
                           result.prompt_token_ids, result.error)
