"""Every message that crosses a mailbox, in the order a request meets them.

All are frozen attrs classes made of plain values (str, int, float, bool, None,
tuples and other messages), so the one codec in :mod:`actorllm.wire.codec` can carry
any of them across a process boundary. Mutable, long-lived objects (the
Frontend's ``RequestState``, the Scheduler's ``Sequence``, the Worker's
``ForwardBatch``) live in the module of their owner and never travel.

    API layer --GenerateRequest--> Frontend --GenerateRequest/AbortRequest--> Tokenizer
    Tokenizer --SequenceRequest/AbortRequest--> Scheduler   (RequestFailed --> Frontend)
    Scheduler --StepPlan--> Worker --StepResult--> Scheduler
    Scheduler --TokenBatch--> Detokenizer --OutputBatch--> Frontend
    Detokenizer --StopMatched--> Scheduler
    engine --ReplicaLost--> Detokenizer   (data parallelism: a replica's process died)

Aborts travel Frontend -> Tokenizer -> Scheduler on the same FIFO edges as the
request itself, so an abort can never overtake the request it cancels.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Union

import attrs

from actorllm.wire.control import (  # parent <-> child; re-exported here
    DrainQuery,
    DrainReport,
    Heartbeat,
    Hello,
    MailboxStat,
    Ready,
    Shutdown,
    StartFailed,
)
from actorllm.wire.sampling import STRUCTURED_KINDS as STRUCTURED_KINDS  # re-exported
from actorllm.wire.sampling import InvalidRequest as InvalidRequest
from actorllm.wire.sampling import SamplingParams, StructuredOutput
from actorllm.wire.steps import FEED_LAST_SAMPLE as FEED_LAST_SAMPLE  # re-exported
from actorllm.wire.steps import (  # the Scheduler <-> Worker edge; re-exported here
    AheadRows,
    NewSeqData,
    PooledHidden,
    PromptLogprobs,
    StepPlan,
    StepResult,
    TokenLogprob,
)
from actorllm.wire.steps import SampledToken as SampledToken  # (a view, not a message)
from actorllm.wire.steps import ScheduledSeq as ScheduledSeq  # (a view, not a message)


class FinishReason(enum.StrEnum):
    """Why a sequence ended (``TokenOut``/``RequestFinished.finish_reason``, OpenAI's field).

    A ``str``: the codec and JSON carry the plain value, byte for byte; a decoded message
    holds the ``str``, which compares equal to the member.
    """

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the context's end
    ABORT = "abort"  # the caller gave up (AbortRequest)
    ERROR = "error"  # the engine failed it (RequestFinished.error says why)
    TOOL_CALLS = "tool_calls"  # HTTP only: a chat answer that ended with tool calls


class FailureCode(enum.StrEnum):
    """Why a request failed before it finished (``RequestFailed.code``, ``RequestError.code``)."""

    INVALID_REQUEST = "invalid_request"
    INTERNAL = "internal"
    ENGINE_DEAD = "engine_dead"


class RefusalCode(enum.StrEnum):
    """Why new work is not taken now (``engine.admission.Refused.code``)."""

    ENGINE_DEAD = "engine_dead"
    SHUTTING_DOWN = "shutting_down"
    OVERLOADED = "overloaded"  # retry later
    TOO_LARGE = "too_large"  # can never fit: retrying will not help


@attrs.frozen
class ChatMessage:
    role: str
    content: str
    extra: str = ""  # a JSON object of further template keys (tool_calls, tool_call_id, name)


@attrs.frozen
class GenerateRequest:
    """API layer -> Frontend -> Tokenizer. Exactly one of prompt, prompt_token_ids,
    messages is set. The Frontend forwards one per leaf: a ``n > 1`` request's children
    go as ``{rid}-{i}`` with ``n = 1`` and their own seeds."""

    rid: str
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    add_generation_prompt: bool = True
    arrival_time: float = 0.0
    tools: str | None = None  # chat: a JSON list of tool definitions for the template
    replica: int = 0  # set by the Frontend: the data-parallel replica that runs it
    # chat: a JSON object of further chat-template variables (``enable_thinking``, ...)
    template_kwargs: str | None = None
    # The first output carries the prompt's token ids (vLLM's ``return_token_ids``; the
    # ``LLM``'s results), as it does with prompt logprobs.
    return_prompt_ids: bool = False


@attrs.frozen
class AbortRequest:
    """Frontend -> Tokenizer -> Scheduler: stop future work for ``rid`` (idempotent)."""

    rid: str
    replica: int = 0  # the replica its request was routed to (the Tokenizer's outbox)


@attrs.frozen
class FlowControl:
    """Frontend -> Tokenizer -> Scheduler: ``rid``'s reader is behind (``pause``) or has
    caught up. On the aborts' FIFO edge, so it never overtakes the request it names."""

    rid: str
    pause: bool
    replica: int = 0  # as AbortRequest.replica


# --- Frontend -> Tokenizer -> Scheduler -------------------------------------------


@attrs.frozen
class SequenceRequest:
    """Tokenizer -> Scheduler: a validated request the Scheduler can run as is."""

    rid: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int  # resolved: never runs past the model's context
    eos_token_ids: tuple[int, ...]
    arrival_time: float = 0.0
    return_prompt_ids: bool = False  # (GenerateRequest's)


@attrs.frozen
class RequestFailed:
    """Tokenizer -> Frontend: the request was rejected before it reached the Scheduler."""

    rid: str
    message: str
    code: str = FailureCode.INVALID_REQUEST  # a FailureCode
    param: str | None = None


# --- Scheduler -> Detokenizer -> Frontend ---------------------------------------------


@attrs.frozen
class DetokSetup:
    """Sent with a rid's first TokenOut: how the Detokenizer must treat its text."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    num_prompt_tokens: int = 0
    # The rid's incarnation (the Scheduler numbers arrivals): a StopMatched echoes it, so
    # a stop found for an ended request cannot stop a new one that reuses the rid.
    incarnation: int = 0


@attrs.frozen
class TokenOut:
    rid: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # a FinishReason
    stop_reason: str | int | None = None
    error: str | None = None
    spec: DetokSetup | None = None
    queue_s: float | None = None  # with the finish: arrival to first scheduled
    cached_tokens: int | None = None  # with the finish: prompt tokens the prefix cache gave
    # Prompt logprobs in position order; the pieces concatenate to one entry per position,
    # the first None. The first piece carries the prompt's ids (position 0 has no entry).
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    pooled: tuple[float, ...] = ()  # with the finish of a pooling request


@attrs.frozen
class SchedulerStats:
    """The Scheduler's figures, sent with every ``TokenBatch``. Counters are running
    totals, so a lost or merged batch loses nothing. The ``*_s`` fields are a step's
    phases, summed over steps (one ``perf_counter`` pair per step per actor, never per
    token): the Worker's (``pack_s``, ``forward_s``, ``sample_s``) come in its
    ``StepResult``, and the Detokenizer writes ``detokenize_s`` (its time on this
    replica's batches) on the way to the Frontend."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    late_results_dropped: int = 0
    num_paused: int = 0  # sequences paused because their reader is behind
    steps: int = 0
    seq_steps: int = 0  # sequences in those steps, summed (the divisor of a per-seq figure)
    forward_s: float = 0.0  # Worker time in forward passes, summed over steps
    sample_s: float = 0.0  # ... and in sampling
    pack_s: float = 0.0  # ... and packing plans into tensors
    plan_s: float = 0.0  # Scheduler time planning steps (schedule())
    commit_s: float = 0.0  # ... and taking their results (on_result)
    detokenize_s: float = 0.0  # Detokenizer time on this replica's batches
    # Worker time idle waiting for a plan between steps, summed; and whether it waited
    # for the latest step's plan (1; 0 if that plan was queued in time). Summed over
    # replicas: how many replicas' Workers wait now (the write pacing reads it).
    plan_wait_s: float = 0.0
    worker_waited: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache, at admissions
    prefix_cache_hits: int = 0  # ... and found there
    replica: int = 0  # which data-parallel replica's Scheduler (0 without data parallelism)
    # Speculative decoding: draft tokens proposed, and accepted; rows that carried drafts
    # (the divisor of the mean accepted length); accepted drafts by position in the row.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_num_drafts: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


@attrs.frozen
class TokenBatch:
    """Scheduler -> Detokenizer: a step's outputs as columns, one entry per row (a rid's
    news; a rid whose token and whose finish were decided apart has two rows).

    ``token_ids`` is flat, ``num_tokens[i]`` of them per row (several for a speculating
    row, none for a finish or prompt logprobs alone), so a decode step of many sequences
    builds no object per sequence. What is rare is sparse: ``rare[j]`` holds everything
    but the tokens of row ``rare_rows[j]`` (its ``DetokSetup`` with a rid's first row,
    logprobs, prompt logprobs, the finish), as a ``TokenOut`` whose ``token_ids`` is
    empty. ``freed``: rids whose blocks are back.
    """

    rids: tuple[str, ...] = ()
    num_tokens: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()
    rare_rows: tuple[int, ...] = ()
    rare: tuple[TokenOut, ...] = ()
    freed: tuple[str, ...] = ()
    stats: SchedulerStats | None = None

    @property
    def outputs(self) -> tuple[TokenOut, ...]:
        """The rows as objects (tests, tools and traces; the hot paths read the columns)."""
        return tuple(TokenOut(rid, ids) if extra is None else attrs.evolve(extra, token_ids=ids)
                     for rid, ids, extra in _rows(self))

    @classmethod
    def of(cls, outputs: Iterable[TokenOut] = (), freed: tuple[str, ...] = (),
           stats: SchedulerStats | None = None) -> TokenBatch:
        """The batch of these rows (tests and tools; the Scheduler fills columns itself)."""
        rids, num, ids, rare_rows, rare = _columns(
            outputs, lambda o: attrs.evolve(o, token_ids=()), lambda o: TokenOut(o.rid))
        return cls(rids, num, ids, rare_rows, rare, freed, stats)


@attrs.frozen
class ReplicaLost:
    """Engine -> Detokenizer: data-parallel replica ``replica``'s process died (its requests
    have failed): forget their decode state and drop whatever it sent that is still late."""

    replica: int


@attrs.frozen
class StopMatched:
    """Detokenizer -> Scheduler: a stop string matched; finish ``rid`` with reason stop."""

    rid: str
    stop: str
    incarnation: int = 0  # DetokSetup.incarnation of the incarnation the stop was found in


@attrs.frozen
class TextDelta:
    rid: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # as in TokenOut
    prompt_token_ids: tuple[int, ...] = ()


@attrs.frozen
class RequestFinished:
    rid: str
    finish_reason: str  # a FinishReason
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    error: str | None = None
    queue_s: float | None = None
    cached_tokens: int | None = None
    pooled: tuple[float, ...] = ()  # a pooling request's hidden state (TokenOut.pooled)


@attrs.frozen
class OutputBatch:
    """Detokenizer -> Frontend, once per TokenBatch: deltas first, then finishes, then frees.

    The deltas are columns as in ``TokenBatch``: per row a rid, its text and
    ``num_tokens[i]`` of the flat ``token_ids``; ``rare[j]`` holds row ``rare_rows[j]``'s
    logprobs and prompt logprobs (a ``TextDelta`` with empty text and tokens).
    """

    rids: tuple[str, ...] = ()
    texts: tuple[str, ...] = ()
    num_tokens: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()
    rare_rows: tuple[int, ...] = ()
    rare: tuple[TextDelta, ...] = ()
    finished: tuple[RequestFinished, ...] = ()
    freed: tuple[str, ...] = ()
    stats: SchedulerStats | None = None

    @property
    def deltas(self) -> tuple[TextDelta, ...]:
        """The deltas as objects (tests and tools; the Frontend reads the columns)."""
        return tuple(TextDelta(rid, text, ids) if extra is None
                     else attrs.evolve(extra, text=text, token_ids=ids)
                     for (rid, ids, extra), text in zip(_rows(self), self.texts, strict=True))

    @classmethod
    def of(cls, deltas: Iterable[TextDelta] = (), finished: tuple[RequestFinished, ...] = (),
           freed: tuple[str, ...] = (), stats: SchedulerStats | None = None) -> OutputBatch:
        """The batch of these deltas (tests and tools)."""
        deltas = tuple(deltas)
        rids, num, ids, rare_rows, rare = _columns(
            deltas, lambda d: attrs.evolve(d, text="", token_ids=()),
            lambda d: TextDelta(d.rid, "", ()))
        return cls(rids, tuple(d.text for d in deltas), num, ids, rare_rows, rare, finished,
                   freed, stats)


def _rows(batch: TokenBatch | OutputBatch) -> Iterator[tuple[str, tuple[int, ...], Any]]:
    """Each row of a columnar batch: (rid, its tokens, its rare object or None)."""
    extras = dict(zip(batch.rare_rows, batch.rare, strict=True))
    at = 0
    for i, (rid, n) in enumerate(zip(batch.rids, batch.num_tokens, strict=True)):
        yield rid, batch.token_ids[at:at + n], extras.get(i)
        at += n


def _columns(rows: Iterable[Any], extra: Callable[[Any], Any], plain: Callable[[Any], Any]
             ) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...],
                        tuple[Any, ...]]:
    """Rows as columns: rids, counts, flat tokens, and the rare rows (where ``extra`` of a
    row, the row without its tokens, is more than ``plain`` of it)."""
    rids: list[str] = []
    num: list[int] = []
    ids: list[int] = []
    rare_rows: list[int] = []
    rare: list[Any] = []
    for i, row in enumerate(rows):
        rids.append(row.rid)
        num.append(len(row.token_ids))
        ids.extend(row.token_ids)
        rest = extra(row)
        if rest != plain(row):
            rare_rows.append(i)
            rare.append(rest)
    return tuple(rids), tuple(num), tuple(ids), tuple(rare_rows), tuple(rare)


