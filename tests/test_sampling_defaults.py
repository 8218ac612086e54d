"""One resolver of sampling defaults for the CLI, HTTP and ``LLM``; the wire's enums.

``resolve_sampling`` takes the caller's fields, then the model's generation config, then
``SamplingParams``' own defaults; the three callers differ only in the ``max_tokens``
they pass for when nobody names a length.
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import attrs
import pytest

from actorllm.cli import CLI_MAX_TOKENS, build_parser
from actorllm.cli import sampling_params as cli_sampling_params
from actorllm.config import sampling_defaults
from actorllm.llm import LLM, LLM_MAX_TOKENS
from actorllm.server.convert import sampling_params as http_sampling_params
from actorllm.server.schemas import ChatCompletionRequest, CompletionRequest
from actorllm.wire import codec
from actorllm.wire.messages import (
    FailureCode,
    FinishReason,
    RefusalCode,
    RequestFailed,
    RequestFinished,
    TokenOut,
)
from actorllm.wire.sampling import (
    MODEL_DEFAULT_FIELDS,
    InvalidRequest,
    SamplingParams,
    resolve_sampling,
)

MODEL = sampling_defaults({"temperature": 0.7, "top_k": 50, "top_p": 0.9,
                           "repetition_penalty": 1.2, "min_p": 0.05})


def test_the_caller_wins_then_the_model_then_the_class() -> None:
    got = resolve_sampling({"temperature": 0.0, "top_p": None, "seed": 3}, MODEL, max_tokens=7)
    assert got.temperature == 0.0  # given
    assert (got.top_p, got.top_k, got.min_p, got.repetition_penalty) == (0.9, 50, 0.05, 1.2)
    assert got.seed == 3 and got.max_tokens == 7
    plain = resolve_sampling({}, {}, max_tokens=SamplingParams().max_tokens)
    assert plain == SamplingParams()  # nothing given, nothing from the model: the class's


def test_a_length_the_model_names_is_left_to_the_tokenizer() -> None:
    with_length = sampling_defaults({"max_new_tokens": 20})
    assert resolve_sampling({}, with_length, max_tokens=64).max_tokens is None
    assert resolve_sampling({"max_tokens": 5}, with_length, max_tokens=64).max_tokens == 5
    assert resolve_sampling({}, {}, max_tokens=64).max_tokens == 64


def test_model_values_take_the_fields_types() -> None:
    got = resolve_sampling({}, {"top_k": 50.0, "temperature": 1}, max_tokens=None)
    assert type(got.top_k) is int and type(got.temperature) is float
    assert set(MODEL_DEFAULT_FIELDS) <= {f.name for f in attrs.fields(SamplingParams)}
    with pytest.raises(InvalidRequest, match="bad sampling parameter"):
        resolve_sampling({}, {"top_p": "high"}, max_tokens=None)


@pytest.mark.parametrize("gen", [{}, {"max_new_tokens": 20, "do_sample": False}])
def test_cli_http_and_llm_differ_only_in_their_length(gen: dict[str, object]) -> None:
    defaults = {**MODEL, **sampling_defaults(gen)}
    args = build_parser().parse_args(["run", "a prompt"])
    assert isinstance(args, argparse.Namespace)
    cli = cli_sampling_params(args, defaults)
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    http = http_sampling_params(body, defaults=defaults, vocab_size=400)
    llm = LLM.__new__(LLM)  # no weights: only the model info is read
    llm.resources = SimpleNamespace(info=SimpleNamespace(sampling_defaults=defaults))
    offline = llm.default_sampling_params()
    named = "max_new_tokens" in gen
    assert cli == attrs.evolve(offline, max_tokens=None if named else CLI_MAX_TOKENS)
    assert http == attrs.evolve(offline, max_tokens=None)
    assert offline.max_tokens == (None if named else LLM_MAX_TOKENS)
    assert offline.temperature == (0.0 if gen.get("do_sample") is False else 0.7)


def test_completions_keep_openais_length_unless_told_otherwise() -> None:
    """OpenAI's completions default of 16 tokens is the request schema's (an omitted field);
    an explicit null leaves the length to the model, as chat does."""
    omitted = CompletionRequest.model_validate({"prompt": "x"})
    null = CompletionRequest.model_validate({"prompt": "x", "max_tokens": None})
    with_length = sampling_defaults({"max_new_tokens": 20})
    assert http_sampling_params(omitted, defaults=with_length, vocab_size=9).max_tokens == 16
    assert http_sampling_params(null, defaults=with_length, vocab_size=9).max_tokens is None


@pytest.mark.parametrize("msg,plain", [
    (TokenOut("r", finish_reason=FinishReason.STOP), TokenOut("r", finish_reason="stop")),
    (RequestFinished("r", FinishReason.LENGTH), RequestFinished("r", "length")),
    (RequestFailed("r", "no", FailureCode.ENGINE_DEAD), RequestFailed("r", "no", "engine_dead")),
])
def test_enums_travel_as_their_plain_values(msg: object, plain: object) -> None:
    wire = codec.encode(msg)
    assert wire == codec.encode(plain)  # byte for byte what the raw strings gave
    assert codec.decode(wire) == msg == plain


def test_enums_are_their_json_values() -> None:
    values = [FinishReason.ABORT, FailureCode.INTERNAL, RefusalCode.TOO_LARGE]
    assert json.dumps(values) == '["abort", "internal", "too_large"]'
    assert FinishReason.TOOL_CALLS == "tool_calls" and f"{RefusalCode.OVERLOADED}" == "overloaded"
