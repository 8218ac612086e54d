"""The spec table, the per-actor views, and the history checker."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actorllm.lifecycle import IllegalTransition, View, check_history, load_spec, parse_spec

SPEC = load_spec()
HAPPY = ["register", "dispatch", "enqueue", "schedule", "finish", "respond", "free", "forget"]


def test_happy_paths_are_legal_in_both_orders() -> None:
    assert check_history(SPEC, HAPPY) is None
    other = ["register", "dispatch", "enqueue", "schedule", "finish", "free", "respond", "forget"]
    assert check_history(SPEC, other) is None


def test_preempt_and_abort_paths() -> None:
    path = ["register", "dispatch", "enqueue", "schedule", "preempt", "schedule", "preempt",
            "abort", "free", "respond", "forget"]
    assert check_history(SPEC, path) is None
    rejected = ["register", "dispatch", "reject", "respond", "forget"]
    assert check_history(SPEC, rejected) is None


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
    bad = check_history(SPEC, events)
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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(SPEC.events()), max_size=12))
def test_views_never_accept_what_the_global_table_forbids(events: list[str]) -> None:
    """Firing a legal global history through per-actor views never raises; and a view
    only raises IllegalTransition, never anything else."""
    views: dict[str, View] = {}
    legal = check_history(SPEC, events) is None
    try:
        for e in events:
            actor = SPEC.actor_of(e)
            views.setdefault(actor, View(SPEC, actor, "r")).fire(e)
    except IllegalTransition:
        assert not legal


def test_mermaid_names_every_transition() -> None:
    text = SPEC.mermaid()
    for t in SPEC.transitions:
        assert t.event in text
