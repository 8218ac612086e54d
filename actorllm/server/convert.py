"""The edge: HTTP schema objects in, engine objects out (and token ids back to strings).

Nothing here touches a running engine; the functions take what they need (the model's
vocabulary size, generation defaults, the tokenizer) as arguments.
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from actorllm.server.constraints import structured_output
from actorllm.server.schemas import ChatCompletionRequest, ChatMessageIn, CompletionRequest
from actorllm.wire.messages import (
    ChatMessage,
    InvalidRequest,
    SamplingParams,
    TokenLogprob,
)

_INT64 = 2**63
# JSON has no -inf; a token the sampler ruled out gets this instead (what vLLM sends).
_MIN_LOGPROB = -9999.0


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


def sampling_params(body: ChatCompletionRequest | CompletionRequest, *,
                    defaults: Mapping[str, Any], vocab_size: int) -> SamplingParams:
    """The request's sampling parameters, with the model's generation config filling gaps.

    ``defaults`` is ``ModelInfo.sampling_defaults``, the one reading of the model's
    generation_config.json that the CLI uses too: ``temperature``, ``top_p``, ``top_k``,
    ``min_p`` and ``repetition_penalty`` fill what the request leaves out; a missing
    ``max_tokens`` stays None, and the Tokenizer applies the model's ``max_new_tokens``,
    capped by the room the prompt leaves. Raises :class:`InvalidRequest` naming the
    request's own parameter.
    """

    def pick(value: Any, key: str, fallback: Any) -> Any:
        if value is not None:
            return value
        got = defaults.get(key)
        return fallback if got is None else got

    chat = isinstance(body, ChatCompletionRequest)
    if chat:
        assert isinstance(body, ChatCompletionRequest)
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        assert isinstance(body, CompletionRequest)
        max_param, max_tokens, logprobs = "max_tokens", body.max_tokens, body.logprobs
    for value, name in ((body.n, "n"), (max_tokens, max_param), (body.top_k, "top_k"),
                        (body.min_tokens, "min_tokens"), (body.seed, "seed"),
                        (logprobs, "top_logprobs" if chat else "logprobs"),
                        (body.prompt_logprobs, "prompt_logprobs")):
        _int_in_range(value, name)
    echo = not chat and bool(getattr(body, "echo", False))
    if max_tokens == 0 and not echo:
        # Generating nothing only makes sense when the prompt itself is the answer.
        raise InvalidRequest(f"{max_param} must be at least 1 (0 only with echo), got 0",
                             max_param)
    if body.prompt_logprobs is not None and body.stream:
        raise InvalidRequest("prompt_logprobs is not available with stream: true",
                             "prompt_logprobs")
    prompt_logprobs = body.prompt_logprobs
    if echo and logprobs is not None:
        # The echoed prompt tokens get logprobs too (OpenAI's legacy completions, vLLM).
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    n = body.n if body.n is not None else 1
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != n:
        # vLLM's best_of: best_of candidates, of which the renderer returns the n with
        # the highest cumulative logprob; so each token's logprob is needed.
        if best_of < n:
            raise InvalidRequest(f"best_of must be at least n ({n}), got {best_of}", "best_of")
        if body.stream:
            raise InvalidRequest("best_of is not available with stream: true", "best_of")
        n, logprobs = best_of, 0 if logprobs is None else logprobs
    for tid in body.stop_token_ids or ():
        _int_in_range(tid, "stop_token_ids")
    logit_bias = _logit_bias(body.logit_bias)
    structured = structured_output(body)
    try:
        params = SamplingParams(
            n=n,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens or 0,
            temperature=float(pick(body.temperature, "temperature", 1.0)),
            top_p=float(pick(body.top_p, "top_p", 1.0)),
            top_k=int(pick(body.top_k, "top_k", 0)),
            min_p=float(pick(body.min_p, "min_p", 0.0)),
            seed=body.seed,
            stop=_stop(body.stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=bool(body.ignore_eos),
            presence_penalty=float(body.presence_penalty or 0.0),
            frequency_penalty=float(body.frequency_penalty or 0.0),
            repetition_penalty=float(pick(body.repetition_penalty, "repetition_penalty", 1.0)),
            logit_bias=logit_bias,
            logprobs=logprobs,
            include_stop_str_in_output=bool(body.include_stop_str_in_output),
            skip_special_tokens=body.skip_special_tokens is not False,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
            priority=body.priority or 0,
        )
    except (TypeError, ValueError) as exc:  # a generation_config.json value of a wrong type
        raise InvalidRequest(f"bad sampling parameter: {exc}") from None
    try:
        params.validate(vocab_size)
    except InvalidRequest as exc:
        # Name the parameter the way this endpoint's request spells it.
        renames = {"max_tokens": max_param, "logprobs": "top_logprobs" if chat else "logprobs"}
        raise InvalidRequest(str(exc), renames.get(exc.param or "", exc.param)) from None
    return params


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
        out.append(ChatMessage(m.role, text, _extra(m)))
    return tuple(out)


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


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE writes tokens in it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _is_byte_level(tokenizer: Any) -> bool:
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
    except Exception:  # not a fast tokenizer: fall back to decoding
        return False
    decoder = spec.get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or ()]
    return "ByteLevel" in kinds


class TokenTexts:
    """Token id -> (text, UTF-8 bytes), cached, for logprob responses.

    For byte-level BPE the bytes are exact even when a token holds part of a character
    (its text then shows U+FFFD, as in vLLM); other tokenizers decode the single token.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._byte_decoder = ({c: b for b, c in _bytes_to_unicode().items()}
                              if _is_byte_level(tokenizer) else None)
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        text: str | None = None
        raw: bytes | None = None
        if self._byte_decoder is not None and token_id not in self._special:
            piece = self.tok.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._byte_decoder for c in piece):
                raw = bytes(self._byte_decoder[c] for c in piece)
                text = raw.decode("utf-8", errors="replace")
        if text is None or raw is None:
            text = self.tok.decode([token_id], skip_special_tokens=False)
            raw = text.encode("utf-8")
        if len(self._cache) < 1 << 20:
            self._cache[token_id] = (text, raw)
        return text, raw


