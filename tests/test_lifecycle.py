"""The spec table, the typed states, the per-actor views, and the invariant checker."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples

from actorllm.lifecycle.invariants import History, check_gather, final_state, first_illegal, fold
from actorllm.lifecycle.table import ACTORS, IllegalTransition, State, View, load_spec, parse_spec

SPEC = load_spec()
HAPPY = ["register", "dispatch", "enqueue", "schedule", "finish", "respond", "free", "forget"]


def test_happy_paths_are_legal_in_both_orders() -> None:
    assert first_illegal(SPEC, HAPPY) is None
    other = ["register", "dispatch", "enqueue", "schedule", "finish", "free", "respond", "forget"]
    assert first_illegal(SPEC, other) is None


def test_preempt_and_abort_paths() -> None:
    path = ["register", "dispatch", "enqueue", "schedule", "preempt", "schedule", "preempt",
            "abort", "free", "respond", "forget"]
    assert first_illegal(SPEC, path) is None
    rejected = ["register", "dispatch", "reject", "respond", "forget"]
    assert first_illegal(SPEC, rejected) is None


@pytest.mark.parametrize(
    ("events", "bad_index"),
    [
        (["dispatch"], 0),  # nothing leaves before register (invariant 1)
        (["register", "enqueue"], 1),
        ([*HAPPY[:5], "finish"], 5),  # a second terminal event (invariant 2)
        ([*HAPPY[:5], "abort"], 5),
        ([*HAPPY, "respond"], 8),  # output after the end
        (["register", "dispatch", "enqueue", "schedule", "free"], 4),  # free before finish
    ],
)
def test_illegal_histories_are_caught(events: list[str], bad_index: int) -> None:
    bad = first_illegal(SPEC, events)
    assert bad is not None and bad[0] == bad_index


def test_view_checks_actor_and_state() -> None:
    v = View(SPEC, "scheduler", "r1")
    with pytest.raises(IllegalTransition) as info:
        v.fire("register")  # the Frontend's event
    assert info.value.rid == "r1" and info.value.event == "register"
    assert v.fire("enqueue") == ("TOKENIZING", "WAITING")
    v.fire("schedule")
    v.fire("abort")
    with pytest.raises(IllegalTransition, match="'abort'"):
        v.fire("abort")


def _scan(spec_rows: tuple, state: str | None, event: str) -> str | None:
    """The table read row by row: the first row for ``event`` that leaves ``state``."""
    for t in spec_rows:
        if t.event == event and (state in t.sources or (state is None and not t.sources)):
            return t.target
    return None


def test_step_is_the_first_row_of_the_table_that_matches() -> None:
    for state in (None, *SPEC.states):
        for event in SPEC.events():
            assert SPEC.step(state, event) == _scan(SPEC.transitions, state, event), \
                (state, event)
    assert SPEC.step("RUNNING", "no-such-event") is None
    # Two rows for one move: the first one wins, as a scan of the rows would have it.
    text = (Path(__file__).parent.parent / "spec" / "lifecycle.toml").read_text()
    doubled = text + '\n[[transition]]\nevent = "preempt"\nfrom = ["RUNNING"]\n' \
        'to = "FINISHED"\nactor = "scheduler"\n'
    spec = parse_spec(doubled)
    assert spec.step("RUNNING", "preempt") == _scan(spec.transitions, "RUNNING", "preempt") \
        == "PREEMPTED"


def test_an_illegal_event_names_the_request_event_actor_and_state() -> None:
    v = View(SPEC, "scheduler", "r1")
    v.fire("enqueue")
    # (the state is the view's candidates: others' events may have moved it on meanwhile)
    assert "WAITING" in v.state.split("|")
    with pytest.raises(IllegalTransition) as info:
        v.fire("free")
    assert str(info.value) == f"request 'r1': event 'free' by scheduler is illegal in state " \
        f"{v.state}"
    with pytest.raises(IllegalTransition) as info:
        v.fire("teleport")
    assert str(info.value) == f"request 'r1': event 'teleport' by scheduler is illegal in " \
        f"state {v.state}"


def test_frontend_view_cannot_respond_twice() -> None:
    v = View(SPEC, "frontend", "r")
    v.fire("register")
    v.fire("dispatch")
    v.fire("respond")
    with pytest.raises(IllegalTransition):
        v.fire("respond")


def test_every_event_has_exactly_one_actor_and_states_are_known() -> None:
    for event in SPEC.events():
        assert SPEC.actor_of(event) in ("frontend", "tokenizer", "scheduler")
    text = """
