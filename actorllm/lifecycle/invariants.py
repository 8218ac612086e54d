"""The one fold of a request's history over the table, and the one checker of what a
history shows of the invariants (spec/lifecycle.toml, DESIGN.md §3).

Each actor checks its own events as it fires them (:class:`actorllm.lifecycle.table.View`);
this module judges the *merged* history of one request, every actor's events in order:

- the path: one walk through the table from "no state", each event fired by the actor
  the table names (:func:`fold`, :class:`History`);
- invariant 2: exactly one terminal event per leaf request; one the engine lost
  (``lose``) may have none;
- invariant 6: a ``n > 1`` parent gathers only when every child it fanned out to is in
  a final state (:func:`check_gather`);
- completeness: the history ends in a final state (``History.end``).

Everything that reads histories uses it: ``actorllm replay`` (actorllm/replay/*), the
simulation harness (tests/sim/recorder.py), the fuzzers (fuzz/fuzz_lifecycle.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import attrs

from actorllm.lifecycle.table import Spec


def fold(spec: Spec, events: Iterable[str], state: str | None = None) -> Iterator[str | None]:
    """The state after each event, starting from ``state`` (None: before creation). At
    the first illegal event yields None and stops: after it the state is unknown."""
    for event in events:
        state = spec.step(state, event)
        yield state
        if state is None:
            return


def final_state(spec: Spec, events: Iterable[str]) -> str | None:
    """Where ``events`` lead from before creation; None if nowhere (empty or illegal)."""
    states = list(fold(spec, events))
    return states[-1] if states else None


@attrs.frozen
class Finding:
    """The first thing wrong with one history."""

    kind: str  # illegal | wrong-actor | incomplete | invariant-2 | invariant-6
    message: str
    index: int | None  # the event at fault; None: the history as a whole
    state: str | None  # the state that event met (None: before creation)

    @property
    def invariant(self) -> str:
        """The invariant it breaks, by number: an event before the Frontend registered the
        rid breaks 1, any other illegal step or a second terminal 2, an unfinished history
        4 (it never drained), a gather too early 6."""
        if self.kind == "illegal" and self.state is None:
            return "1"
        return {"incomplete": "4", "invariant-6": "6"}.get(self.kind, "2")


class History:
    """One request's merged history, folded through the table one event at a time.

    ``push`` returns the first finding, and nothing after it: once an event is illegal the
    state is unknown, so whatever follows would be noise.
    """

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.events: list[str] = []
        self.state: str | None = None
        self.terminals: list[int] = []  # indices of the terminal events
        self.broken = False

    def push(self, event: str, actor: str | None = None) -> Finding | None:
        """Apply one event (``actor``: who fired it, checked when given)."""
        spec, i, state = self.spec, len(self.events), self.state
        self.events.append(event)
        if event in spec.terminal_events:
            self.terminals.append(i)
        if self.broken:
            return None
        nxt = spec.step(state, event)
        if nxt is None:
            self.broken = True
            why = (f"is illegal in {state or 'NONE'}" if event in spec.events()
                   else "is not an event of the spec")
            return Finding("illegal", f"event {event!r} {why}", i, state)
        owner = spec.actor_of(event)
        if actor is not None and actor != owner:
            self.broken = True
            return Finding("wrong-actor",
                           f"event {event!r} fired by {actor!r}; only {owner!r} may fire it",
                           i, state)
        self.state = nxt
        if len(self.terminals) > 1:
            self.broken = True
            first = self.terminals[0]
            return Finding("invariant-2", f"a second terminal event {event!r} (the first was "
                           f"{self.events[first]!r}, event {first + 1})", i, state)
        return None

    def end(self, parent: bool = False) -> Finding | None:
        """The history is over: it must be in a final state, and a leaf must have had its
        one terminal event (invariant 2) unless the engine lost it."""
        if self.broken:
            return None
        if self.state not in self.spec.final_states:
            return Finding("incomplete",
                           f"history ends in {self.state or 'NONE'}, not in a final state",
                           None, self.state)
        if not parent and not self.terminals and "lose" not in self.events:
            names = ", ".join(sorted(self.spec.terminal_events))
            return Finding("invariant-2", f"no terminal event ({names})", None, self.state)
        return None


def check_gather(spec: Spec, children: Sequence[str],
                 state_of: Callable[[str], str | None]) -> str | None:
    """Invariant 6 at a parent's ``gather``: what is wrong, or None. ``state_of(rid)`` is
    the child's state just before the gather (None: not registered)."""
    if not children:
        return "the parent gathered but named no children"
    for rid in children:
        state = state_of(rid)
        if state not in spec.final_states:
            return f"gather while child {rid!r} is {state or 'not registered'}, not RELEASED"
    return None


def first_illegal(spec: Spec, events: Iterable[str]) -> tuple[int, str | None, str] | None:
    """``(index, state, event)`` of the first event the table does not allow, or None.
    Completeness (ending in a final state) is the caller's question."""
    events = list(events)
    before: str | None = None
    for i, after in enumerate(fold(spec, events)):
        if after is None:
            return i, before, events[i]
        before = after
    return None
