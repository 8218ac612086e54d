"""The Detokenizer actor: token ids in, text deltas out.

Owns, per rid, the incremental decode state and the stop-string matcher. It may
live in its own process (the ``pipeline`` topology): decoding is CPU work that
grows with the number of streams, and keeping it off the Scheduler's loop keeps
step planning on time.

Contract (invariant 7): the deltas of one rid concatenate to
``decode(all its token ids)``, never split a UTF-8 character, and, with stop
strings, stop exactly before the first stop string (or after it, with
``include_stop_str_in_output``). Text that could be the start of a stop string is
held back until it is known not to be.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import attrs

from actorllm.wire.mailbox import Inbox, Outbox
from actorllm.wire.messages import (
    DetokenizerInput,
    DetokSetup,
    FinishReason,
    FrontendInput,
    OutputBatch,
    ReplicaLost,
    RequestFinished,
    SchedulerInput,
    StopMatched,
    TextDelta,
    TokenLogprob,
    TokenOut,
)

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
                self._append(t)
                parts.append(piece)
            return parts[0] if len(parts) == 1 else "".join(parts)
        if isinstance(known, str):
            self._append(token_ids[0])
            return known
        return self._push_windowed(token_ids, known)

    def _append(self, token: int) -> None:
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


@attrs.define
class DecodeState:
    decoder: IncrementalDecoder
    matcher: StopMatcher | None  # None without stop strings: the text goes out as it comes
    num_prompt_tokens: int = 0
    incarnation: int = 0
    stopped: str | None = None  # the stop string that matched; output is over
    replica: int = 0  # the data-parallel replica whose Scheduler runs it


class Detokenizer:
    """The actor: one TokenBatch in, one OutputBatch out (plus StopMatched when needed).

    Per step, most rows cost a table lookup (see :class:`IncrementalDecoder`); the rows of
    one token that need the windowed decode get theirs in one ``decode_batch`` call
    before the rows are processed, in order, as ever.
    """

    def __init__(
        self,
        decode: DecodeFn,
        inbox: Inbox[DetokenizerInput],
        frontend: Outbox[FrontendInput],
        scheduler: Outbox[SchedulerInput],
        *,
        schedulers: Sequence[Outbox[SchedulerInput]] | None = None,
    ) -> None:
        self.decode = decode
        # Only a tokenizers-backed decode has a table and a batch decode; any other
        # DecodeFn takes the windowed path for every token.
        self.pieces: PieceTable = decode.pieces() if isinstance(decode, TokenizerDecode) else ()
        self.decode_batch = decode.decode_batch if isinstance(decode, TokenizerDecode) else None
        self.inbox, self.frontend, self.scheduler = inbox, frontend, scheduler
        # With data parallelism, one per replica: a StopMatched goes back to the replica
        # whose TokenBatch it came from (the batch's stats name it).
        self.schedulers = list(schedulers) if schedulers else [scheduler]
        self.lost: set[int] = set()  # replicas whose process died (ReplicaLost)
        self.states: dict[str, DecodeState] = {}
        # Seconds spent on each replica's batches, summed: stamped on that replica's stats
        # as ``detokenize_s`` (a running total, as the Scheduler's own timers are).
        self.busy_s: dict[int, float] = {}

    async def run(self) -> None:
        async for batch in self.inbox:
            if isinstance(batch, ReplicaLost):
                self.lost.add(batch.replica)
                for rid in [r for r, st in self.states.items() if st.replica == batch.replica]:
                    del self.states[rid]
                continue
            replica = batch.stats.replica if batch.stats is not None else 0
            if replica in self.lost:
                continue  # late words of a dead replica: its requests have failed already
            t0 = time.perf_counter()
            deltas: list[TextDelta] = []
            finished: list[RequestFinished] = []
            stops: list[StopMatched] = []
            known = self._prepare(batch.outputs)
            for out, row in zip(batch.outputs, known, strict=True):
                self._process(out, deltas, finished, stops, replica, row)
            busy = self.busy_s[replica] = self.busy_s.get(replica, 0.0) + (
                time.perf_counter() - t0)
            stats = batch.stats
            if stats is not None:
                stats = attrs.evolve(stats, detokenize_s=busy)
            for stop in stops:
                await self.schedulers[replica].send(stop)
            if deltas or finished or batch.freed or stats is not None:
                await self.frontend.send(
                    OutputBatch(tuple(deltas), tuple(finished), batch.freed, stats)
                )

    def _prepare(self, outputs: Sequence[TokenOut]) -> list[Known]:
        """Per row of one token: its piece if the table serves it, else the decodes of its
        window, all rows' in one ``decode_batch`` call; None for any other row.

        Only a rid's first row in the batch is prepared: a later one must see the state the
        earlier one leaves.
        """
        known: list[Known] = [None] * len(outputs)
        states, pieces = self.states, self.pieces
        size = len(pieces)
        windows: dict[bool, list[tuple[int, list[int], list[int]]]] = {}
        seen: set[str] = set()
        for i, out in enumerate(outputs):
            rid = out.rid
            if rid in seen:
                continue
            seen.add(rid)
            st = states.get(rid)
            if st is None or st.stopped is not None or len(out.token_ids) != 1:
                continue
            dec = st.decoder
            t = out.token_ids[0]
            if dec.plain and 0 <= t < size and (piece := pieces[t]) is not None:
                known[i] = piece
            elif self.decode_batch is not None:
                before, after = dec.window(out.token_ids)
                windows.setdefault(dec.skip_special, []).append((i, before, after))
        for skip, group in windows.items():
            if len(group) < 2:
                continue  # one row: _process decodes it as cheaply
            texts = self.decode_batch([ids for _, b, a in group for ids in (b, a)], skip)
            for k, (i, _, _) in enumerate(group):
                known[i] = (texts[2 * k], texts[2 * k + 1])
        return known

    def _state(self, rid: str, setup: DetokSetup | None, replica: int = 0) -> DecodeState:
        st = self.states.get(rid)
        if st is None:
            setup = setup or DetokSetup()
            st = self.states[rid] = DecodeState(
                IncrementalDecoder(self.decode, setup.skip_special_tokens, pieces=self.pieces),
                StopMatcher(setup.stop, setup.include_stop_str_in_output) if setup.stop else None,
                setup.num_prompt_tokens,
                setup.incarnation,
                replica=replica,
            )
        return st

    def _process(self, out: TokenOut, deltas: list[TextDelta], finished: list[RequestFinished],
                 stops: list[StopMatched], replica: int = 0,
                 known: Known = None) -> None:
        """One row. ``known``: what :meth:`_prepare` worked out for it."""
        st = self.states.get(out.rid) or self._state(out.rid, out.spec, replica)
        final = out.finish_reason is not None
        if self._emitting(st):
            token_ids = out.token_ids
            matcher = st.matcher
            if matcher is None:
                # No stop string can cut the row: its text goes out whole, no per-token work.
                text = st.decoder.push(token_ids, known) if token_ids else ""
                if final:
                    text += st.decoder.flush()
                kept_ids = token_ids
                kept_lps = out.logprobs if len(out.logprobs) <= len(token_ids) else (
                    out.logprobs[: len(token_ids)])
            else:
                text, kept_ids, kept_lps = self._match(out, st, matcher, final, stops, known)
            if text or kept_ids or out.prompt_logprobs:
                # Prompt logprobs pass through untouched: they come before any token, so
                # a stop string can never have cut them off.
                deltas.append(TextDelta(out.rid, text, kept_ids, kept_lps,
                                        out.prompt_logprobs, out.prompt_token_ids))
        if final:
            reason, stop_reason = out.finish_reason, out.stop_reason
            if st.stopped is not None and reason not in (FinishReason.ABORT, FinishReason.ERROR):
                reason, stop_reason = FinishReason.STOP, st.stopped
            finished.append(RequestFinished(out.rid, reason or FinishReason.ERROR, stop_reason,
                                            st.num_prompt_tokens, out.error, out.queue_s,
                                            out.cached_tokens))
            del self.states[out.rid]

    def _match(self, out: TokenOut, st: DecodeState, matcher: StopMatcher, final: bool,
               stops: list[StopMatched], known: Known,
               ) -> tuple[str, tuple[int, ...], tuple[TokenLogprob, ...]]:
        """A row of a request with stop strings: token by token, so the tokens delivered
        end with the one that completed a stop string."""
        kept_ids: list[int] = []
        kept_lps: list[TokenLogprob] = []
        text_parts: list[str] = []
        last_i = len(out.token_ids) - 1
        for i, tid in enumerate(out.token_ids):
            piece = st.decoder.push((tid,), known)  # known: only for a row of one token
            last = final and i == last_i
            if last:
                piece += st.decoder.flush()
            emit, stop = matcher.feed(piece, final=last)
            kept_ids.append(tid)
            if i < len(out.logprobs):
                kept_lps.append(out.logprobs[i])
            text_parts.append(emit)
            if stop is not None and st.stopped is None:
                st.stopped = stop
                stops.append(StopMatched(out.rid, stop, st.incarnation))
                break
        if not out.token_ids and final:
            emit, _ = matcher.feed(st.decoder.flush(), final=True)
            text_parts.append(emit)
        return "".join(text_parts), tuple(kept_ids), tuple(kept_lps)

    def _emitting(self, st: DecodeState) -> bool:
        """Nothing reaches the client after a stop string matched (invariant 2)."""
        return st.stopped is None

    def drain_problems(self) -> list[str]:
        return [f"detokenizer holds {sorted(self.states)}"] if self.states else []