def finite(logprob: float) -> float:
    """A logprob JSON can carry."""
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


def chat_logprobs(texts: TokenTexts, lps: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
    """Engine logprobs -> ``logprobs.content`` entries of a chat response."""
    out = []
    for lp in lps:
        text, raw = texts.get(lp.token_id)
        top = []
        for tid, value in lp.top:
            t_text, t_raw = texts.get(tid)
            top.append({"token": t_text, "logprob": finite(value), "bytes": list(t_raw)})
        out.append({"token": text, "logprob": finite(lp.logprob), "bytes": list(raw),
                    "top_logprobs": top})
    return out


def completion_logprobs(texts: TokenTexts, lps: tuple[TokenLogprob, ...],
                        offset: int) -> tuple[dict[str, list[Any]], int]:
    """Engine logprobs -> the legacy completions shape; returns it and the next offset.

    ``top_logprobs`` holds the chosen token too, as vLLM and OpenAI do.
    """
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for lp in lps:
        text, _ = texts.get(lp.token_id)
        tokens.append(text)
        token_lps.append(finite(lp.logprob))
        top = {texts.get(tid)[0]: finite(value) for tid, value in lp.top}
        top.setdefault(text, finite(lp.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


class PromptOffsets:
    """``text_offset`` of echoed prompt tokens: where each token's text begins in the echo.

    The echo is the prompt as the client gave it (text), or its decoding (token ids,
    special tokens included). Token bytes go through an incremental UTF-8 decoder, so a
    token that holds part of a character starts where that character does, and a special
    token that the text prompt does not show (``<|bos|>``) takes no room.
    """

    def __init__(self, texts: TokenTexts, *, skip_special: bool, limit: int) -> None:
        self.texts, self.skip_special, self.limit = texts, skip_special, limit
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def next(self, token_id: int) -> int:
        """The offset of ``token_id``, the next prompt token; advances past it."""
        offset = min(self._chars, self.limit)
        if not (self.skip_special and self.texts.is_special(token_id)):
            self._chars += len(self._decoder.decode(self.texts.get(token_id)[1]))
        return offset


def echo_logprobs(texts: TokenTexts, lps: Sequence[TokenLogprob | None],
                  prompt_ids: Sequence[int], start: int, k: int,
                  offsets: PromptOffsets) -> dict[str, list[Any]]:
    """Prompt positions ``start, start + 1, ...`` in the legacy completions shape.

    Position 0 has no logprob: ``null`` in ``token_logprobs`` and ``top_logprobs``, as in
    OpenAI's and vLLM's echo. ``top_logprobs`` holds ``k`` alternatives and the token.
    """
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offs: list[int] = []
    for i, lp in enumerate(lps):
        tid = prompt_ids[start + i] if lp is None else lp.token_id
        text, _ = texts.get(tid)
        tokens.append(text)
        offs.append(offsets.next(tid))
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(finite(lp.logprob))
        top = {texts.get(t)[0]: finite(v) for t, v in lp.top[:k]}
        top.setdefault(text, finite(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offs}


def vllm_prompt_logprobs(texts: TokenTexts, lps: Sequence[TokenLogprob | None],
                         k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per position ``{token id: {logprob, rank, decoded_token}}``.

    The prompt's own token and the top ``k``; a rank is known for the top entries only
    (the prompt token outside them gets ``rank: null``).
    """
    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry: dict[str, dict[str, Any]] = {}
        for rank, (tid, value) in enumerate(lp.top[:k], start=1):
            entry[str(tid)] = {"logprob": finite(value), "rank": rank,
                               "decoded_token": texts.get(tid)[0]}
        if str(lp.token_id) not in entry:
            ranks = [r for r, (tid, _) in enumerate(lp.top, start=1) if tid == lp.token_id]
            entry[str(lp.token_id)] = {"logprob": finite(lp.logprob),
                                       "rank": ranks[0] if ranks else None,
                                       "decoded_token": texts.get(lp.token_id)[0]}
        out.append(entry)
    return out