version = 1
initial = "A"
states = ["A"]
terminal_events = []
final_states = ["A"]
[[transition]]
event = "x"
from = []
to = "B"
actor = "frontend"
"""
    with pytest.raises(ValueError, match="unknown state"):
        parse_spec(text)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.sampled_from(SPEC.events()), max_size=12))
def test_views_never_accept_what_the_global_table_forbids(events: list[str]) -> None:
    """Firing a legal global history through per-actor views never raises; and a view
    only raises IllegalTransition, never anything else."""
    views: dict[str, View] = {}
    legal = first_illegal(SPEC, events) is None
    try:
        for e in events:
            actor = SPEC.actor_of(e)
            views.setdefault(actor, View(SPEC, actor, "r")).fire(e)
    except IllegalTransition:
        assert not legal


def _reference_apply(states: frozenset[str | None], event: str, actor: str
                     ) -> tuple[frozenset[str | None], str, tuple[str, ...]] | None:
    """A view's move worked out from the table alone, every time (as View did before its
    answers were kept: Spec.applied)."""
    moves = {s: SPEC.step(s, event) for s in states}
    moves = {s: t for s, t in moves.items() if t is not None}
    if not moves:
        return None
    return (SPEC.closure(moves.values(), actor), "|".join(sorted(s or "NONE" for s in moves)),
            tuple(sorted(set(moves.values()))))


@settings(max_examples=examples(300), deadline=None)
@given(st.frozensets(st.sampled_from([None, *SPEC.states]), min_size=1, max_size=3),
       st.sampled_from(SPEC.events()), st.sampled_from(ACTORS))
def test_a_kept_move_is_the_tables_own_for_any_candidates(
        states: frozenset[str | None], event: str, actor: str) -> None:
    """``Spec.applied`` answers as the table does afresh, for any candidates, event and
    actor, asked in any order (its kept answers are shared by every view)."""
    assert SPEC.applied(states, event, actor) == _reference_apply(states, event, actor)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(ACTORS), st.sampled_from(SPEC.events())),
                max_size=14))
def test_kept_view_moves_are_the_tables_own(steps: list[tuple[str, str]]) -> None:
    """Every actor's view moves, from whatever candidates it holds, as the table says
    afresh: the kept answers (one Spec for every view of the process, so earlier examples
    and other actors filled them) are keyed by all they depend on. Each view fires its
    own events and witnesses the others' (an illegal move leaves it as it was)."""
    views = {actor: View(SPEC, actor, "r") for actor in ACTORS}
    for actor in ACTORS:
        assert views[actor].states == SPEC.closure([None], actor)
    for actor, event in steps:
        view = views[actor]
        want = _reference_apply(view.states, event, actor)
        own = SPEC.actor_of(event) == actor
        try:
            if own:
                before, after = view.fire(event)
            else:
                view.witness(event)
        except IllegalTransition:
            assert want is None
            continue
        assert want is not None
        assert view.states == want[0]
        if own:
            assert (before, after) == (want[1], "|".join(want[2]))
            assert view.local == (State(want[2][0]) if len(want[2]) == 1 else None)


def test_mermaid_names_every_transition() -> None:
    text = SPEC.mermaid()
    for t in SPEC.transitions:
        assert t.event in text


def test_state_enum_is_the_table() -> None:
    """Code compares against lifecycle.State: it must name exactly the table's states."""
    assert [s.value for s in State] == list(SPEC.states)
    assert {t.actor for t in SPEC.transitions} <= set(ACTORS)


def test_view_local_state_is_where_the_actors_own_event_led() -> None:
    v = View(SPEC, "scheduler", "r")
    assert v.local is None
    v.fire("enqueue")
    assert v.local is State.WAITING
    v.fire("schedule")
    v.fire("preempt")
    assert v.local is State.PREEMPTED
    v.fire("abort")
    assert v.local is State.FINISHED
    v.fire("free")  # FREED or RELEASED: the Scheduler cannot tell which
    assert v.local is None and v.within(State.FREED, State.RELEASED)


