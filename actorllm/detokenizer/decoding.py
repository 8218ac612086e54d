"""Incremental decoding for the Detokenizer: token ids to text, a few at a time.

:class:`IncrementalDecoder` re-decodes a short window and emits what became stable;
most tokens skip that through a table of context-free pieces built once per tokenizer
(:func:`build_piece_table`). :class:`StopMatcher` holds back the tail of the text that
could begin a stop string. Both are pure: the actor in ``actor.py`` owns one of each per
rid.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import attrs

log = logging.getLogger(__name__)

# decode(ids, skip_special_tokens) -> text
DecodeFn = Callable[[Sequence[int], bool], str]
# token id -> the text it appends after any plain text, or None where that depends on context
PieceTable: TypeAlias = tuple[str | None, ...]
# What the batch pass worked out for a row of one token: its piece, or its window's decodes.
Known: TypeAlias = str | tuple[str, str] | None

# Texts whose single tokens anchor the piece table's checks: one ends in a letter, one in
# punctuation, so a piece that changes with what precedes it shows up as a disagreement.
_ANCHOR_TEXTS = ("a", ".", "0", "x", ",", " the")
_PIECES: weakref.WeakKeyDictionary[Any, PieceTable] = weakref.WeakKeyDictionary()


class TokenizerDecode:
    """A ``DecodeFn`` over a ``tokenizers.Tokenizer`` (no clean-up of spaces), with what the
    fast path needs: a batch decode and the tokenizer's piece table."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def __call__(self, ids: Sequence[int], skip_special: bool) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)  # type: ignore[no-any-return]

    def decode_batch(self, seqs: list[list[int]], skip_special: bool) -> list[str]:
        """Several decodes in one call into the tokenizers library."""
        return self.backend.decode_batch(seqs, skip_special_tokens=skip_special)  # type: ignore[no-any-return]

    def pieces(self) -> PieceTable:
        """The tokenizer's piece table, built on first use and cached per tokenizer."""
        table = _PIECES.get(self.backend)
        if table is None:
            table = _PIECES[self.backend] = build_piece_table(self.backend)
        return table


def hf_decode_fn(hf_tokenizer: object) -> TokenizerDecode:
    """Decode through the fast tokenizer's Rust backend (no clean-up of spaces)."""
    return TokenizerDecode(hf_tokenizer.backend_tokenizer)  # type: ignore[attr-defined]


def build_piece_table(backend: Any) -> PieceTable:
    """For each token id, the text it appends to plain text, derived from the tokenizer.

    ``piece[t]`` is kept only where ``decode([a, t]) == decode([a]) + piece[t]`` for two
    anchors ``a`` of different kinds and ``decode([b, t, a])`` extends
    ``decode([b]) + piece[t]`` by ``a``'s own piece (so ``t`` does not change the text
    that follows it either). Added tokens (special or not) are left out: tokenizers may
    decode them apart from their neighbours. So are pieces with a U+FFFD (a partial UTF-8
    character of a byte-level vocabulary, or a byte-fallback token) and empty ones. A
    tokenizer without two usable anchors gets an empty table: everything takes the
    windowed decode.
    """
    size = backend.get_vocab_size(with_added_tokens=True)
    added = set(backend.get_added_tokens_decoder())

    def decode(ids: list[int]) -> str:
        return backend.decode(ids, skip_special_tokens=False)  # type: ignore[no-any-return]

    anchors: list[int] = []
    for text in _ANCHOR_TEXTS:
        ids = backend.encode(text, add_special_tokens=False).ids
        if len(ids) == 1 and ids[0] not in added and ids[0] not in anchors:
            alone = decode(ids)
            if alone and "\ufffd" not in alone:
                anchors.append(ids[0])
        if len(anchors) == 2:
            break
    if len(anchors) < 2:
        log.info("no anchor tokens: every token takes the windowed decode")
        return ()
    a, b = anchors
    cands = [t for t in range(size) if t not in added]
    after_a = backend.decode_batch([[a, t] for t in cands], skip_special_tokens=False)
    after_b = backend.decode_batch([[b, t] for t in cands], skip_special_tokens=False)
    then_a = backend.decode_batch([[b, t, a] for t in cands], skip_special_tokens=False)
    text_a, text_b = decode([a]), decode([b])
    piece_a = decode([b, a])[len(text_b) :]
    table: list[str | None] = [None] * size
    for t, ta, tb, tba in zip(cands, after_a, after_b, then_a, strict=True):
        piece = ta[len(text_a) :]
        if (piece and "\ufffd" not in piece and ta.startswith(text_a)
                and tb == text_b + piece and tba == text_b + piece + piece_a):
            table[t] = piece
    log.debug("piece table: %d of %d tokens context-free", size - table.count(None), size)
    return tuple(table)


