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
from collections.abc import Callable, Sequence

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


def hf_decode_fn(hf_tokenizer: object) -> DecodeFn:
    """Decode through the fast tokenizer's Rust backend (no clean-up of spaces)."""
    backend = hf_tokenizer.backend_tokenizer  # type: ignore[attr-defined]

    def decode(ids: Sequence[int], skip_special: bool) -> str:
        return backend.decode(list(ids), skip_special_tokens=skip_special)

    return decode


@attrs.define
class IncrementalDecoder:
    """vLLM-style windowed decoding: re-decode a short window, emit what became stable.

    ``prefix`` marks where the window starts, ``read`` where the already-emitted text
    ends. A piece that still ends in U+FFFD is an incomplete UTF-8 character: wait.
    """

    decode: DecodeFn
    skip_special: bool = True
    ids: list[int] = attrs.Factory(list)
    prefix: int = 0
    read: int = 0

    def push(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        before = self.decode(self.ids[self.prefix : self.read], self.skip_special)
        window = self.decode(self.ids[self.prefix :], self.skip_special)
        if len(window) > len(before) and not window.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return window[len(before) :]
        return ""

    def flush(self) -> str:
        """At the end: whatever is left, incomplete characters included."""
        before = self.decode(self.ids[self.prefix : self.read], self.skip_special)
        window = self.decode(self.ids[self.prefix :], self.skip_special)
        self.prefix = self.read = len(self.ids)
        return window[len(before) :]


@attrs.define
class StopMatcher:
    """Holds back the tail that could begin a stop string."""

    stops: tuple[str, ...]
    include: bool = False
    held: str = ""

    def feed(self, text: str, final: bool) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string if one matched)."""
        buf = self.held + text
        if self.stops:
            hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
            if hits:
                # The stop that is complete first wins (then the one that began first):
                # what a client streaming the text would see, however it was chunked.
                i, stop = min(hits, key=lambda h: (h[0] + len(h[1]), h[0]))
                self.held = ""
                return buf[: i + len(stop)] if self.include else buf[:i], stop
        if final or not self.stops:
            self.held = ""
            return buf, None
        keep = max(len(s) for s in self.stops) - 1
        cut = max(len(buf) - keep, 0)
        self.held = buf[cut:]
        return buf[:cut], None


@attrs.define
class DecodeState:
    decoder: IncrementalDecoder
    matcher: StopMatcher
    num_prompt_tokens: int = 0
    incarnation: int = 0
    stopped: str | None = None  # the stop string that matched; output is over
    replica: int = 0  # the data-parallel replica whose Scheduler runs it


class Detokenizer:
    """The actor: one TokenBatch in, one OutputBatch out (plus StopMatched when needed)."""

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
        self.inbox, self.frontend, self.scheduler = inbox, frontend, scheduler
        # With data parallelism, one per replica: a StopMatched goes back to the replica
        # whose TokenBatch it came from (the batch's stats name it).
        self.schedulers = list(schedulers) if schedulers else [scheduler]
        self.lost: set[int] = set()  # replicas whose process died (ReplicaLost)
        self.states: dict[str, DecodeState] = {}

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
            deltas: list[TextDelta] = []
            finished: list[RequestFinished] = []
            stops: list[StopMatched] = []
            for out in batch.outputs:
                self._process(out, deltas, finished, stops, replica)
            for stop in stops:
                await self.schedulers[replica].send(stop)
            if deltas or finished or batch.freed or batch.stats is not None:
                await self.frontend.send(
                    OutputBatch(tuple(deltas), tuple(finished), batch.freed, batch.stats)
                )

    def _state(self, rid: str, setup: DetokSetup | None, replica: int = 0) -> DecodeState:
        st = self.states.get(rid)
        if st is None:
            setup = setup or DetokSetup()
            st = self.states[rid] = DecodeState(
                IncrementalDecoder(self.decode, setup.skip_special_tokens),
                StopMatcher(setup.stop, setup.include_stop_str_in_output),
                setup.num_prompt_tokens,
                setup.incarnation,
                replica=replica,
            )
        return st

    def _process(self, out: TokenOut, deltas: list[TextDelta], finished: list[RequestFinished],
                 stops: list[StopMatched], replica: int = 0) -> None:
        st = self._state(out.rid, out.spec, replica)
        final = out.finish_reason is not None
        if self._emitting(st):
            kept_ids: list[int] = []
            kept_lps: list[TokenLogprob] = []
            text_parts: list[str] = []
            for i, tid in enumerate(out.token_ids):
                piece = st.decoder.push((tid,))
                last = final and i == len(out.token_ids) - 1
                if last:
                    piece += st.decoder.flush()
                emit, stop = st.matcher.feed(piece, final=last)
                kept_ids.append(tid)
                if i < len(out.logprobs):
                    kept_lps.append(out.logprobs[i])
                text_parts.append(emit)
                if stop is not None and st.stopped is None:
                    st.stopped = stop
                    stops.append(StopMatched(out.rid, stop, st.incarnation))
                    break
            if not out.token_ids and final:
                emit, _ = st.matcher.feed(st.decoder.flush(), final=True)
                text_parts.append(emit)
            text = "".join(text_parts)
            if text or kept_ids or out.prompt_logprobs:
                # Prompt logprobs pass through untouched: they come before any token, so
                # a stop string can never have cut them off.
                deltas.append(TextDelta(out.rid, text, tuple(kept_ids), tuple(kept_lps),
                                        out.prompt_logprobs, out.prompt_token_ids))
        if final:
            reason, stop_reason = out.finish_reason, out.stop_reason
            if st.stopped is not None and reason not in (FinishReason.ABORT, FinishReason.ERROR):
                reason, stop_reason = FinishReason.STOP, st.stopped
            finished.append(RequestFinished(out.rid, reason or FinishReason.ERROR, stop_reason,
                                            st.num_prompt_tokens, out.error, out.queue_s,
                                            out.cached_tokens))
            del self.states[out.rid]

    def _emitting(self, st: DecodeState) -> bool:
        """Nothing reaches the client after a stop string matched (invariant 2)."""
        return st.stopped is None

    def drain_problems(self) -> list[str]:
        return [f"detokenizer holds {sorted(self.states)}"] if self.states else []
