"""Fuzz the request state machine: arbitrary event sequences into per-actor ledgers.

Contract (actorllm/lifecycle/table.py): firing any event, known or not, by any actor, known or
not, for any rid either moves that actor's view or raises ``IllegalTransition`` naming the
rid, state and event; nothing else escapes. An accepted event is always one the spec
gives to that actor, and a view only ever names states of the spec. The invariant
checker (actorllm/lifecycle/invariants.py) judges any merged sequence without raising.

Input: pairs of bytes. The first picks the actor (low 3 bits) and the rid (high bits);
the second picks the event, or, when its top bit is set, takes the next bytes (up to a
zero) as a raw event name.

    python fuzz/fuzz_lifecycle.py -atheris_runs=20000 fuzz/corpus/lifecycle
"""

from __future__ import annotations

from _harness import main

from actorllm.lifecycle.invariants import History, first_illegal
from actorllm.lifecycle.table import ACTORS, IllegalTransition, Ledger, load_spec

NAME = "lifecycle"
SPEC = load_spec()
EVENTS = (*SPEC.events(), "", "bogus")
WHO = (*ACTORS, "nobody", "")
STATES = {*SPEC.states, "NONE"}


def _events(data: bytes) -> list[tuple[str, str, str]]:
    out, i = [], 0
    while i + 1 < len(data):
        who, what = data[i], data[i + 1]
        i += 2
        if what & 0x80:  # a raw name: the bytes up to the next zero
            end = data.find(0, i)
            end = len(data) if end < 0 else end
            event = data[i:end].decode("utf-8", "replace")
            i = end + 1
        else:
            event = EVENTS[what % len(EVENTS)]
        out.append((WHO[(who & 7) % len(WHO)], f"r{who >> 5}", event))
    return out


def TestOneInput(data: bytes) -> None:
    ledgers = {actor: Ledger(actor) for actor in WHO}
    merged: dict[str, list[str]] = {}
    for actor, rid, event in _events(data):
        ledger = ledgers[actor]
        try:
            after = ledger.fire(rid, event)
        except IllegalTransition as exc:
            assert (exc.rid, exc.event, exc.actor) == (rid, event, actor), exc
            assert set(exc.state.split("|")) <= STATES, exc.state
        else:
            assert SPEC.actor_of(event) == actor, (actor, event)
            assert set(after.split("|")) <= STATES, after
            merged.setdefault(rid, []).append(event)
        bad = first_illegal(SPEC, merged.get(rid, []))
        if bad is not None:
            index, state, what = bad
            assert 0 <= index < len(merged[rid]) and merged[rid][index] == what
            assert state is None or state in STATES
    for events in merged.values():  # the whole checker: findings, never exceptions
        history = History(SPEC)
        found = [f for f in map(history.push, events) if f is not None]
        end = history.end()
        assert len(found) + (end is not None) <= 1, (found, end)
        for f in found:
            assert f.index is not None and events[f.index] in EVENTS, f
        if len(ledger.views) > 8:
            ledger.drop(rid)


if __name__ == "__main__":
    main(TestOneInput)
