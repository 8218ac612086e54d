"""Per-request timings and totals, computed from a trace.

Where each number comes from (times are the trace's monotonic clock):

- queue: ``enqueue`` -> first ``schedule`` (Scheduler transitions);
- TTFT: ``register`` (Frontend) -> the first token the Scheduler committed for the rid,
  i.e. the ``result`` record that carried it. This is the engine's TTFT: it leaves out
  detokenization and delivery to the client (microseconds in one process), and it needs
  no ``--trace-hops``;
- ITL: the gaps between successive committed tokens of the rid (p50 and p99);
- e2e: ``register`` -> ``respond`` (a parent: ``register`` -> ``gather``);
- tokens: the tokens committed to the rid. That is what the client receives, except after
  a stop string, where the Detokenizer drops what follows it;
- a late drop: a token in a ``result`` record for a rid that had already finished (an
  abort or stop string while its step ran) or was already freed. The Scheduler drops it.
"""

from __future__ import annotations

import math
from collections import Counter

import attrs

from actorllm.lifecycle.invariants import final_state
from actorllm.lifecycle.table import Spec
from actorllm.replay.tracefile import Incarnation, Session, Trace


@attrs.define
class RequestSummary:
    """The numbers for one request incarnation."""

    rid: str
    parent: str | None = None
    children: list[str] = attrs.Factory(list)
    state: str | None = None  # where its history ends (RELEASED when complete)
    reason: str | None = None  # stop | length | abort | error (a parent: gathered)
    t_register: float | None = None
    t_enqueue: float | None = None
    t_schedule: float | None = None
    t_end: float | None = None  # respond (a parent: gather)
    token_times: list[float] = attrs.Factory(list)
    preemptions: int = 0
    aborts: int = 0  # abort requests that reached the Scheduler
    late_drops: int = 0

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def queue_s(self) -> float | None:
        return _diff(self.t_enqueue, self.t_schedule)

    @property
    def ttft_s(self) -> float | None:
        return _diff(self.t_register, self.token_times[0] if self.token_times else None)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def e2e_s(self) -> float | None:
        return _diff(self.t_register, self.t_end)

    def as_json(self) -> dict[str, object]:
        itl = self.itls
        return {
            "rid": self.rid, "parent": self.parent, "children": self.children,
            "state": self.state, "reason": self.reason, "tokens": self.tokens,
            "queue_s": self.queue_s, "ttft_s": self.ttft_s,
            "itl_p50_s": percentile(itl, 0.5), "itl_p99_s": percentile(itl, 0.99),
            "e2e_s": self.e2e_s, "preemptions": self.preemptions, "aborts": self.aborts,
            "late_drops": self.late_drops,
        }


@attrs.define
class Summary:
    """Every request, and the totals over the leaves (a parent's tokens are its children's)."""

    requests: list[RequestSummary]
    steps: int = 0
    duration_s: float = 0.0
    late_drops: int = 0  # all late tokens, including those of rids already freed
    abort_inputs: int = 0

    @property
    def leaves(self) -> list[RequestSummary]:
        return [r for r in self.requests if not r.children]

    def totals(self) -> dict[str, object]:
        leaves = self.leaves
        tokens = sum(r.tokens for r in leaves)
        ttfts = [r.ttft_s for r in leaves if r.ttft_s is not None]
        queues = [r.queue_s for r in leaves if r.queue_s is not None]
        itls = [x for r in leaves for x in r.itls]
        return {
            "requests": len(leaves),
            "parents": len(self.requests) - len(leaves),
            "by_reason": dict(sorted(Counter(r.reason or "unfinished" for r in leaves).items())),
            "tokens": tokens,
            "steps": self.steps,
            "duration_s": self.duration_s,
            "tokens_per_s": tokens / self.duration_s if self.duration_s > 0 else None,
            "aborts": self.abort_inputs,
            "aborted": sum(r.reason == "abort" for r in leaves),
            "late_drops": self.late_drops,
            "preemptions": sum(r.preemptions for r in leaves),
            "queue_p50_s": percentile(queues, 0.5),
            "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99),
            "itl_p50_s": percentile(itls, 0.5),
            "itl_p99_s": percentile(itls, 0.99),
        }


