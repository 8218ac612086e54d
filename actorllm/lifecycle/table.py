"""The request state machine, loaded from ``spec/lifecycle.toml``.

Two rules, as in h11's state module:

1. Everything that decides whether a transition is legal lives in the spec table;
   this module only loads it and applies it. No actor writes its own rules.
2. The table does not care which process an actor lives in.

Theory of operation. A request's state is spread over several actors: only the
Frontend sees ``register``, only the Scheduler sees ``schedule``. So each actor
keeps a :class:`View` per rid: the *set* of global states consistent with what
that actor has itself fired, closed over the events that other actors may have
fired meanwhile (a subset construction over the table). An actor may fire an
event iff the event is legal from at least one state in its view, and it must be
the event's actor. A message that proves another actor's event (the Frontend reads
``free`` off an OutputBatch) narrows the view (``View.witness``). Actors decide on
their views, typed by :class:`State` (``Sequence.status``, ``RequestState.responded``,
the Frontend's "both owners are done": ``view.within(State.RELEASED)``); they keep no
flags of their own for what the table already says. The stronger, global property,
that the whole merged history of a rid is one path through the table, is checked by
actorllm/lifecycle/invariants.py.
"""

from __future__ import annotations

import enum
import importlib.resources
import tomllib
from collections.abc import Iterable
from functools import cache

import attrs

from actorllm.lifecycle.trace import Tracer

# The one list of actors (actorllm.topology imports it).
ACTORS = ("frontend", "tokenizer", "scheduler", "worker", "detokenizer")


class State(enum.StrEnum):
    """The states of the table, typed. ``load_spec`` refuses a table that names others, and
    tests/test_lifecycle.py proves the two lists equal, so code may compare against these."""

    CREATED = "CREATED"
    TOKENIZING = "TOKENIZING"
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    PREEMPTED = "PREEMPTED"
    PAUSED = "PAUSED"
    FINISHED = "FINISHED"
    FREED = "FREED"
    RESPONDED = "RESPONDED"
    RELEASED = "RELEASED"
    GATHERING = "GATHERING"


class IllegalTransition(Exception):
    """An event was fired from a state (or by an actor) the spec does not allow."""

    def __init__(self, rid: str, state: str, event: str, actor: str = "") -> None:
        self.rid, self.state, self.event, self.actor = rid, state, event, actor
        by = f" by {actor}" if actor else ""
        super().__init__(f"request {rid!r}: event {event!r}{by} is illegal in state {state}")


@attrs.frozen
class Transition:
    event: str
    sources: tuple[str, ...]  # empty: the event creates the request
    target: str
    actor: str
    guard: str
    effect: str


def _index_moves(transitions: tuple[Transition, ...]) -> dict[tuple[str | None, str], str]:
    """``(state, event) -> target`` for every row (state None: the event creates the
    request). Where rows overlap, the first one in the table wins."""
    moves: dict[tuple[str | None, str], str] = {}
    for t in transitions:
        for source in t.sources or (None,):
            moves.setdefault((source, t.event), t.target)
    return moves


def _index_owners(transitions: tuple[Transition, ...]) -> dict[str, str]:
    """``event -> actor`` (parse_spec refuses an event that two actors fire)."""
    owners: dict[str, str] = {}
    for t in transitions:
        owners.setdefault(t.event, t.actor)
    return owners


def _index_exits(transitions: tuple[Transition, ...]
                 ) -> dict[str | None, tuple[tuple[str, str], ...]]:
    """``state -> ((actor, target), ...)``: the rows leaving each state, in table order."""
    exits: dict[str | None, list[tuple[str, str]]] = {}
    for t in transitions:
        for source in t.sources or (None,):
            exits.setdefault(source, []).append((t.actor, t.target))
    return {s: tuple(rows) for s, rows in exits.items()}


