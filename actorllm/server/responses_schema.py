"""The request of ``POST /v1/responses`` (OpenAI's Responses API), as pydantic models.

As everywhere in this server a field is honoured or refused: unknown fields are a 400
naming them. ``input`` items stay loosely typed here (the openai client sends several
shapes of each kind); ``server/responses.py`` reads them and names a bad one's place.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from actorllm.server.schemas import Float, _int, _Request

_INT64_MAX = 2**63 - 1


class FunctionTool(_Request):
    """A function tool (the Responses shape: name and schema at the top level)."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    """``text.format``: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(None, description="one verbosity only")


class ReasoningConfig(_Request):
    """Accepted for clients that always send it: the model reasons as it was trained to
    (``--reasoning-parser`` separates what it writes); no effort or summary is set."""

    effort: None = None
    summary: None = None


class ResponsesRequest(_Request):
    """``POST /v1/responses``."""

    model: str | None = Field(None, description="must name the served model when given")
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = Field(None, description="a system message before the input "
                                     "(not carried over by previous_response_id)")
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: _int(1, _INT64_MAX) | None = None  # type: ignore[valid-type]
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool | None = False
    store: bool | None = Field(True, description="keep the response for "
                               "previous_response_id (a bounded in-memory store)")
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] | None = Field(None, description="no truncation")
    include: Annotated[list[str], Field(max_length=0)] | None = Field(
        None, description="no extra output data is offered")
    # Accepted and ignored on purpose: labels for the caller's own records.
    user: str | None = Field(None, description="accepted, ignored (an end-user label)")
    metadata: dict[str, str] | None = Field(None, description="returned as given")
    safety_identifier: str | None = Field(None, description="accepted, ignored (a label)")
    prompt_cache_key: str | None = Field(None, description="accepted, ignored")
    service_tier: Literal["auto", "default"] | None = None
