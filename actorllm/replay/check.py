"""Checking a trace against the spec: each request's history, and invariants 2 and 6,
by the one checker of actorllm/lifecycle/invariants.py.

A history is legal when it is one path through the table of spec/lifecycle.toml from
"no state" (``Spec.step`` from None), each event fired by the actor the table names, and
complete when the path ends in a final state (RELEASED; a ``n > 1`` parent gets there by
``gather``). On top of the path, two invariants are checked across requests:

- invariant 2: exactly one terminal event (finish, abort, fail, reject) per leaf request;
  a request the engine lost (``lose``) may have none;
- invariant 6: a parent's ``gather`` comes after every child it fanned out to is RELEASED.

Only the first violation of each request is reported: after one illegal event its state
is unknown, so whatever follows would be noise.
"""

from __future__ import annotations

import attrs

from actorllm.lifecycle.invariants import Finding, History, final_state
from actorllm.lifecycle.invariants import check_gather as check_gather_of
from actorllm.lifecycle.table import Spec
from actorllm.replay.tracefile import Incarnation, Line, Session, Trace

CONTEXT = 3  # lines of the request's history shown on each side of a violation


@attrs.frozen
class Violation:
    """The first thing wrong with one request."""

    rid: str  # the incarnation's display name
    kind: str  # illegal | wrong-actor | incomplete | invariant-2 | invariant-6 | format
    message: str
    event: str | None = None  # the offending event (None: the history just stops)
    state: str | None = None  # the state it was fired in (None: before creation)
    expected: tuple[str, ...] = ()  # what the table allows there
    line_no: int | None = None
    context: tuple[Line, ...] = ()

    def as_json(self) -> dict[str, object]:
        return {
            "rid": self.rid, "kind": self.kind, "message": self.message, "event": self.event,
            "state": self.state, "expected": list(self.expected), "line": self.line_no,
            "context": [{"line": c.no, **c.data} for c in self.context],
        }


def check_trace(trace: Trace, spec: Spec) -> list[Violation]:
    """Every violation in the file, at most one per request, in file order."""
    found: list[Violation] = [
        Violation(rid="-", kind="format", message=f"line {no}: {what}", line_no=no)
        for no, what in trace.problems
    ]
    for session in trace.sessions:
        found += check_session(session, spec)
    return sorted(found, key=lambda v: (v.line_no or 0, v.rid))


def check_session(session: Session, spec: Spec) -> list[Violation]:
    found: dict[str, Violation] = {}
    for incarnation in session.incarnations:
        bad = check_incarnation(incarnation, spec)
        if bad is None and incarnation.is_parent:
            bad = check_gather(incarnation, session, spec)
        if bad is not None:
            found[incarnation.name] = bad
    return list(found.values())


def check_incarnation(incarnation: Incarnation, spec: Spec) -> Violation | None:
    """One incarnation through the invariant checker: legal events by their owners, exactly one
    terminal event, ending RELEASED."""
    history = History(spec)
    for i, line in enumerate(incarnation.lines):
        found = history.push(str(line.event), line.actor)
        if found is not None:
            return _at(incarnation, i, found, spec)
    found = history.end(parent=incarnation.is_parent)
    if found is None:
        return None
    return Violation(
        rid=incarnation.name, kind=found.kind, message=found.message, event=None,
        state=found.state if found.kind == "incomplete" else None,
        expected=tuple(spec.expected_events(found.state)) if found.kind == "incomplete" else (),
        line_no=incarnation.lines[-1].no if incarnation.lines else None,
        context=tuple(incarnation.lines[-CONTEXT:]),
    )


def check_gather(parent: Incarnation, session: Session, spec: Spec) -> Violation | None:
    """Invariant 6: the parent gathers only after every child is RELEASED, and every
    child it names exists."""
    i = next((i for i, line in enumerate(parent.lines) if line.event == "gather"), None)
    if i is None:
        return None  # an ungathered parent is already "incomplete"
    at = parent.lines[i]

    def state_of(rid: str) -> str | None:
        child = session.incarnation_at(rid, at.no)
        if child is None:
            return None
        # Its state just before the gather line (by time, then file order).
        return final_state(spec, [str(c.event) for c in child.lines
                                  if (c.t, c.no) < (at.t, at.no)])

    why = check_gather_of(spec, parent.children, state_of)
    if why is None:
        return None
    state = final_state(spec, parent.events[:i])
    return _at(parent, i, Finding("invariant-6", why, i, state), spec)


def _at(incarnation: Incarnation, i: int, found: Finding, spec: Spec) -> Violation:
    """A violation at the i-th line of a incarnation, with its neighbours as context."""
    line = incarnation.lines[i]
    return Violation(
        rid=incarnation.name, kind=found.kind, message=found.message, event=str(line.event),
        state=found.state, expected=tuple(spec.expected_events(found.state)), line_no=line.no,
        context=tuple(incarnation.lines[max(0, i - CONTEXT): i + CONTEXT]),
    )
