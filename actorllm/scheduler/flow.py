"""The Scheduler's side of flow control: pausing a sequence whose client reads slowly.

A mixin of :class:`actorllm.scheduler.actor.Scheduler`, kept apart so the Scheduler stays one
readable module; it reads and writes only the Scheduler's own state. The Frontend, which
sees each reader's lag, sends ``FlowControl`` on the aborts' FIFO edge (Frontend ->
Tokenizer -> Scheduler); nothing here reads another actor's state.

The ladder, per sequence: PAUSED keeps its KV blocks (a reader that catches up soon costs
nothing); when blocks are needed by others, paused sequences give theirs up before any
running one is preempted, the longest-paused first (its reader is the least likely to be
back soon and closest to the Frontend's ``--stream-timeout``); they recompute on resume.
The cancel is the Frontend's: an abort when the timeout runs out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from actorllm.lifecycle.table import Ledger, State
from actorllm.scheduler import seq_blocks as blocks
from actorllm.wire.messages import FlowControl

if TYPE_CHECKING:
    from actorllm.lifecycle.trace import Tracer
    from actorllm.scheduler.kv_pool import BlockPool
    from actorllm.scheduler.policy import WaitingQueue
    from actorllm.scheduler.sequence import Sequence


class Pacing:
    """Pause, resume and evict-while-paused; the Scheduler supplies the state below."""

    seqs: dict[str, Sequence]
    waiting: WaitingQueue
    running: list[Sequence]
    paused: dict[str, Sequence]
    pause_wanted: set[str]
    pool: BlockPool
    ledger: Ledger
    tracer: Tracer | None
    worker_drops: list[str]
    num_preemptions: int
    _stats_dirty: bool

    def _reset_for_recompute(self, seq: Sequence) -> None:
        raise NotImplementedError

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Blocks for ``n`` more tokens of ``seq``; KV of what does not run goes first."""
        if blocks.reserve(self.pool, seq, n):
            return True
        self._evict_paused(self.pool.blocks_for(seq.num_scheduled + n) - len(seq.block_table),
                           seq)
        return blocks.reserve(self.pool, seq, n)

    def _admit(self, seq: Sequence, hits: list[int], n: int) -> bool:
        """``blocks.admit``, after evicting KV of what does not run if it must."""
        if blocks.admit(self.pool, seq, hits, n):
            return True
        self._evict_paused(self.pool.blocks_for(len(hits) * self.pool.block_size + n), seq)
        return blocks.admit(self.pool, seq, hits, n)

    def on_flow(self, msg: FlowControl) -> None:
        """A reader fell behind (pause, applied at the next plan) or caught up (resume)."""
        seq = self.seqs.get(msg.rid)
        if self.tracer is not None:
            self.tracer.record("input", actor="scheduler", msg="pause" if msg.pause
                               else "resume", rid=msg.rid)
        if seq is None or seq.status is State.FINISHED:
            self.pause_wanted.discard(msg.rid)
            return  # it ended: nothing to pace (it travelled behind its request, so no
            # later incarnation can be meant)
        if msg.pause:
            self.pause_wanted.add(msg.rid)
            return
        self.pause_wanted.discard(msg.rid)
        if seq.status is State.PAUSED:
            del self.paused[seq.rid]
            self.waiting.add(seq, preempted=True)  # like a preempted one: before new arrivals
            self.ledger.fire(seq.rid, "resume")

    def _apply_pauses(self) -> None:
        """Take the sequences whose readers are behind out of the batch, once no step in
        flight names them (until then they are not planned ahead)."""
        for rid in list(self.pause_wanted):
            seq = self.seqs[rid]
            if seq.in_flight:
                continue
            if seq.status is State.RUNNING:
                self.running.remove(seq)
            elif seq.status in (State.WAITING, State.PREEMPTED):
                self.waiting.remove(seq)
            else:
                continue
            self.pause_wanted.discard(rid)
            self.paused[rid] = seq
            self.ledger.fire(rid, "pause")
            self._stats_dirty = True  # num_paused changed after handle() had flushed

    def _evict_paused(self, need: int, keep: Sequence) -> None:
        """Free KV of sequences that are not running, until ``need`` blocks fit: paused
        ones first (longest paused first), then resumed ones still waiting with the KV
        they kept (newest in line first). Each recomputes when it runs again."""
        for seq in [*self.paused.values(), *reversed(self.waiting)]:
            if self.pool.can_allocate(need):
                return
            if seq is keep or not seq.block_table:
                continue
            blocks.release(self.pool, seq)
            self._reset_for_recompute(seq)
            if seq.worker_knows:
                seq.worker_knows = False
                self.worker_drops.append(seq.rid)
            self.num_preemptions += 1
            if seq.status is State.PAUSED:
                self.ledger.fire(seq.rid, "preempt")
            # (a resumed one is PREEMPTED already: that state allows either)
