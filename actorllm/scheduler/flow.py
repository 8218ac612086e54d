"""The Scheduler's side of flow control: pausing a sequence whose client reads slowly.

The Frontend, which sees each reader's lag, sends ``FlowControl`` on the aborts' FIFO edge
(Frontend -> Tokenizer -> Scheduler); nothing here reads another actor's state.

The ladder, per sequence: PAUSED keeps its KV blocks (a reader that catches up soon costs
nothing); when blocks are needed by others, paused sequences give theirs up before any
running one is preempted, the longest-paused first (its reader is the least likely to be
back soon and closest to the Frontend's ``--stream-timeout``); they recompute on resume.
The cancel is the Frontend's: an abort when the timeout runs out.

:class:`Pacer` holds which sequences are paused and which pauses are asked for, and says
what follows from a message; the Scheduler, which owns the queues, the pool and the
ledger, carries its answers out.
"""

from __future__ import annotations

from collections.abc import Reversible

from actorllm.lifecycle.table import State
from actorllm.scheduler.sequence import Sequence
from actorllm.wire.messages import FlowControl

# Where a pause may take a sequence from (a FINISHED one ends; a PAUSED one already is).
_PAUSABLE = (State.RUNNING, State.WAITING, State.PREEMPTED)


class Pacer:
    """The Scheduler's paused sequences and the pauses not yet applied."""

    def __init__(self) -> None:
        # In the order they paused: the longest-paused gives its blocks up first, being the
        # least likely to be read soon.
        self.paused: dict[str, Sequence] = {}
        self.wanted: dict[str, Sequence] = {}  # asked for, applied at the next plan

    def on_flow(self, msg: FlowControl, seq: Sequence | None) -> Sequence | None:
        """Note a pause (applied at the next plan) or a resume. Returns the sequence that
        leaves PAUSED, for the Scheduler to queue again and fire ``resume`` for."""
        if seq is None or seq.status is State.FINISHED:
            # It ended: nothing to pace (the message travelled behind its request, so no
            # later incarnation can be meant).
            self.wanted.pop(msg.rid, None)
            return None
        if msg.pause:
            self.wanted[msg.rid] = seq
            return None
        self.wanted.pop(msg.rid, None)
        if seq.status is State.PAUSED:
            del self.paused[seq.rid]
            return seq
        return None

    def due(self) -> list[Sequence]:
        """The wanted pauses that may apply now, moved to :attr:`paused`: those no step in
        flight names (until then they are not planned ahead). The Scheduler takes each out
        of its queue and fires ``pause``."""
        out = []
        for rid, seq in list(self.wanted.items()):
            if seq.in_flight or seq.status not in _PAUSABLE:
                continue
            del self.wanted[rid]
            self.paused[rid] = seq
            out.append(seq)
        return out

    def holding_kv(self, keep: Sequence, waiting: Reversible[Sequence]) -> list[Sequence]:
        """Sequences that hold KV blocks but do not run, in the order they give them up:
        paused ones (longest paused first), then resumed ones still waiting with the KV
        they kept (newest in line first). ``keep`` is the one the room is for."""
        return [seq for seq in [*self.paused.values(), *reversed(waiting)]
                if seq is not keep and seq.block_table]

    def forget(self, rid: str) -> None:
        """The rid finished: no pause for it is pending, and it is not paused any more."""
        self.wanted.pop(rid, None)
        self.paused.pop(rid, None)
