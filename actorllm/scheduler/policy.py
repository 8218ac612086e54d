"""The scheduling policy: in what order waiting sequences start (``--scheduling-policy``).

``fcfs``: by arrival; a preempted sequence goes back to the front. ``priority``: by
``SamplingParams.priority`` (lower first, vLLM's meaning), then by arrival, so equal
priorities are served first come first served and a preempted sequence keeps its place
among them.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

from actorllm.scheduler.sequence import Sequence

POLICIES = ("fcfs", "priority")


def order(seq: Sequence) -> tuple[int, int]:
    """The priority order: lower priority value first, then arrival (the Scheduler numbers
    arrivals with ``incarnation``)."""
    return seq.priority, seq.incarnation


class WaitingQueue(deque[Sequence]):
    """The Scheduler's waiting sequences, front first."""

    def __init__(self, by_priority: bool) -> None:
        super().__init__()
        self.by_priority = by_priority

    def add(self, seq: Sequence, preempted: bool = False) -> None:
        if self.by_priority:
            bisect.insort(self, seq, key=order)
        elif preempted:
            self.appendleft(seq)
        else:
            self.append(seq)


def arrival_victim(waiting: WaitingQueue, running: list[Sequence],
                   can_start: Callable[[Sequence], bool]) -> Sequence | None:
    """Priority policy: the running sequence to preempt so that the head of ``waiting``,
    which cannot start (no seat or no blocks), can: the lowest priority, newest first, and
    only one of strictly lower priority. Equal priorities never preempt each other, so
    none starves another."""
    if not waiting or not running:
        return None
    head, victim = waiting[0], max(running, key=order)
    if victim.priority <= head.priority or can_start(head):
        return None
    return victim
