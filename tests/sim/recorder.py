"""The merged history of every request (:class:`Recorder`, the Ledgers' tracer) and the
simulated API callers (:class:`Client`)."""


from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from actorllm.lifecycle.invariants import History, check_gather
from actorllm.wire.messages import SamplingParams, StepPlan
from actorllm.wire.outputs import RequestError

from .common import SPEC, TERMINAL, InvariantViolation, SimConfig, TextModel

# --- the merged history ---------------------------------------------------------------------


@attrs.define(eq=False)
class Incarnation:
    """One request that used ``rid``: from its ``register`` to its ``forget``/``gather``."""

    rid: str
    number: int
    events: list[tuple[int, str, str]] = attrs.Factory(list)  # (global index, actor, event)
    history: History = attrs.Factory(lambda: History(SPEC))  # the checker's fold of it
    terminal: list[tuple[str, object]] = attrs.Factory(list)  # (event, reason)
    children: tuple[str, ...] = ()
    child_incs: dict[int, Incarnation] = attrs.Factory(dict)
    parent: Incarnation | None = None
    committed: list[int] = attrs.Factory(list)  # token ids the Scheduler sent on
    aborts_sent: int = 0  # AbortRequests the Frontend sent for it
    # Recorder.count when the Frontend took up the stream-timeout abort of this leaf (its
    # abort sender runs after the timeout; a final output may come in between)
    timeout_abort_at: int | None = None

    @property
    def ended(self) -> bool:
        """Released by the Frontend: its rid may be used again."""
        return bool(self.events) and self.events[-1][2] in ("forget", "gather")

    def index_of(self, event: str) -> int | None:
        return next((i for i, _, e in self.events if e == event), None)

    def describe(self) -> str:
        return f"{self.rid!r}#{self.number} [{' '.join(f'{a}:{e}' for _, a, e in self.events)}]"


class Recorder:
    """A Tracer for every actor: the one merged transition history, checked as it grows
    by the invariant checker of actorllm/lifecycle/invariants.py."""

    def __init__(self, report: Callable[[str, str], None]) -> None:
        self.report = report
        self.count = 0  # transitions so far: a clock that orders every actor's events
        self.current: dict[str, Incarnation] = {}
        self.all: list[Incarnation] = []
        self._parent_of: dict[str, Incarnation] = {}

    def transition(self, actor: str, rid: str, event: str, before: str, after: str,
                   details: dict[str, object] | None = None) -> None:
        details = details or {}
        inc = self.current.get(rid)
        if event == "register" and (inc is None or inc.ended):
            inc = self._new(rid)
        elif inc is None:
            self.report("1", f"{actor} fired {event!r} for {rid!r} before the Frontend "
                        "registered it")
            inc = self._new(rid)
        index = self.count
        self.count += 1
        inc.events.append((index, actor, event))
        found = inc.history.push(event, actor)
        if found is not None:
            self.report(found.invariant, f"{found.message}: {inc.describe()}")
        if event in TERMINAL:
            inc.terminal.append((event, details.get("reason")))
        if event == "fan_out":
            inc.children = tuple(details.get("children", ()))  # type: ignore[arg-type]
            for child in inc.children:
                self._parent_of[child] = inc
        if event == "register" and rid in self._parent_of:
            parent = self._parent_of.pop(rid)
            inc.parent = parent
            parent.child_incs[parent.children.index(rid)] = inc
        if event == "gather":
            def state_of(child: str) -> str | None:
                c = inc.child_incs.get(inc.children.index(child))
                return c.history.state if c is not None else None

            why = check_gather(SPEC, inc.children, state_of)
            if why is not None:
                self.report("6", f"parent {rid!r}: {why}: {inc.describe()}")

    def record(self, kind: str, **fields: Any) -> None:
        """Non-transition facts (the Scheduler's plans and inputs): not needed here."""

    def _new(self, rid: str) -> Incarnation:
        prev = self.current.get(rid)
        inc = Incarnation(rid, prev.number + 1 if prev is not None else 0)
        self.current[rid] = inc
        self.all.append(inc)
        return inc

    @staticmethod
    def children_of(inc: Incarnation) -> list[Incarnation]:
        return [inc.child_incs[i] for i in sorted(inc.child_incs)]

    def live(self, rid: str) -> bool:
        """Whether the Frontend should still hold ``rid`` (registered, not yet forgotten)."""
        inc = self.current.get(rid)
        return inc is not None and not inc.ended


# --- clients --------------------------------------------------------------------------------


@attrs.define(eq=False)
class Client:
    """One API caller: what it asked for, what it has read, and how it behaves."""

    rid: str
    params: SamplingParams
    stream: bool
    mark: int  # Recorder.count when it submitted
    outcome: str = "pending"  # "accepted" | "duplicate" | "raised ..."
    expect_duplicate: bool = False
    inc: Incarnation | None = None
    collector: Any = None
    submit_returned: bool = False
    paused: bool = False
    paused_at: float = 0.0  # mock time when it last stopped reading
    unread_since: float | None = None  # mock time since output waits for it (None: none)
    timed_out: bool = False  # the Frontend cancelled it for its stalled reader
    eager: bool = False  # reads whatever has arrived, finished or not (flow control on)
    disconnected: bool = False
    # Recorder.count when each abort call started and when it returned (None: still waiting)
    abort_marks: list[list[int | None]] = attrs.Factory(list)
    timeout_mark: list[int | None] | None = None  # the one of abort_marks a timeout made
    text: dict[int, list[str]] = attrs.Factory(dict)
    ids: dict[int, list[int]] = attrs.Factory(dict)
    prompt_lps: dict[int, list[Any]] = attrs.Factory(dict)  # per choice, as read
    prompt_ids: list[int] = attrs.Factory(list)  # what the Tokenizer will make of the prompt
    reason: dict[int, tuple[str, object]] = attrs.Factory(dict)
    final: bool = False
    error: RequestError | None = None

    @property
    def n(self) -> int:
        return self.params.n

    def choice(self, index: int) -> Incarnation | None:
        """The incarnation behind choice ``index``."""
        if self.inc is None:
            return None
        return self.inc if self.n == 1 else self.inc.child_incs.get(index)

    def readable(self) -> bool:
        if self.collector is None or self.final or self.disconnected or self.paused:
            return False
        return self.stream or self.eager or self.collector.finished


class WorldFields:
    """What the World's mixins (checks, watches) read of it; World.__init__ sets them."""

    config: SimConfig
    text: TextModel
    hf_tokenizer: Any
    rec: Recorder
    clients: list[Client]
    violations: list[InvariantViolation]
    outstanding: dict[int, StepPlan]
    table_mirror: Any
    plan_tables: dict[int, dict[str, tuple[int, ...]]]
    recompute_skipped_reported: bool
    shared_seen: bool
    worker: Any
    frontend: Any
    loop: Any
    dead: bool
    urgent_preemptions: int
    ended_mid_speculation: int
    death_mark: int | None
    scheduler: Any
    _sched_tags: dict[int, Any]
    _tok_tags: dict[int, Any]
    _timeout_leaves: list[tuple[Any, Incarnation]]

    def report(self, invariant: str, message: str) -> None:
        raise NotImplementedError

    def check(self) -> None:
        raise NotImplementedError
