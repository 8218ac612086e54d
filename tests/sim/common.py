"""What every part of the simulation shares: its sizes, its vocabulary, the reference
for invariant 7 (:class:`TextModel`) and the error a violated invariant raises."""


from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from actorllm.detokenizer.decoding import hf_decode_fn
from actorllm.lifecycle.table import load_spec
from actorllm.wire.messages import (
    AbortRequest,
    GenerateRequest,
    OutputBatch,
    RequestFailed,
    SequenceRequest,
    StepPlan,
    StepResult,
    StopMatched,
    TokenBatch,
)

SPEC = load_spec()
TERMINAL = SPEC.terminal_events

# Every edge of the single topology, in the order a drain delivers them.
EDGES = (
    "frontend->tokenizer",
    "tokenizer->frontend",
    "tokenizer->scheduler",
    "scheduler->worker",
    "worker->scheduler",
    "scheduler->detokenizer",
    "detokenizer->scheduler",
    "detokenizer->frontend",
)

# The scripted Worker's vocabulary: short ASCII pieces of the tiny tokenizer, so decoding is
# concatenative (see TextModel) and the stop strings below are easy to hit.
VOCAB_TEXTS = ("a", "b", "t", "he", " ", "!")
STOP_STRINGS = ("!", "ab", "the", "b b", "hehe")
# 3, 8, 11 and 12 tokens; the last starts with the second's two full blocks of 4 (a
# prefix-cache hit), the second ends on a block boundary.
PROMPTS = ("Hi", "The river runs", "Hello! How are you?", "The river runs deep")


class InvariantViolation(AssertionError):
    """A DESIGN.md §3 invariant does not hold. ``invariant`` is its number, as text."""

    def __init__(self, invariant: str, message: str) -> None:
        self.invariant = invariant
        title = SPEC.invariants.get(invariant, invariant)
        super().__init__(f"invariant {invariant} ({title}): {message}")


@attrs.frozen
class SimConfig:
    """Sizes small enough that preemption, chunked prefill and backpressure all happen."""

    num_blocks: int = 8
    block_size: int = 4
    max_num_seqs: int = 3
    max_num_batched_tokens: int = 8
    max_model_len: int = 16
    capacity: int = 3  # every inbox but the Worker's
    worker_capacity: int = 2  # as in actorllm.engine.async_engine
    max_steps_in_flight: int = 2  # overlap scheduling, as the engine's default
    roundtrip: bool = True  # send every delivered message through the codec
    bugs: frozenset[str] = frozenset()  # planted bugs (sim/bugs.py): "frontend.bug_...", ...
    # The Frontend's FlowLimits (None: flow control off). With them, every client reads as
    # it goes (as the server does), unless the test makes it a slow reader. With a
    # stream_timeout, mock time passes only by the tick rule.
    flow: Any = None
    scheduling_policy: str = "fcfs"  # "priority": requests draw a priority in -1..1
    # Inputs longer than this go through the Tokenizer's thread hop, which the test
    # finishes when it chooses (the actor's default, 1024, is longer than any prompt here).
    inline_chars: int | None = None
    engine_death: bool = False  # the engine_dies rule may run
    readers_start_paused: bool = False  # each client reads only once slow_reader resumes it
    # Speculative decoding: the Scheduler proposes n-gram drafts, the scripted Worker
    # accepts some of them (sim/scripted_worker.py). With draft_model, the plans carry
    # placeholders and the Worker's simulated draft fills them (sim/scripted_draft.py).
    speculative: bool = False
    draft_model: bool = False

# --- text: the reference for invariant 7 ---------------------------------------------------


class TextModel:
    """Decoding as the Detokenizer does it, and the stop-string reference.

    The scripted Worker only emits ``VOCAB_TEXTS`` tokens (and eos), each a complete UTF-8
    string, so ``decode(ids) == "".join(piece(t) for t in ids)`` (asserted here). That
    makes the reference simple: a stop string matches at the first token whose piece
    completes it, exactly where the incremental matcher sees it.
    """

    def __init__(self, hf_tokenizer: Any) -> None:
        self.decode = hf_decode_fn(hf_tokenizer)
        self.eos_id: int = hf_tokenizer.eos_token_id
        by_text: dict[str, int] = {}
        for tid in range(len(hf_tokenizer)):
            by_text.setdefault(self.decode([tid], True), tid)
        self.vocab = tuple(by_text[t] for t in VOCAB_TEXTS)
        self._piece = {t: self.decode([t], True) for t in (*self.vocab, self.eos_id)}
        for a in self._piece:
            for b in self._piece:
                assert self.decode([a, b], True) == self._piece[a] + self._piece[b], (a, b)

    def piece(self, tid: int) -> str:
        return self._piece.get(tid) if tid in self._piece else self.decode([tid], True)

    def reference(self, ids: Sequence[int], stops: Sequence[str],
                  include: bool) -> tuple[int | None, str, str | None]:
        """(tokens up to the stop match or None, the text a client must read, the stop)."""
        buf = ""
        for k, tid in enumerate(ids, 1):
            buf += self.piece(tid)
            hits = [(i, s) for s in stops if (i := buf.find(s)) >= 0]
            if hits:
                # The one complete first, then the one begun first (as the Detokenizer).
                i, stop = min(hits, key=lambda h: (h[0] + len(h[1]), h[0]))
                return k, buf[: i + len(stop)] if include else buf[:i], stop
        return None, buf, None


def message_rids(msg: Any) -> list[str]:
    """Every rid a message concerns."""
    if isinstance(msg, GenerateRequest | AbortRequest | SequenceRequest | RequestFailed
                  | StopMatched):
        return [msg.rid]
    if isinstance(msg, StepPlan):
        return [s.rid for s in msg.seqs] + list(msg.drop)
    if isinstance(msg, StepResult):
        return []  # its tokens are a column: the rids are its plan's
    if isinstance(msg, TokenBatch):
        return [*msg.rids, *msg.freed]
    if isinstance(msg, OutputBatch):
        return [*msg.rids, *(f.rid for f in msg.finished), *msg.freed]
    return []
