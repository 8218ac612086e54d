"""Actor bugs the simulation found that are not fixed yet, and how the harness steps around
each one so that the rest of the state space can still be explored.

Protocol: while an id is listed in ``KNOWN_BUGS``, the stateful tests apply its workaround
(``SimConfig.workarounds``) and its deterministic reproducer in ``tests/test_simulation.py``
is a strict xfail. Fix the actor, then delete the id here: the reproducer becomes an
ordinary test, and the stateful tests explore that corner again with no help.

Each workaround stands in for the fix, in the harness, never in ``actorllm/``.
"""

from __future__ import annotations

import importlib.resources
from typing import Any

from actorllm.lifecycle import Spec, parse_spec

KNOWN_BUGS: dict[str, str] = {
    "stop-while-preempted": (
        "A StopMatched that reaches the Scheduler while its sequence is PREEMPTED (the "
        "Detokenizer matched a stop string in tokens the sequence had before it was "
        "preempted) makes Scheduler.finish_early fire 'finish', which the spec allows only "
        "from RUNNING: IllegalTransition kills the Scheduler, and with it the engine. "
        "Workaround: the spec lets 'finish' leave PREEMPTED too."
    ),
    "stale-stop-matched": (
        "StopMatched names only a rid. When the request it was sent for has already ended "
        "(e.g. by length on the same token) and its rid was reused, a StopMatched still on "
        "the Detokenizer->Scheduler edge finishes the new request with reason 'stop' (or, "
        "while the new one is WAITING, kills the Scheduler with IllegalTransition). "
        "Workaround: the harness drops a StopMatched sent for an earlier incarnation."
    ),
    "stale-sibling-abort": (
        "Frontend._abort_next holds parent rids (one entry per failed child). Entries still "
        "queued when the parent has been gathered and its rid reused abort the new request "
        "with that rid, which its client never aborted. Workaround: an entry is dropped "
        "when the registry no longer holds the same RequestState."
    ),
}


def spec_allowing_stop_while_preempted() -> Spec:
    """The shipped spec with ``finish`` also leaving PREEMPTED (workaround above)."""
    text = importlib.resources.files("actorllm.spec").joinpath("lifecycle.toml").read_text()
    old = 'event = "finish"\nfrom = ["RUNNING"]'
    if old not in text:
        raise AssertionError("spec/lifecycle.toml changed: is 'stop-while-preempted' fixed? "
                             "Then remove it from tests/sim/known_bugs.py")
    return parse_spec(text.replace(old, 'event = "finish"\nfrom = ["RUNNING", "PREEMPTED"]'))


class IdentityCheckedQueue(list):  # type: ignore[type-arg]
    """A stand-in for ``Frontend._abort_next``: remembers which RequestState each rid meant,
    and yields a rid nobody holds once the registry's entry for it is another request."""

    def __init__(self, registry: dict[str, Any]) -> None:
        super().__init__()
        self._registry = registry
        self._meant: list[Any] = []

    def append(self, rid: str) -> None:
        super().append(rid)
        self._meant.append(self._registry.get(rid))

    def pop(self, index: int = -1) -> str:  # type: ignore[override]
        rid: str = super().pop(index)
        meant = self._meant.pop(index)
        return rid if self._registry.get(rid) is meant else "\x00stale-abort"