@attrs.frozen
class Spec:
    """The parsed table. ``step(state, event)`` is the whole semantics."""

    version: int
    initial: str
    states: tuple[str, ...]
    terminal_events: frozenset[str]
    final_states: frozenset[str]
    transitions: tuple[Transition, ...]
    invariants: dict[str, str]
    # Derived from ``transitions`` once: every actor fires events per rid per message, so
    # ``step`` is one dict lookup instead of a scan of the rows (as h11 does).
    _moves: dict[tuple[str | None, str], str] = attrs.field(
        init=False, repr=False, eq=False,
        default=attrs.Factory(lambda self: _index_moves(self.transitions), takes_self=True))
    _owners: dict[str, str] = attrs.field(
        init=False, repr=False, eq=False,
        default=attrs.Factory(lambda self: _index_owners(self.transitions), takes_self=True))
    _exits: dict[str | None, tuple[tuple[str, str], ...]] = attrs.field(
        init=False, repr=False, eq=False,
        default=attrs.Factory(lambda self: _index_exits(self.transitions), takes_self=True))
    # What ``applied`` worked out, by (candidate states, event, actor): a View's candidates
    # take a handful of distinct values, and each request fires several events in each
    # actor, so a burst of arrivals asked the same few questions thousands of times.
    _applied: dict[tuple[frozenset[str | None], str, str],
                   tuple[frozenset[str | None], str, tuple[str, ...]] | None] = attrs.field(
        init=False, repr=False, eq=False, factory=dict)
    _initial: dict[str, frozenset[str | None]] = attrs.field(
        init=False, repr=False, eq=False, factory=dict)

    def step(self, state: str | None, event: str) -> str | None:
        """The state after ``event`` from ``state`` (None before creation), or None if illegal."""
        return self._moves.get((state, event))

    def actor_of(self, event: str) -> str:
        """The one actor allowed to fire ``event``."""
        return self._owners[event]

    def events(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.event for t in self.transitions))

    def expected_events(self, state: str | None) -> list[str]:
        """Events legal from ``state``: what a checker shows next to a violation."""
        return sorted({t.event for t in self.transitions if self.step(state, t.event) is not None})

    def closure(self, states: Iterable[str | None], actor: str) -> frozenset[str | None]:
        """States reachable from ``states`` by events that actors other than ``actor`` fire."""
        seen = set(states)
        todo = list(seen)
        while todo:
            for by, target in self._exits.get(todo.pop(), ()):
                if by != actor and target not in seen:
                    seen.add(target)
                    todo.append(target)
        return frozenset(seen)

    def initial_view(self, actor: str) -> frozenset[str | None]:
        """The candidates of ``actor``'s view of a request it has not heard of yet."""
        try:
            return self._initial[actor]
        except KeyError:
            view = self._initial[actor] = self.closure([None], actor)
            return view

    def applied(self, states: frozenset[str | None], event: str, actor: str
                ) -> tuple[frozenset[str | None], str, tuple[str, ...]] | None:
        """``event`` applied by ``actor`` to a view whose candidates are ``states``: the
        new candidates (the targets and what other actors may do next: ``closure``), the
        candidates it was legal from as text, and its targets, sorted; None if illegal
        from every candidate. Pure in its arguments, so kept once worked out."""
        key = (states, event, actor)
        try:
            return self._applied[key]
        except KeyError:
            pass
        moves = {s: t for s in states if (t := self.step(s, event)) is not None}
        result = None if not moves else (
            self.closure(moves.values(), actor),
            "|".join(sorted(s or "NONE" for s in moves)),
            tuple(sorted(set(moves.values()))))
        self._applied[key] = result
        return result

    def mermaid(self) -> str:
        """The state diagram as Mermaid source (spec/README.md embeds this)."""
        lines = ["stateDiagram-v2", f"    [*] --> {self.initial}: register (frontend)"]
        for t in self.transitions:
            for s in t.sources:
                lines.append(f"    {s} --> {t.target}: {t.event} ({t.actor})")
        lines += [f"    {s} --> [*]" for s in sorted(self.final_states)]
        return "\n".join(lines)


    def promela(self) -> str:
        """The table as Promela (spec/lifecycle_table.pml, included by spec/lifecycle.pml):
        a code per state and event, and ``fire(r, e)``, which with -DCHECK_TABLE moves
        ``ls[r]`` as the table says and asserts that the table has a row for the move. So
        SPIN proves that every interleaving of the model is a path through this table."""
        out = ["/* Generated from spec/lifecycle.toml by `python -m actorllm.lifecycle.table",
               "   --promela > spec/lifecycle_table.pml`: edit the table, not this file.",
               "   tests/test_spin.py checks that the two agree. */", "",
               "#define L_NONE 0"]
        out += [f"#define L_{s} {i}" for i, s in enumerate(self.states, 1)]
        out += [f"#define E_{e.upper()} {i}" for i, e in enumerate(self.events(), 1)]
        out += ["", "#ifdef CHECK_TABLE",
                "byte ls[NR];           /* each rid's state in the table (L_*) */", "",
                "inline fire(r, e) {", "    if"]
        for t in self.transitions:
            # A request comes into being from nothing, or where its rid's last life ended.
            sources = t.sources or ("NONE", *sorted(self.final_states))
            cond = " || ".join(f"ls[r] == L_{s}" for s in sources)
            out.append(f"    :: e == E_{t.event.upper()} && ({cond}) -> ls[r] = L_{t.target}")
        out += ["    :: else -> assert(false)  /* the table has no row for this move */",
                "    fi", "}", "#else",
                "inline fire(r, e) { skip }  /* without the check the model is unchanged */",
                "#endif", ""]
        return "\n".join(out)


def parse_spec(text: str) -> Spec:
    """Parse the TOML table; raises ValueError on a table that contradicts itself."""
    raw = tomllib.loads(text)
    states = tuple(raw["states"])
    transitions = tuple(
        Transition(
            event=t["event"],
            sources=tuple(t["from"]),
            target=t["to"],
            actor=t["actor"],
            guard=t.get("guard", ""),
            effect=t.get("effect", ""),
        )
        for t in raw["transition"]
    )
    for t in transitions:
        unknown = [s for s in (*t.sources, t.target) if s not in states]
        if unknown or t.actor not in ACTORS:
            bad = unknown or t.actor
            raise ValueError(f"transition {t.event!r} names unknown state/actor: {bad}")
    by_event: dict[str, set[str]] = {}
    for t in transitions:
        by_event.setdefault(t.event, set()).add(t.actor)
    shared = {e: a for e, a in by_event.items() if len(a) > 1}
    if shared:
        raise ValueError(f"events fired by more than one actor: {shared}")
    return Spec(
        version=int(raw["version"]),
        initial=raw["initial"],
        states=states,
        terminal_events=frozenset(raw["terminal_events"]),
        final_states=frozenset(raw["final_states"]),
        transitions=transitions,
        invariants={str(k): v for k, v in raw.get("invariants", {}).items()},
    )


