"""What a caller asks for: :class:`SamplingParams`, and the one resolver of its defaults.

Part of the wire (re-exported by :mod:`actorllm.wire.messages`, which the codec reads):
plain frozen values. :func:`resolve_sampling` is the one place where a caller's fields,
the model's generation_config.json (``ModelInfo.sampling_defaults``) and the class's own
defaults meet; the CLI, the HTTP server and ``LLM`` all go through it and differ only in
the arguments they pass (the ``max_tokens`` used when nobody names one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs


class InvalidRequest(ValueError):
    """A request the engine will not run; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


@attrs.frozen
class StructuredOutput:
    """A grammar the output must match (vLLM's structured outputs; :mod:`actorllm.text.structured`).

    ``kind``: "json" (``spec`` a JSON schema), "regex", "choice" (a JSON list of strings)
    or "grammar" (Lark or GBNF). ``param``: the request field it came from, for errors.
    ``frame``: a Lark grammar the output follows instead, which names this constraint
    ``@body`` (a reasoning parser's: the thinking first, then the constraint).
    """

    kind: str
    spec: str
    param: str = "structured_outputs"
    frame: str | None = None


@attrs.frozen
class SamplingParams:
    """How to sample one request (OpenAI/vLLM semantics). ``validate`` says what is wrong."""

    n: int = 1
    max_tokens: int | None = 16  # None: the model's max_new_tokens, within the context
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; k >= 0: the chosen token and k alternatives
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # k: each prompt token and k alternatives (0th None)
    structured: StructuredOutput | None = None  # constrain the output to a grammar
    priority: int = 0  # lower runs first, ties by arrival; non-zero only with that policy
    # "last" or "mean": an embedding request (prefill only, max_tokens 0); its finish
    # carries the pooled final hidden state of the prompt.
    pooling: str | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds); the
    # Tokenizer cuts it, so every count and the prompt's ids are of what ran.
    truncate_prompt_tokens: int | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`InvalidRequest` naming the first bad value."""
        checks: list[tuple[bool, str, str]] = [
            (1 <= self.n <= 128, "n", "must be between 1 and 128"),
            # 0: run the prefill only (for prompt logprobs) and finish with `length`.
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens",
             "must be non-negative"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "must not exceed max_tokens"),
            (0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 (off) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             "must be in [0, 20]"),
            (all(s for s in self.stop), "stop", "stop strings must be non-empty"),
            (len(self.stop) <= 16, "stop", "at most 16 stop strings"),
            (self.pooling in (None, "last", "mean", "cls"), "pooling",
             "must be last, mean or cls"),
            (self.pooling is None or self.max_tokens == 0, "max_tokens",
             "must be 0 with pooling"),
            (self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
             or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens",
             "must be -1 or at least 1"),
        ]
        for ok, param, why in checks:
            if not ok:
                raise InvalidRequest(f"{param} {why}, got {getattr(self, param)!r}", param)
        if self.structured is not None and self.structured.kind not in STRUCTURED_KINDS:
            raise InvalidRequest(f"{self.structured.param}: unknown kind "
                                 f"{self.structured.kind!r}", self.structured.param)
        for name, v in (("temperature", self.temperature), ("top_p", self.top_p)):
            if v != v:  # NaN
                raise InvalidRequest(f"{name} must be a number", name)
        if vocab_size is not None:
            for tid in self.stop_token_ids:
                if not 0 <= tid < vocab_size:
                    raise InvalidRequest(f"stop_token_ids: {tid} is not in the vocabulary",
                                         "stop_token_ids")
            for tid, bias in self.logit_bias:
                if not 0 <= tid < vocab_size:
                    raise InvalidRequest(f"logit_bias: token {tid} is not in the vocabulary",
                                         "logit_bias")
                if not -100.0 <= bias <= 100.0:
                    raise InvalidRequest(f"logit_bias: {bias} is not in [-100, 100]",
                                         "logit_bias")


#: The fields generation_config.json may set (``config.sampling_defaults``), with the
#: type a value must have: a file's ``"top_k": 50.0`` still makes an int.
MODEL_DEFAULT_FIELDS: dict[str, type] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float,
    "repetition_penalty": float,
}


def resolve_sampling(given: Mapping[str, Any], model_defaults: Mapping[str, Any], *,
                     max_tokens: int | None) -> SamplingParams:
    """The caller's fields, then the model's defaults, then :class:`SamplingParams`' own.

    ``given``: SamplingParams fields as the caller set them, None meaning "not set".
    ``model_defaults``: ``ModelInfo.sampling_defaults`` (may be empty). ``max_tokens``:
    the length when neither the caller nor the model names one (the CLI's 64, OpenAI's
    16 for completions, ``LLM``'s 16); when the model names one (``max_new_tokens``) it
    is left None, and the Tokenizer applies the model's, capped by the room the prompt
    leaves in the context. Raises :class:`InvalidRequest` for a value of the wrong type
    (from generation_config.json, say); :meth:`SamplingParams.validate` is the caller's.
    """
    fields = {k: v for k, v in given.items() if v is not None}
    try:
        for key, kind in MODEL_DEFAULT_FIELDS.items():
            value = fields.get(key, model_defaults.get(key))
            if value is not None:
                fields[key] = kind(value)
        if "max_tokens" not in fields:
            fields["max_tokens"] = None if "max_tokens" in model_defaults else max_tokens
        return SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"bad sampling parameter: {exc}") from None