def summarize(trace: Trace, spec: Spec) -> Summary:
    """Every request incarnation of every session, each parent followed by its children."""
    out = Summary([])
    for session in trace.sessions:
        _summarize_session(session, spec, out)
    return out


def _summarize_session(session: Session, spec: Spec, out: Summary) -> None:
    by_life: dict[int, RequestSummary] = {}
    names = {id(incarnation): incarnation.name for incarnation in session.incarnations}
    for incarnation in session.incarnations:
        by_life[id(incarnation)] = _from_transitions(incarnation, spec)
    # Parents and children: a child's parent is the incarnation that fanned out to it.
    for incarnation in session.incarnations:
        if incarnation.is_parent:
            summary = by_life[id(incarnation)]
            for rid in incarnation.children:
                child = session.incarnation_at(rid, incarnation.lines[0].no)
                if child is not None:
                    summary.children.append(names[id(child)])
                    by_life[id(child)].parent = incarnation.name
    # Records, in file order: the Scheduler wrote them in the order it decided, so a token
    # that comes after the rid's terminal event (also the Scheduler's) is a late drop.
    terminal_at = {id(incarnation): min((ln.no for ln in incarnation.lines
                                  if ln.event in spec.terminal_events), default=None)
                   for incarnation in session.incarnations}
    for line in session.lines:
        if line.kind == "result":
            out.steps += 1
            for rid, _token in line.data.get("tokens") or ():
                incarnation = session.incarnation_at(str(rid), line.no)
                if incarnation is None:
                    out.late_drops += 1
                    continue
                done = terminal_at[id(incarnation)]
                summary = by_life[id(incarnation)]
                if done is not None and done < line.no:
                    summary.late_drops += 1
                    out.late_drops += 1
                else:
                    summary.token_times.append(line.t)
        elif line.kind == "input" and line.data.get("msg") == "abort":
            out.abort_inputs += 1
            incarnation = session.incarnation_at(str(line.rid), line.no)
            if incarnation is not None:
                by_life[id(incarnation)].aborts += 1
    # Each parent directly followed by its children, otherwise in order of registration.
    for incarnation in session.incarnations:
        summary = by_life[id(incarnation)]
        if summary.parent is None:
            out.requests.append(summary)
            out.requests += [r for r in by_life.values() if r.parent == summary.rid]
    if session.lines:  # several processes may append slightly out of order: take the max
        start = session.t0 if session.t0 is not None else session.lines[0].t
        out.duration_s += max(line.t for line in session.lines) - start


def _from_transitions(incarnation: Incarnation, spec: Spec) -> RequestSummary:
    s = RequestSummary(incarnation.name)
    terminal_reason: str | None = None
    respond_reason: str | None = None
    for line in incarnation.lines:
        event = line.event
        if event == "register":
            s.t_register = line.t
        elif event == "enqueue":
            s.t_enqueue = line.t
        elif event == "schedule" and s.t_schedule is None:
            s.t_schedule = line.t
        elif event == "preempt":
            s.preemptions += 1
        elif event in ("respond", "gather"):
            s.t_end = line.t
            respond_reason = line.data.get("reason") or ("gathered" if event == "gather"
                                                         else None)
        elif event in spec.terminal_events and terminal_reason is None:
            terminal_reason = "error" if event == "reject" else line.data.get("reason")
        elif event == "lose" and terminal_reason is None:
            terminal_reason = "error"
    s.state = final_state(spec, incarnation.events)
    s.reason = respond_reason or terminal_reason
    return s


def percentile(xs: list[float], q: float) -> float | None:
    """The q-quantile with linear interpolation (numpy's default); None for no data."""
    if not xs:
        return None
    ys = sorted(xs)
    k = (len(ys) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a
