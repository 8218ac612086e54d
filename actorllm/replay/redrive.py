"""Re-driving the real Scheduler from a trace, to check that it makes the same decisions.

The Scheduler records what it is told (``input`` records: a SequenceRequest arriving, an
abort, a stop string; ``result`` records: what each step returned) and what it plans
(``plan`` records). Its decisions are the ``plan`` records and its own transition lines
(enqueue, schedule, preempt, finish, abort, fail, free). Feeding the inputs and results
back into a fresh :class:`actorllm.scheduler.actor.Scheduler`, in the order of the file (the
order the real one handled them: it writes each record while it handles the message),
and calling ``schedule()`` wherever a ``plan`` record stands, must reproduce every
decision. No event loop is needed: ``handle`` and ``schedule`` are plain calls. (When to
plan, such as waiting out arrivals before planning ahead, ``Scheduler.quiet_s``, is the
sending task's choice and the trace records its outcome: the plan records.)

What the recording must hold: the pool size, block size and batch limits (a ``config``
record of the Scheduler if it wrote one, else the header's config: ``num_kv_blocks_used``,
or ``num_kv_blocks`` when it was given); each request's prompt length and max_tokens
(``input`` records). Finish decisions also
depend on each request's EOS ids and sampling params: the ``input`` record's
``eos_token_ids`` and ``params`` when present, else the model's EOS ids read from the
model directory named in the header, with default params (the report says so).
Token ids of prompts matter only to the prefix cache: a Scheduler with it on records
them (``prompt_token_ids``), one with it off records only their count.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from actorllm.replay.tracefile import Line, Session, Trace
from actorllm.wire.messages import (
    AbortRequest,
    FlowControl,
    SamplingParams,
    SequenceRequest,
    StepResult,
    StopMatched,
    StructuredOutput,
)

log = logging.getLogger(__name__)

# A decision, comparable across the recording and the re-drive:
# ("plan", step, ((rid, n_tokens, sample), ...)) or (event, rid, reason).
Decision = tuple[Any, ...]


DEFAULT_PARAMS_NOTE = ("sampling params not recorded: assumed the defaults (no min_tokens, "
                       "stop_token_ids or ignore_eos)")


class RedriveError(Exception):
    """The trace lacks what a re-drive needs (e.g. the KV pool size)."""


@attrs.frozen
class Divergence:
    """The first decision the re-driven Scheduler made differently."""

    session: int
    index: int  # position in the session's decision sequence
    recorded: Decision | None  # None: the recording has no more decisions
    redriven: Decision | None  # None: the re-driven Scheduler made no more
    line_no: int | None  # the recorded decision's line (or the input that raised)
    message: str

    def as_json(self) -> dict[str, object]:
        return {"session": self.session, "index": self.index,
                "recorded": _jsonable(self.recorded), "redriven": _jsonable(self.redriven),
                "line": self.line_no, "message": self.message}


@attrs.define
class RedriveReport:
    sessions: int = 0
    inputs: int = 0
    plans: int = 0
    decisions: int = 0  # decisions compared (all equal up to the divergence, if any)
    divergences: list[Divergence] = attrs.Factory(list)  # at most one per session
    notes: list[str] = attrs.Factory(list)  # assumptions the re-drive had to make

    @property
    def ok(self) -> bool:
        return not self.divergences

    def as_json(self) -> dict[str, object]:
        return {"ok": self.ok, "sessions": self.sessions, "inputs": self.inputs,
                "plans": self.plans, "decisions": self.decisions,
                "divergences": [d.as_json() for d in self.divergences], "notes": self.notes}


class _Capture:
    """Stands in for the Tracer: keeps the re-driven Scheduler's decisions."""

    hops = False

    def __init__(self) -> None:
        self.decisions: list[Decision] = []

    def transition(self, actor: str, rid: str, event: str, before: str, after: str,
                   details: dict[str, object] | None = None) -> None:
        self.decisions.append((event, rid, (details or {}).get("reason")))

    def record(self, kind: str, **fields: Any) -> None:
        if kind == "plan":
            self.decisions.append(_plan_decision(fields["step"], fields["seqs"]))

    def hop(self, *args: Any) -> None:  # pragma: no cover - hops are off
        pass


def redrive(trace: Trace) -> RedriveReport:
    """Re-drive every session of ``trace``. Raises RedriveError if one cannot be."""
    report = RedriveReport()
    for session in trace.sessions:
        if not any(line.kind in ("input", "plan", "result") for line in session.lines):
            continue
        report.sessions += 1
        redrive_session(session, report)
    if report.sessions == 0:
        raise RedriveError("the trace has no Scheduler records (input/plan/result) to re-drive")
    return report


