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
from collections.abc import Sequence

import attrs

from actorllm.detokenizer.columns import DeltaColumns
from actorllm.detokenizer.decoding import (
    DecodeFn,
    IncrementalDecoder,
    Known,
    PieceTable,
    StopMatcher,
    TokenizerDecode,
)
from actorllm.wire.mailbox import Inbox, Outbox, batches, send_soon
from actorllm.wire.messages import (
    DetokenizerInput,
    DetokSetup,
    FinishReason,
    FrontendInput,
    ReplicaLost,
    RequestFinished,
    SchedulerInput,
    StopMatched,
    TextDelta,
    TokenBatch,
    TokenLogprob,
    TokenOut,
)

log = logging.getLogger(__name__)


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
        """The steps waiting are decoded in one turn of the loop (wire/mailbox.py): an
        actor that has fallen behind catches up without a wake-up per step."""
        async for msgs in batches(self.inbox):
            for msg in msgs:
                await self.handle(msg)

    async def handle(self, batch: DetokenizerInput) -> None:
        """One message: a step's tokens, or a replica's death."""
        if isinstance(batch, ReplicaLost):
            self.lost.add(batch.replica)
            for rid in [r for r, st in self.states.items() if st.replica == batch.replica]:
                del self.states[rid]
            return
        replica = batch.stats.replica if batch.stats is not None else 0
        if replica in self.lost:
            return  # late words of a dead replica: its requests have failed already
        t0 = time.perf_counter()
        deltas = DeltaColumns()
        finished: list[RequestFinished] = []
        stops: list[StopMatched] = []
        self._rows(batch, deltas, finished, stops, replica)
        busy = self.busy_s[replica] = self.busy_s.get(replica, 0.0) + (
            time.perf_counter() - t0)
        stats = batch.stats
        if stats is not None:
            stats = attrs.evolve(stats, detokenize_s=busy)
        for stop in stops:
            await send_soon(self.schedulers[replica], stop)
        if deltas or finished or batch.freed or stats is not None:
            await send_soon(self.frontend, deltas.batch(tuple(finished), batch.freed, stats))

    def _rows(self, batch: TokenBatch, deltas: DeltaColumns, finished: list[RequestFinished],
              stops: list[StopMatched], replica: int) -> None:
        """One pass over the step's columns. A row of one token, with nothing rare, of a
        request without stop strings (the common case) costs a lookup and four appends;
        any other row goes through :meth:`_process` as an object."""
        rids, nums, ids = batch.rids, batch.num_tokens, batch.token_ids
        extras = dict(zip(batch.rare_rows, batch.rare, strict=True))
        known = self._prepare(batch)
        states = self.states
        at = 0
        for i, rid in enumerate(rids):
            n = nums[i]
            st = states.get(rid)
            if n == 1 and st is not None and st.matcher is None and i not in extras:
                token = ids[at]
                text = known[i]
                if type(text) is str:  # its piece, from the table
                    st.decoder.append(token)
                else:
                    text = st.decoder.push((token,), text)
                deltas.plain(rid, text, token)
            else:
                extra = extras.get(i)
                toks = ids[at:at + n]
                out = TokenOut(rid, toks) if extra is None else attrs.evolve(extra, token_ids=toks)
                self._process(out, deltas, finished, stops, replica, known[i])
            at += n

    def _prepare(self, batch: TokenBatch) -> list[Known]:
        """Per row of one token: its piece if the table serves it, else the decodes of its
        window, all rows' in one ``decode_batch`` call; None for any other row.

        Only a rid's first row in the batch is prepared: a later one must see the state the
        earlier one leaves.
        """
        rids, nums, ids = batch.rids, batch.num_tokens, batch.token_ids
        known: list[Known] = [None] * len(rids)
        states, pieces = self.states, self.pieces
        size = len(pieces)
        windows: dict[bool, list[tuple[int, list[int], list[int]]]] = {}
        seen: set[str] | None = set() if len(set(rids)) < len(rids) else None  # (rare)
        at = 0
        for i, rid in enumerate(rids):
            n = nums[i]
            at += n
            if seen is not None:
                if rid in seen:
                    continue
                seen.add(rid)
            st = states.get(rid)
            if st is None or st.stopped is not None or n != 1:
                continue
            dec = st.decoder
            t = ids[at - 1]
            if dec.plain and 0 <= t < size and (piece := pieces[t]) is not None:
                known[i] = piece
            elif self.decode_batch is not None:
                before, after = dec.window((t,))
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

    def _process(self, out: TokenOut, deltas: list[TextDelta] | DeltaColumns,
                 finished: list[RequestFinished],
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
            if text or kept_ids or out.prompt_logprobs or out.prompt_token_ids:
                # Prompt logprobs and ids pass through untouched: they come before any
                # token, so a stop string can never have cut them off.
                deltas.append(TextDelta(out.rid, text, kept_ids, kept_lps,
                                        out.prompt_logprobs, out.prompt_token_ids))
        if final:
            reason, stop_reason = out.finish_reason, out.stop_reason
            if st.stopped is not None and reason not in (FinishReason.ABORT, FinishReason.ERROR):
                reason, stop_reason = FinishReason.STOP, st.stopped
            finished.append(RequestFinished(out.rid, reason or FinishReason.ERROR, stop_reason,
                                            st.num_prompt_tokens, out.error, out.queue_s,
                                            out.cached_tokens, out.pooled))
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
