"""The HTTP schema: OpenAI-compatible request and response models (pydantic).

These classes live here alone (DESIGN.md §1): the handlers convert a request into a
:class:`~actorllm.messages.GenerateRequest` at the edge, and nothing past the Frontend
ever sees them. Request models ignore unknown fields, the way vLLM does, so a client
that sends a parameter we do not know (``best_of``, ``parallel_tool_calls``, ...) gets
an answer instead of an error. Every optional field accepts an explicit ``null``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# --- requests ---------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool | None = False


class ContentPart(_Request):
    """One part of a message's content; only ``text`` parts are supported."""

    type: str
    text: str | None = None


class ChatMessageIn(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _SamplingFields(_Request):
    """Parameters shared by chat and completions (OpenAI names, vLLM extensions)."""

    model: str | None = Field(None, description="must name the served model when given")
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="vLLM extension; 0 or -1: off")
    min_p: float | None = Field(None, description="vLLM extension")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension")
    min_tokens: int | None = Field(0, description="vLLM extension")
    ignore_eos: bool | None = Field(False, description="vLLM extension")
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = Field(None, description="vLLM extension")
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool | None = Field(False, description="vLLM extension")
    skip_special_tokens: bool | None = Field(True, description="vLLM extension")
    prompt_logprobs: int | None = Field(
        None, description="vLLM extension: logprobs of each prompt token and k alternatives")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn]
    max_tokens: int | None = Field(None, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = Field(True, description="vLLM extension")


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, token ids, or a list of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False


class TokenizeRequest(_Request):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (vLLM's shape)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True


class DetokenizeRequest(_Request):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


# --- responses --------------------------------------------------------------------------


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatLogprobToken] | None = None


class ChatMessageOut(_Response):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class PromptLogprob(_Response):
    """vLLM's shape: ``rank`` is null for a prompt token outside the top alternatives."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(_Response):
    """Also the shape of a streamed chunk (with ``usage`` null except in the last)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "actorllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