def redrive_session(session: Session, report: RedriveReport) -> None:
    """Re-drive one session; appends its first divergence (if any) to ``report``."""
    from actorllm.scheduler.actor import Scheduler  # the real one: that is the point

    if session.config.get("speculative_config"):
        raise RedriveError(
            f"session {session.index}: recorded with --speculative-config; re-driving "
            "speculative decoding is not supported (its drafts depend on token ids and "
            "verdicts the trace does not keep)")
    config = _scheduler_config(session)
    num_blocks = config.get("num_blocks")
    if not num_blocks:
        raise RedriveError(
            f"session {session.index}: the trace does not record the KV pool size (a "
            "scheduler `config` record, or num_kv_blocks_used / num_kv_blocks in the "
            "header); re-record with --num-kv-blocks")
    log.debug("re-driving session %d: %s KV blocks", session.index, num_blocks)
    capture = _Capture()
    sched = Scheduler(
        None, None, None,  # type: ignore[arg-type]  # no mailboxes: handle() is called directly
        num_blocks=int(num_blocks), block_size=int(config.get("block_size") or 16),
        max_num_seqs=int(config.get("max_num_seqs") or 64),
        max_num_batched_tokens=int(config.get("max_num_batched_tokens") or 2048),
        max_steps_in_flight=int(config.get("max_steps_in_flight") or 1),
        # Unrecorded: on if the prompts' ids were recorded (only a caching Scheduler does).
        enable_prefix_caching=bool(config["enable_prefix_caching"]
                                   if config.get("enable_prefix_caching") is not None else any(
            ln.data.get("prompt_token_ids") for ln in session.records("input"))),
        scheduling_policy=str(config.get("scheduling_policy") or "fcfs"),
        tracer=capture,  # type: ignore[arg-type]
    )
    default_eos = _model_eos(session, report)
    recorded: list[tuple[Decision, Line]] = []
    for line in session.lines:
        if line.actor != "scheduler":
            continue
        if line.is_transition:
            recorded.append(((line.event, line.rid, line.data.get("reason")), line))
        elif line.kind == "plan":
            recorded.append((_plan_decision(line.data["step"], line.data["seqs"]), line))
    crash: tuple[Line, str] | None = None
    for line in session.lines:
        if line.actor != "scheduler" or line.kind not in ("input", "plan", "result"):
            continue
        try:
            _apply(sched, line, default_eos, report)
        except Exception as exc:  # the re-driven Scheduler refused: that is a divergence
            crash = (line, f"{type(exc).__name__}: {exc}")
            break
    redriven = capture.decisions
    n = min(len(recorded), len(redriven))
    index = next((i for i in range(n) if recorded[i][0] != redriven[i]), n)
    report.decisions += index
    if crash is not None and index == n and len(redriven) <= len(recorded):
        line, why = crash
        report.divergences.append(Divergence(
            session.index, index, recorded[index][0] if index < len(recorded) else None,
            None, line.no, f"the re-driven Scheduler raised {why} on line {line.no}"))
        return
    if index == len(recorded) == len(redriven):
        return
    rec = recorded[index][0] if index < len(recorded) else None
    red = redriven[index] if index < len(redriven) else None
    line_no = recorded[index][1].no if index < len(recorded) else None
    report.divergences.append(Divergence(session.index, index, rec, red, line_no,
                                         _describe(rec, red)))


def _scheduler_config(session: Session) -> dict[str, Any]:
    """The Scheduler's sizes: from its own ``config`` record if it wrote one (what it
    really used, in whatever process it ran), else from the header's EngineConfig."""
    header = session.config
    out = {
        "num_blocks": header.get("num_kv_blocks_used") or header.get("num_kv_blocks"),
        "block_size": header.get("block_size"),
        "max_num_seqs": header.get("max_num_seqs"),
        "max_num_batched_tokens": header.get("max_num_batched_tokens"),
        # Only the Scheduler's own record says (EngineConfig.overlap resolves `auto`).
        "max_steps_in_flight": None,
        "enable_prefix_caching": header.get("enable_prefix_caching"),
        "scheduling_policy": header.get("scheduling_policy"),
    }
    for line in session.records("config"):
        if line.actor == "scheduler":
            out.update({k: v for k, v in line.data.items() if k in out and v is not None})
            break
    return out


