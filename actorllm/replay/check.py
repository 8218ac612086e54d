"""Checking a trace against the spec: each request's history, and invariants 2 and 6.

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

from actorllm.lifecycle import Spec
from actorllm.replay.tracefile import Life, Line, Session, Trace

CONTEXT = 3  # lines of the request's history shown on each side of a violation


@attrs.frozen
class Violation:
    """The first thing wrong with one request."""

    rid: str  # the life's display name
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
    for life in session.lives:
        bad = check_life(life, spec)
        if bad is not None:
            found[life.name] = bad
    for life in session.lives:
        if life.name in found:
            continue
        bad = check_terminal(life, spec) if not life.is_parent else check_gather(
            life, session, spec)
        if bad is not None:
            found[life.name] = bad
    return list(found.values())


def check_life(life: Life, spec: Spec) -> Violation | None:
    """Walk one life through the table: legal events by their owners, ending RELEASED."""
    state: str | None = None
    for i, line in enumerate(life.lines):
        event = str(line.event)
        nxt = spec.step(state, event)
        if nxt is None:
            known = event in spec.events()
            why = "is not an event of the spec" if not known else f"is illegal in {state or 'NONE'}"
            return _at(life, i, "illegal", f"event {event!r} {why}", state, spec)
        owner = spec.actor_of(event)
        if line.actor != owner:
            return _at(life, i, "wrong-actor",
                       f"event {event!r} fired by {line.actor!r}; only {owner!r} may fire it",
                       state, spec)
        state = nxt
    if state not in spec.final_states:
        last = life.lines[-1] if life.lines else None
        return Violation(
            rid=life.name, kind="incomplete",
            message=f"history ends in {state or 'NONE'}, not in a final state",
            event=None, state=state, expected=tuple(spec.expected_events(state)),
            line_no=last.no if last else None, context=tuple(life.lines[-CONTEXT:]),
        )
    return None


def check_terminal(life: Life, spec: Spec) -> Violation | None:
    """Invariant 2: exactly one terminal event per leaf request."""
    terminals = [i for i, line in enumerate(life.lines) if line.event in spec.terminal_events]
    if len(terminals) == 1 or (not terminals and "lose" in life.events):
        return None
    if not terminals:
        return Violation(rid=life.name, kind="invariant-2",
                         message="no terminal event (finish, abort, fail or reject)",
                         line_no=life.lines[-1].no, context=tuple(life.lines[-CONTEXT:]))
    i = terminals[1]
    return _at(life, i, "invariant-2",
               f"a second terminal event {life.lines[i].event!r} (the first was "
               f"{life.lines[terminals[0]].event!r} at line {life.lines[terminals[0]].no})",
               None, spec)


def check_gather(parent: Life, session: Session, spec: Spec) -> Violation | None:
    """Invariant 6: the parent gathers only after every child is RELEASED, and every
    child it names exists."""
    gathers = [i for i, line in enumerate(parent.lines) if line.event == "gather"]
    if not gathers:
        return None  # an ungathered parent is already "incomplete"
    i = gathers[0]
    at = parent.lines[i]
    children = parent.children
    if not children:
        return _at(parent, i, "invariant-6", "the parent gathered but named no children",
                   None, spec)
    for rid in children:
        child = session.life_at(rid, at.no)
        state = _state_before(child, at, spec) if child is not None else None
        if state not in spec.final_states:
            return _at(parent, i, "invariant-6",
                       f"gather while child {rid!r} is {state or 'not registered'}, "
                       "not RELEASED", None, spec)
    return None


def _state_before(life: Life, at: Line, spec: Spec) -> str | None:
    """The state of ``life`` just before line ``at`` (by time, then file order)."""
    state: str | None = None
    for line in life.lines:
        if (line.t, line.no) >= (at.t, at.no):
            break
        state = spec.step(state, str(line.event))
    return state


def _at(life: Life, i: int, kind: str, message: str, state: str | None,
        spec: Spec) -> Violation:
    """A violation at the i-th line of a life, with its neighbours as context."""
    if state is None and kind in ("invariant-2", "invariant-6"):
        state = _replay(life, i, spec)
    line = life.lines[i]
    return Violation(
        rid=life.name, kind=kind, message=message, event=str(line.event), state=state,
        expected=tuple(spec.expected_events(state)), line_no=line.no,
        context=tuple(life.lines[max(0, i - CONTEXT): i + CONTEXT]),
    )


def _replay(life: Life, i: int, spec: Spec) -> str | None:
    state: str | None = None
    for line in life.lines[:i]:
        state = spec.step(state, str(line.event))
    return state