@cache
def load_spec() -> Spec:
    """The spec shipped with the package (``spec/lifecycle.toml`` in a checkout)."""
    text = importlib.resources.files("actorllm.spec").joinpath("lifecycle.toml").read_text()
    spec = parse_spec(text)
    if set(spec.states) != set(State):
        raise ValueError(f"spec states {spec.states} differ from lifecycle.State")
    return spec


@cache
def _within(candidates: frozenset[str | None], states: tuple[State, ...]) -> bool:
    # Memoized: the Frontend asks "responded?" for every delta of every request, and a view
    # takes only a handful of distinct candidate sets (frozensets cache their hash).
    return all(s in states for s in candidates)


class View:
    """One actor's knowledge of one request's state (see the module docstring).

    ``states`` is every global state consistent with what this actor knows; ``local`` is
    the state its own last event led to (None before its first, or where that event had
    several targets, e.g. the Frontend's ``respond`` before it knows of ``free``).
    Decisions read these two, never a flag of their own.
    """

    __slots__ = ("_spec", "actor", "local", "rid", "states")

    def __init__(self, spec: Spec, actor: str, rid: str) -> None:
        self._spec, self.actor, self.rid = spec, actor, rid
        self.states: frozenset[str | None] = spec.initial_view(actor)
        self.local: State | None = None

    @property
    def state(self) -> str:
        """The view as text: one state, or the candidates joined by ``|``."""
        return "|".join(sorted(s or "NONE" for s in self.states))

    def within(self, *states: State) -> bool:
        """Whether the request is certainly in one of ``states``."""
        return _within(self.states, states)

    def may(self, event: str) -> bool:
        """Whether ``event`` is legal from at least one candidate state."""
        return any(self._spec.step(s, event) is not None for s in self.states)

    def fire(self, event: str) -> tuple[str, str]:
        """Apply ``event``; returns (from, to) as text. Raises IllegalTransition.

        ``from`` names only the candidate states the event was legal from.
        """
        spec = self._spec
        try:
            owner = spec.actor_of(event)
        except KeyError:
            raise IllegalTransition(self.rid, self.state, event, self.actor) from None
        if owner != self.actor:
            raise IllegalTransition(self.rid, self.state, event, self.actor)
        before, targets = self._apply(event)
        self.local = State(targets[0]) if len(targets) == 1 else None
        return before, "|".join(targets)

    def witness(self, event: str) -> None:
        """Narrow the view by an event another actor fired, learned from a message (the
        Frontend reads ``free`` off an OutputBatch). Raises IllegalTransition."""
        if self._spec.actor_of(event) == self.actor:
            raise IllegalTransition(self.rid, self.state, event, self.actor)
        self._apply(event)

    def _apply(self, event: str) -> tuple[str, tuple[str, ...]]:
        # (``before`` names only the states the event was legal from: usually exactly one.)
        applied = self._spec.applied(self.states, event, self.actor)
        if applied is None:
            raise IllegalTransition(self.rid, self.state, event, self.actor)
        self.states, before, targets = applied
        return before, targets

    def __repr__(self) -> str:
        return f"View({self.actor}, {self.rid!r}, {self.state})"


class Ledger:
    """The views one actor keeps, one per live rid, with every transition traced.

    The only way an actor changes a request's state: ``ledger.fire(rid, event)``.
    """

    def __init__(self, actor: str, tracer: Tracer | None = None, spec: Spec | None = None) -> None:
        self.actor = actor
        self.spec = spec or load_spec()
        self.tracer = tracer
        self.views: dict[str, View] = {}

    def fire(self, rid: str, event: str, **details: object) -> str:
        """Fire ``event`` for ``rid``; returns the new state text. Raises IllegalTransition."""
        view = self.views.get(rid)
        if view is None:
            view = self.views[rid] = View(self.spec, self.actor, rid)
        before, after = view.fire(event)
        if self.tracer is not None:
            self.tracer.transition(self.actor, rid, event, before, after, details)
        return after

    def view(self, rid: str) -> View:
        """The view of a rid this actor has fired for. KeyError if none."""
        return self.views[rid]

    def drop(self, rid: str) -> None:
        """Forget ``rid``: this actor holds nothing more for it."""
        self.views.pop(rid, None)

    def __len__(self) -> int:
        return len(self.views)


if __name__ == "__main__":  # pragma: no cover - a developer's tool
    import sys

    if "--mermaid" in sys.argv:
        sys.stdout.write(load_spec().mermaid() + "\n")
    if "--promela" in sys.argv:
        sys.stdout.write(load_spec().promela())
