"""The HTTP schema of requests: OpenAI-compatible request models (pydantic).

Responses are ``response_models.py``.

These classes live here alone (DESIGN.md §1): the handlers convert a request into a
:class:`~actorllm.wire.messages.GenerateRequest` at the edge, and nothing past the Frontend
ever sees them. A field is honoured or refused: request models forbid unknown fields,
so a client that sends one we do not implement (``use_beam_search``, ``logits_processors``, ...)
gets a 400 naming it instead of an answer that quietly ignored it. The few fields that
are accepted and ignored on purpose (``user``, ``metadata``, ...) are declared below,
each with its reason. Every optional field accepts an explicit ``null``.

The bounds declared here are the ones the server enforces (``SamplingParams.validate``
checks the same ones again for the Python API), so ``/openapi.json`` tells a client
what it may send (the token-id bound, the vocabulary size, is filled in by ``app.py``).
Integers and floats are strict: ``true`` is not a token id. A float with an integral
value (``2.0``) is the integer, as JSON Schema says (``"type": "integer"`` includes it). Every
string, wherever it sits in a request, must be encodable as UTF-8: JSON can carry a lone
surrogate (``"\\ud800"``) that Python accepts but no tokenizer or encoder does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, field_validator

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Marks a token id in the JSON schema; app.py replaces it with the vocabulary's bound.
TOKEN_ID_MARK = "x-actorllm-token-id"


def _integral(value: Any) -> Any:
    """A float with an integral value is that integer (JSON Schema's "integer")."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _int(ge: int, le: int, **extra: Any) -> Any:
    """A strict integer in [ge, le] that also takes an integral float. (The validator goes
    last: before the bounds, pydantic would write them as "ge"/"le" in the JSON schema.)"""
    return Annotated[int, Strict(), Field(ge=ge, le=le, **extra), BeforeValidator(_integral)]


Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
TokenId = _int(0, _INT64_MAX, json_schema_extra={TOKEN_ID_MARK: True})
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1)]


def _has_bad_text(value: Any) -> bool:
    """Whether a string anywhere in ``value`` (dict keys too) cannot be encoded as UTF-8."""
    if isinstance(value, str):
        # isascii() is a fast exit for the usual case; encode() finds lone surrogates.
        if value.isascii():
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list | tuple):
        return any(_has_bad_text(v) for v in value if not isinstance(v, int | float))
    if isinstance(value, dict):
        return any(_has_bad_text(k) or _has_bad_text(v) for k, v in value.items())
    return False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        # Nested models run this for their own fields, so the error names the innermost one.
        if _has_bad_text(value):
            raise ValueError("must be valid Unicode text (it holds a lone surrogate)")
        return value


class StreamOptions(_Request):
    include_usage: bool | None = False


class ContentPart(_Request):
    """One part of a message's content; only ``text`` parts are supported (the other
    kinds' fields are declared so that the 400 says which part is not text)."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class FunctionCallIn(_Request):
    name: str
    arguments: str = Field(description="the arguments as a JSON object, in a string")


class ToolCallIn(_Request):
    """A call the assistant made, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer is taken as system; a tool message needs tool_call_id")
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="assistant messages")
    tool_call_id: str | None = Field(None, description="tool messages: the call answered")
    # What the openai client puts in an assistant message it hands back: accepted when
    # null (a real value would have to be honoured, and is not).
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: None = None


class FunctionDef(_Request):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema")
    strict: bool | None = Field(None, description="calls always match the schema when "
                                "tool_choice forces them; ignored otherwise")


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="output always matches the schema")


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsIn(_Request):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | str | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = Field(None, description="Lark or GBNF")
    json_object: bool | None = None