@attrs.define
class IncrementalDecoder:
    """vLLM-style windowed decoding: re-decode a short window, emit what became stable.

    ``prefix`` marks where the window starts, ``read`` where the already-emitted text
    ends. A piece that still ends in U+FFFD is an incomplete UTF-8 character: wait.

    With a piece table, a token appends its piece without any decode while that is
    exact: something was emitted already (a request's first token may lose a leading
    space), nothing is pending (``read`` is at the end), the last token is itself in the
    table, and so is the new one. It then moves ``prefix``/``read`` as a windowed push of
    that one token would, so a later windowed push decodes from the right place.
    """

    decode: DecodeFn
    skip_special: bool = True
    ids: list[int] = attrs.Factory(list)
    prefix: int = 0
    read: int = 0
    pieces: PieceTable = ()
    # Nothing pending and the last id has a piece: the next piece may go without a decode.
    plain: bool = False

    def fast_piece(self, token: int) -> str | None:
        """The text ``token`` appends without decoding, or None if it needs the window."""
        if self.plain and 0 <= token < len(self.pieces):
            return self.pieces[token]
        return None

    def window(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """The two id lists a windowed push of ``token_ids`` decodes (before, after)."""
        return self.ids[self.prefix : self.read], [*self.ids[self.prefix :], *token_ids]

    def push(self, token_ids: Sequence[int], known: Known = None) -> str:
        """Append ``token_ids``; returns the text that became stable.

        ``known``, for one token, when the caller worked it out beforehand: its piece (from
        :meth:`fast_piece`, in this state) or the two decodes of :meth:`window`.
        """
        if known is None:
            if not self.pieces:
                return self._push_windowed(token_ids, None)
            parts: list[str] = []
            for i, t in enumerate(token_ids):
                piece = self.fast_piece(t)
                if piece is None:
                    parts.append(self._push_windowed(token_ids[i:], None))
                    break
                self.append(t)
                parts.append(piece)
            return parts[0] if len(parts) == 1 else "".join(parts)
        if isinstance(known, str):
            self.append(token_ids[0])
            return known
        return self._push_windowed(token_ids, known)

    def append(self, token: int) -> None:
        """A token whose piece went out: as a windowed push of it alone would leave things
        (``plain`` stays True: it has a piece)."""
        n = len(self.ids)
        self.ids.append(token)
        self.prefix, self.read = n, n + 1

    def _push_windowed(self, token_ids: Sequence[int], decoded: tuple[str, str] | None) -> str:
        if decoded is None:
            before = self.decode(self.ids[self.prefix : self.read], self.skip_special)
            self.ids.extend(token_ids)
            window = self.decode(self.ids[self.prefix :], self.skip_special)
        else:
            before, window = decoded
            self.ids.extend(token_ids)
        if len(window) > len(before) and not window.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            last = self.ids[-1]
            self.plain = 0 <= last < len(self.pieces) and self.pieces[last] is not None
            return window[len(before) :]
        self.plain = False
        return ""

    def flush(self) -> str:
        """At the end: whatever is left, incomplete characters included."""
        if self.read == len(self.ids):
            return ""  # everything decoded is out already
        before = self.decode(self.ids[self.prefix : self.read], self.skip_special)
        window = self.decode(self.ids[self.prefix :], self.skip_special)
        self.prefix = self.read = len(self.ids)
        self.plain = False  # what is out may end in a partial character
        return window[len(before) :]


@attrs.define
class StopMatcher:
    """Holds back the tail that could begin a stop string."""

    stops: tuple[str, ...]
    include: bool = False
    held: str = ""
    # How much of the text's end could still begin a stop string: what to hold back.
    keep: int = attrs.field(init=False)

    @keep.default
    def _keep(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1

    def feed(self, text: str, final: bool) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string if one matched)."""
        buf = self.held + text if self.held else text
        hits: list[tuple[int, str]] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0:
                if hits is None:
                    hits = []
                hits.append((i, s))
        if hits:
            # The stop that is complete first wins (then the one that began first):
            # what a client streaming the text would see, however it was chunked.
            i, stop = min(hits, key=lambda h: (h[0] + len(h[1]), h[0]))
            self.held = ""
            return buf[: i + len(stop)] if self.include else buf[:i], stop
        if final or not self.stops:
            self.held = ""
            return buf, None
        cut = max(len(buf) - self.keep, 0)
        self.held = buf[cut:]
        return buf[:cut], None