def test_frontend_view_learns_free_from_a_message() -> None:
    """respond then free, free then respond, reject: RELEASED exactly when both owners
    are done, which is when the Frontend may forget the rid."""
    for order in (["respond", "free"], ["free", "respond"], ["reject", "respond"]):
        v = View(SPEC, "frontend", "r")
        v.fire("register")
        v.fire("dispatch")
        for e in order:
            assert not v.within(State.RELEASED)
            if SPEC.actor_of(e) == "frontend":
                v.fire(e)
            else:
                v.witness(e)
        assert v.within(State.RELEASED), order
        v.fire("forget")
    v = View(SPEC, "frontend", "r")
    v.fire("register")
    with pytest.raises(IllegalTransition):
        v.witness("free")  # nothing was ever allocated for it
    with pytest.raises(IllegalTransition):
        v.witness("dispatch")  # its own event: fired, never witnessed


def test_fold_stops_at_the_first_illegal_event() -> None:
    assert list(fold(SPEC, ["register", "enqueue", "dispatch"])) == ["CREATED", None]
    assert final_state(SPEC, HAPPY) == "RELEASED"
    assert final_state(SPEC, []) is None


@pytest.mark.parametrize(
    ("events", "actors", "kind", "invariant"),
    [
        (["dispatch"], None, "illegal", "1"),
        (["register", "dispatch", "enqueue", "schedule", "free"], None, "illegal", "2"),
        (["register", "dispatch"], ["frontend", "scheduler"], "wrong-actor", "2"),
        (HAPPY[:4], None, "incomplete", "4"),
    ],
)
def test_history_names_what_is_wrong(events: list[str], actors: list[str] | None, kind: str,
                                     invariant: str) -> None:
    h = History(SPEC)
    found = [h.push(e, a) for e, a in zip(events, actors or [None] * len(events), strict=True)]
    bad = [f for f in found if f is not None] or [h.end()]
    assert len(bad) == 1 and bad[0] is not None
    assert (bad[0].kind, bad[0].invariant) == (kind, invariant), bad[0]


def test_history_wants_exactly_one_terminal_event() -> None:
    loose = parse_spec((Path(__file__).parents[1] / "spec" / "lifecycle.toml").read_text()
                       .replace('"finish", "abort"', '"finish", "respond", "abort"'))
    h = History(loose)
    found = [h.push(e) for e in HAPPY]
    assert found[5] is not None and found[5].kind == "invariant-2"  # finish, then respond
    lost = History(SPEC)
    for e in ["register", "dispatch", "enqueue", "lose", "respond", "forget"]:
        assert lost.push(e) is None
    assert lost.end() is None  # a request the engine lost may have no terminal event
    parent = History(SPEC)
    for e in ["register", "fan_out", "gather"]:
        assert parent.push(e) is None
    assert parent.end(parent=True) is None


def test_check_gather_wants_every_child_released() -> None:
    states = {"p-0": "RELEASED", "p-1": "RUNNING"}
    assert check_gather(SPEC, ["p-0"], states.get) is None
    assert "p-1" in (check_gather(SPEC, ["p-0", "p-1"], states.get) or "")
    assert "not registered" in (check_gather(SPEC, ["p-2"], states.get) or "")
    assert check_gather(SPEC, [], states.get) is not None


def test_promela_table_is_generated_from_this_toml() -> None:
    """spec/lifecycle.pml includes the table as Promela; regenerate it after editing the TOML
    (``python -m actorllm.lifecycle.table --promela > spec/lifecycle_table.pml``)."""
    spec_dir = Path(__file__).parents[1] / "spec"
    assert (spec_dir / "lifecycle_table.pml").read_text() == SPEC.promela()


def test_promela_model_fires_every_event_it_models() -> None:
    """The model fires each event of the table somewhere (``lose`` in its -DDEATH scenario),
    and none the table lacks."""
    model = (Path(__file__).parents[1] / "spec" / "lifecycle.pml").read_text()
    fired = {e.lower() for e in re.findall(r"fire\(\w+, E_(\w+)\)", model)}
    fired |= {"abort", "finish", "fail"} & {e.lower() for e in re.findall(r"E_(\w+)", model)}
    assert fired == set(SPEC.events())
