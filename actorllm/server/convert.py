"""Request in: HTTP schema objects -> engine objects (sampling parameters, messages, prompts).

Nothing here touches a running engine; the functions take what they need (the model's
vocabulary size and generation defaults) as arguments. The way back (token ids to
strings and logprobs) is ``logprobs.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from actorllm.server.constraints import structured_output
from actorllm.server.schemas import ChatCompletionRequest, ChatMessageIn, CompletionRequest
from actorllm.wire.messages import ChatMessage, GenerateRequest, InvalidRequest, SamplingParams
from actorllm.wire.sampling import resolve_sampling

_INT64 = 2**63
# A completion's length when the request names none: None leaves it to the Tokenizer
# (the model's max_new_tokens, else the room the prompt leaves), for chat and completions.
HTTP_MAX_TOKENS: int | None = None


def _int_in_range(value: int | None, param: str, low: int = -_INT64, high: int = _INT64) -> None:
    # The codec carries 64-bit integers; a bigger one must be a 400 here, not a crash later.
    if value is not None and not low <= value < high:
        raise InvalidRequest(f"{param} is out of range, got {value}", param)


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _logit_bias(bias: Mapping[str, float] | None) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}",
                                 "logit_bias") from None
        _int_in_range(tid, "logit_bias")
        out.append((tid, float(value)))
    return tuple(sorted(out))


def _lengths(body: ChatCompletionRequest | CompletionRequest
             ) -> tuple[int | None, str, int | None, str]:
    """``max_tokens`` and ``logprobs`` as the engine takes them, with the names the
    request spells them by (chat: ``max_completion_tokens``, ``top_logprobs``)."""
    if isinstance(body, ChatCompletionRequest):
        if body.max_completion_tokens is not None:
            max_tokens, max_param = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = body.max_tokens, "max_tokens"
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", "top_logprobs")
        return max_tokens, max_param, (body.top_logprobs or 0) if body.logprobs else None, \
            "top_logprobs"
    return body.max_tokens, "max_tokens", body.logprobs, "logprobs"


def _best_of(body: ChatCompletionRequest | CompletionRequest, n: int,
             logprobs: int | None) -> tuple[int, int | None]:
    """vLLM's ``best_of``: run that many candidates; the renderer returns the ``n`` with the
    highest cumulative logprob, so each token's logprob is needed. -> (n, logprobs)."""
    best_of = getattr(body, "best_of", None)
    if best_of is None or best_of == n:
        return n, logprobs
    if best_of < n:
        raise InvalidRequest(f"best_of must be at least n ({n}), got {best_of}", "best_of")
    if body.stream:
        raise InvalidRequest("best_of is not available with stream: true", "best_of")
    return best_of, 0 if logprobs is None else logprobs


def sampling_params(body: ChatCompletionRequest | CompletionRequest, *,
                    defaults: Mapping[str, Any], vocab_size: int) -> SamplingParams:
    """The request's sampling parameters, with the model's generation config filling gaps.

    ``defaults`` is ``ModelInfo.sampling_defaults``; :func:`resolve_sampling` applies it
    as it does for the CLI and ``LLM``. A missing ``max_tokens`` stays None
    (``HTTP_MAX_TOKENS``), and the Tokenizer applies the model's ``max_new_tokens``,
    capped by the room the prompt leaves. Raises :class:`InvalidRequest` naming the
    request's own parameter.
    """
    max_tokens, max_param, logprobs, lp_param = _lengths(body)
    for value, name in ((body.n, "n"), (max_tokens, max_param), (body.top_k, "top_k"),
                        (body.min_tokens, "min_tokens"), (body.seed, "seed"),
                        (logprobs, lp_param), (body.prompt_logprobs, "prompt_logprobs")):
        _int_in_range(value, name)
    echo = isinstance(body, CompletionRequest) and bool(body.echo)
    if max_tokens == 0 and not echo:
        # Generating nothing only makes sense when the prompt itself is the answer.
        raise InvalidRequest(f"{max_param} must be at least 1 (0 only with echo), got 0",
                             max_param)
    if echo and body.truncate_prompt_tokens is not None:
        # The echo is the prompt as sent; the tokens that ran would be only its tail.
        raise InvalidRequest("truncate_prompt_tokens is not available with echo",
                             "truncate_prompt_tokens")
    if body.prompt_logprobs is not None and body.stream:
        raise InvalidRequest("prompt_logprobs is not available with stream: true",
                             "prompt_logprobs")
    prompt_logprobs = body.prompt_logprobs
    if echo and logprobs is not None:
        # The echoed prompt tokens get logprobs too (OpenAI's legacy completions, vLLM).
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    n, logprobs = _best_of(body, body.n if body.n is not None else 1, logprobs)
    for tid in body.stop_token_ids or ():
        _int_in_range(tid, "stop_token_ids")
    given = {
        "n": n, "max_tokens": max_tokens, "min_tokens": body.min_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "min_p": body.min_p, "seed": body.seed, "stop": _stop(body.stop),
        "stop_token_ids": tuple(body.stop_token_ids or ()), "ignore_eos": body.ignore_eos,
        "presence_penalty": _float(body.presence_penalty),
        "frequency_penalty": _float(body.frequency_penalty),
        "repetition_penalty": body.repetition_penalty, "logit_bias": _logit_bias(body.logit_bias),
        "logprobs": logprobs, "include_stop_str_in_output": body.include_stop_str_in_output,
        "skip_special_tokens": body.skip_special_tokens, "prompt_logprobs": prompt_logprobs,
        "structured": structured_output(body), "priority": body.priority,
        "truncate_prompt_tokens": body.truncate_prompt_tokens,
    }
    params = resolve_sampling(given, defaults, max_tokens=HTTP_MAX_TOKENS)
    try:
        params.validate(vocab_size)
    except InvalidRequest as exc:
        # Name the parameter the way this endpoint's request spells it.
        renames = {"max_tokens": max_param, "logprobs": lp_param}
        raise InvalidRequest(str(exc), renames.get(exc.param or "", exc.param)) from None
    return params


