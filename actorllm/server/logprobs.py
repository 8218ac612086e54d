"""Token ids back to OpenAI's shapes: token texts and bytes, and logprobs in each layout.

The out direction only (``render.py`` uses it); request conversion is ``convert.py``.
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Sequence
from typing import Any

from actorllm.wire.messages import TokenLogprob

# JSON has no -inf; a token the sampler ruled out gets this instead (what vLLM sends).
_MIN_LOGPROB = -9999.0


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