def _apply(sched: Any, line: Line, default_eos: tuple[int, ...],
           report: RedriveReport) -> None:
    """Hand one recorded input or result to the Scheduler, or plan where it planned."""
    d = line.data
    if line.kind == "plan":
        report.plans += 1
        plan = sched.schedule()
        if plan is None:
            raise RuntimeError("schedule() planned nothing")
        return
    report.inputs += 1
    if line.kind == "result":
        # The trace names each token's rid; the result carries the tokens in the order of
        # the plan's sampling rows, which is the order they were recorded in.
        tokens = tuple(int(tok) for _, tok in d.get("tokens") or ())
        sched.handle(StepResult(int(d["step"]), tokens, d.get("error")))
    elif d.get("msg") == "SequenceRequest":
        params = _params(d.get("params"), int(d["max_tokens"]))
        eos = d.get("eos_token_ids")
        sched.handle(SequenceRequest(
            rid=str(d["rid"]), prompt_token_ids=tuple(d.get("prompt_token_ids") or
                                                      (0,) * int(d["prompt_tokens"])),
            params=params, max_tokens=int(d["max_tokens"]),
            eos_token_ids=tuple(eos) if eos is not None else default_eos))
        if d.get("params") is None and DEFAULT_PARAMS_NOTE not in report.notes:
            report.notes.append(DEFAULT_PARAMS_NOTE)
    elif d.get("msg") == "abort":
        sched.handle(AbortRequest(str(d["rid"])))
    elif d.get("msg") in ("pause", "resume"):  # flow control (a slow reader)
        sched.handle(FlowControl(str(d["rid"]), d["msg"] == "pause"))
    elif d.get("msg") == "stop":
        # Only a stop meant for the live incarnation is recorded (a stale one is dropped
        # before the Scheduler logs it), so it carries that incarnation's incarnation.
        live = sched.seqs.get(str(d["rid"]))
        sched.handle(StopMatched(str(d["rid"]), str(d.get("stop", "")),
                                 live.incarnation if live is not None else -1))
    else:
        raise RuntimeError(f"unknown input record {d.get('msg')!r}")


def _params(raw: dict[str, Any] | None, max_tokens: int) -> SamplingParams:
    """SamplingParams from a recorded dict (lists back to tuples), or the defaults."""
    if raw is None:
        return SamplingParams(max_tokens=max_tokens)
    fields = {f.name for f in attrs.fields(SamplingParams)}
    kw: dict[str, Any] = {}
    for k, v in raw.items():
        if k not in fields:
            continue
        if isinstance(v, list):
            v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        if k == "structured" and isinstance(v, dict):
            v = StructuredOutput(**v)
        kw[k] = v
    return SamplingParams(**kw)


def _model_eos(session: Session, report: RedriveReport) -> tuple[int, ...]:
    """The model's EOS ids, for recordings whose input records do not carry them."""
    inputs = [ln for ln in session.records("input") if ln.data.get("msg") == "SequenceRequest"]
    if all("eos_token_ids" in ln.data for ln in inputs):
        return ()
    from actorllm.config import read_model_info

    model = (session.header or {}).get("model") or session.config.get("model")
    try:
        eos = read_model_info(str(model)).eos_token_ids
    except (ValueError, TypeError) as exc:
        note = f"EOS ids unknown ({exc}); finish decisions on EOS may differ"
        eos = ()
    else:
        note = f"EOS ids {list(eos)} read from {model}"
    if note not in report.notes:
        report.notes.append(note)
    return eos


def _plan_decision(step: Any, seqs: Any) -> Decision:
    return ("plan", int(step), tuple((str(r), int(n), bool(s)) for r, n, s in seqs))


def _describe(rec: Decision | None, red: Decision | None) -> str:
    def show(d: Decision | None) -> str:
        if d is None:
            return "nothing more"
        if d[0] == "plan":
            return f"plan step {d[1]}: " + ", ".join(f"{r}+{n}{'' if s else ' (no sample)'}"
                                                     for r, n, s in d[2])
        reason = f" ({d[2]})" if d[2] else ""
        return f"{d[0]} {d[1]}{reason}"

    return f"recorded {show(rec)}; the re-driven Scheduler decided {show(red)}"


def _jsonable(d: Decision | None) -> object:
    if d is None:
        return None
    if d[0] == "plan":
        return {"plan": d[1], "seqs": [list(x) for x in d[2]]}
    return {"event": d[0], "rid": d[1], "reason": d[2]}