def include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """``stream_options.include_usage``: a usage chunk before ``[DONE]``."""
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)


def _extra(m: ChatMessageIn) -> str:
    """A message's template keys beyond role and content, as JSON (empty: none)."""
    extra: dict[str, Any] = {}
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:  # the template gets arguments as an object (HF's convention)
                args: Any = json.loads(c.function.arguments)
            except ValueError:
                args = c.function.arguments
            calls.append({"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": args}})
        extra["tool_calls"] = calls
    if m.tool_call_id is not None:
        extra["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        extra["name"] = m.name
    return json.dumps(extra, ensure_ascii=False) if extra else ""


def chat_messages(messages: list[ChatMessageIn]) -> tuple[ChatMessage, ...]:
    """OpenAI messages -> engine messages: text content, and the tool calls an assistant
    made or the call a ``tool`` message answers, for the chat template."""
    if not messages:
        raise InvalidRequest("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        if m.content is None:
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            pieces = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequest(f"content part type {part.type!r} is not supported; "
                                         "only text", f"messages[{i}].content[{j}]")
                pieces.append(part.text)
            text = "".join(pieces)
        if m.role == "tool" and m.tool_call_id is None:
            raise InvalidRequest("a tool message needs tool_call_id",
                                 f"messages[{i}].tool_call_id")
        # "developer" is OpenAI's newer name for system instructions; chat templates
        # know "system".
        role = "system" if m.role == "developer" else m.role
        out.append(ChatMessage(role, text, _extra(m)))
    return tuple(out)


def prompt_request(base: str, i: int, count: int, params: SamplingParams,
                   prompt: str | tuple[int, ...], now: float,
                   return_prompt_ids: bool = False) -> GenerateRequest:
    """The engine request for prompt ``i`` of ``count`` (its rid: ``base`` when alone, else
    ``base-i``), from text or token ids."""
    rid = base if count == 1 else f"{base}-{i}"
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    return GenerateRequest(rid, params, prompt=text, prompt_token_ids=ids, arrival_time=now,
                           return_prompt_ids=return_prompt_ids)


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]
                       ) -> list[str | tuple[int, ...]]:
    """A completions ``prompt`` -> one entry per engine request (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [_token_ids(prompt)]  # type: ignore[arg-type]
    out: list[str | tuple[int, ...]] = []
    for p in prompt:
        if isinstance(p, str):
            out.append(p)
        else:
            if not p:
                raise InvalidRequest("a token-id prompt must not be empty", "prompt")
            out.append(_token_ids(p))  # type: ignore[arg-type]
    return out


def _token_ids(ids: list[int]) -> tuple[int, ...]:
    # Whether an id is in the vocabulary is the Tokenizer's to say; whether it fits the
    # codec is ours (found by fuzz/fuzz_request.py).
    for t in ids:
        _int_in_range(t, "prompt")
    return tuple(ids)