class _SamplingFields(_Request):
    """Parameters shared by chat and completions (OpenAI names, vLLM extensions)."""

    model: str | None = Field(None, description="must name the served model when given")
    n: _int(1, 128) | None = Field(
        1, description="choices per prompt (prompts x n is also capped by --max-pending)")
    temperature: Annotated[Float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = None
    top_k: _int(-1, _INT64_MAX) | None = Field(
        None, description="vLLM extension; 0 or -1: off")
    min_p: Annotated[Float, Field(ge=0.0, le=1.0)] | None = Field(
        None, description="vLLM extension")
    return_token_ids: bool | None = Field(
        False, description="vLLM extension: the prompt's token ids and each choice's "
        "generated ids in the response (streamed: the prompt's in the first chunk)")
    seed: _int(_INT64_MIN, _INT64_MAX) | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, description="vLLM extension")
    min_tokens: _int(0, _INT64_MAX) | None = Field(
        0, description="vLLM extension; at most max_tokens")
    ignore_eos: bool | None = Field(False, description="vLLM extension")
    presence_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = 0.0
    frequency_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = 0.0
    repetition_penalty: Annotated[Float, Field(gt=0.0, le=10.0)] | None = Field(
        None, description="vLLM extension")
    logit_bias: dict[str, Annotated[Float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="token id (as a string) -> bias")
    include_stop_str_in_output: bool | None = Field(False, description="vLLM extension")
    skip_special_tokens: bool | None = Field(True, description="vLLM extension")
    prompt_logprobs: int | None = Field(
        None, description="vLLM extension: logprobs of each prompt token and k alternatives")
    truncate_prompt_tokens: _int(-1, _INT64_MAX) | None = Field(
        None, description="vLLM extension: keep only the prompt's last k tokens (-1: as "
        "many as the context holds)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = Field(None, description="vLLM extension")
    guided_json: dict[str, Any] | str | bool | None = Field(
        None, description="vLLM extension (older name of structured_outputs.json)")
    guided_regex: str | None = Field(None, description="vLLM extension")
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = Field(
        None, description="vLLM extension")
    guided_grammar: str | None = Field(None, description="vLLM extension")
    # Accepted and ignored on purpose: they label the request for the caller's own
    # records or another service's policies and change nothing about the answer.
    user: str | None = Field(None, description="accepted, ignored (an end-user label)")
    metadata: dict[str, str] | None = Field(None, description="accepted, ignored (labels)")
    safety_identifier: str | None = Field(None, description="accepted, ignored (a label)")
    prompt_cache_key: str | None = Field(
        None, description="accepted, ignored (a cache hint; the answer does not change)")
    store: Literal[False] | None = Field(None, description="storing answers is not offered")
    service_tier: Literal["auto", "default"] | None = Field(
        None, description="one tier only")
    priority: _int(_INT64_MIN, _INT64_MAX) | None = Field(
        None, description="vLLM extension: lower runs first; only with "
        "--scheduling-policy priority (otherwise a non-zero value is refused)")


_MaxTokens = _int(1, _INT64_MAX)
# Completions may ask for 0 tokens together with echo (the prompt's logprobs only);
# convert.sampling_params refuses 0 without echo, naming max_tokens.
_CompletionMaxTokens = _int(0, _INT64_MAX)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_tokens: _MaxTokens | None = Field(
        None, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: _MaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: _int(0, 20) | None = Field(
        None, description="needs logprobs: true")
    add_generation_prompt: bool | None = Field(True, description="vLLM extension")
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without")
    parallel_tool_calls: bool | None = Field(True, description="false: at most one call")
    modalities: list[Literal["text"]] | None = Field(None, description="text only")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM extension: further variables for the chat template "
        "(enable_thinking, ...)")


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, token ids, or a list of either."""

    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
             | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1)])
    max_tokens: _CompletionMaxTokens | None = Field(16, description="0 only with echo")
    logprobs: _int(0, 20) | None = None
    echo: bool | None = Field(False, description="with logprobs: the prompt's logprobs too")
    best_of: _int(1, 128) | None = Field(
        None, description="candidates per prompt (at least n); the n with the highest "
        "cumulative logprob are returned; not with stream")


class TokenizeRequest(_Request):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (vLLM's shape), not both."""

    # Exactly one of prompt and messages (tools only with messages), in the schema too.
    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {
            "prompt": {"type": "string"}, "messages": {"type": "null"},
            "tools": {"type": "null"}}},
        {"required": ["messages"], "properties": {
            "messages": {"type": "array"}, "prompt": {"type": "null"}}},
    ]})

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = Field(
        None, description="with messages: rendered through the chat template, as in "
        "/v1/chat/completions")


class DetokenizeRequest(_Request):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[TokenId]