# --- what each actor's inbox accepts --------------------------------------------------

TokenizerInput = Union[GenerateRequest, AbortRequest, FlowControl]  # noqa: UP007 - run time
SchedulerInput = Union[  # noqa: UP007
    SequenceRequest, AbortRequest, FlowControl, StepResult, StopMatched]
WorkerInput = StepPlan
DetokenizerInput = Union[TokenBatch, ReplicaLost]  # noqa: UP007
FrontendInput = Union[OutputBatch, RequestFailed]  # noqa: UP007
ControlMessage = Union[  # noqa: UP007
    Hello, Ready, StartFailed, Heartbeat, DrainQuery, DrainReport, Shutdown
]

MESSAGE_TYPES: tuple[type, ...] = (
    StructuredOutput, SamplingParams, ChatMessage, GenerateRequest, AbortRequest, FlowControl,
    SequenceRequest, RequestFailed, NewSeqData, AheadRows, StepPlan, TokenLogprob, PromptLogprobs,
    PooledHidden, StepResult, DetokSetup, TokenOut, SchedulerStats, TokenBatch, StopMatched,
    TextDelta, RequestFinished, OutputBatch, ReplicaLost, Hello, Ready, StartFailed,
    MailboxStat, Heartbeat, DrainQuery, DrainReport, Shutdown,
)
