"""The batch and the queue before it: which sequences run, wait or are paused, and the KV
blocks each holds. Owned by the Scheduler (actorllm/scheduler/actor.py), which turns
what :meth:`Batch.plan` picks into a numbered ``StepPlan``.

Planning one step: pauses asked for are applied; under the priority policy an urgent
arrival may preempt; the running sequences get their next chunks, in order, preempting
from the end of that order when blocks run out; then waiting sequences start, front first,
while seats, blocks and the token budget last. Blocks of sequences that do not run (paused,
or resumed and still waiting) go before any running one is preempted, in the order the
:class:`~actorllm.scheduler.flow.Pacer` gives. Preemption is by recompute.

With a step in flight (``ahead``) nothing is preempted: where the plain path would
preempt, the plan is empty and the pipeline drains to one step.
"""

from __future__ import annotations

import time
from collections import deque

from actorllm.lifecycle.table import Ledger, State
from actorllm.scheduler import seq_blocks as blocks
from actorllm.scheduler.flow import Pacer
from actorllm.scheduler.kv_pool import BlockPool
from actorllm.scheduler.policy import WaitingQueue, arrival_victim, order
from actorllm.scheduler.sequence import Sequence
from actorllm.scheduler.speculation import DRAFT_PLACEHOLDER, Speculation
from actorllm.wire.messages import FlowControl

Chunks = list[tuple[Sequence, int]]  # (sequence, tokens it runs in the step), in order


class Batch:
    """Who runs, who waits, who is paused, and the block pool they share."""

    def __init__(self, pool: BlockPool, ledger: Ledger, *, max_num_seqs: int,
                 max_num_batched_tokens: int, priority: bool,
                 speculation: Speculation | None = None) -> None:
        """``ledger``: the Scheduler's, where each move this makes is fired;
        ``speculation``: draft proposals for decode rows (None: off)."""
        self.speculation = speculation
        self.pool, self.ledger = pool, ledger
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.priority = priority
        self.waiting = WaitingQueue(by_priority=priority)
        self.running: list[Sequence] = []
        self.flow = Pacer()  # PAUSED sequences, and pauses asked for, not yet applied
        self.worker_drops: list[str] = []  # rids whose Worker state may go (StepPlan.drop)
        self.num_preemptions = 0

    # --- membership ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """A new sequence, at the back of the line (or its place by priority)."""
        self.waiting.add(seq)

    def pace(self, msg: FlowControl, seq: Sequence | None) -> None:
        """A reader fell behind (pause, applied at the next plan) or caught up (resume)."""
        resumed = self.flow.on_flow(msg, seq)
        if resumed is not None:
            self.waiting.add(resumed, preempted=True)  # like a preempted one: before arrivals
            self.ledger.fire(resumed.rid, "resume")

    def remove(self, seq: Sequence) -> None:
        """``seq`` is about to finish: it leaves whichever queue holds it."""
        if seq.status is not State.PAUSED:
            (self.running if seq.status is State.RUNNING else self.waiting).remove(seq)
        self.flow.forget(seq.rid)

    def release(self, seq: Sequence) -> None:
        """A finished sequence no step reads any more: its blocks and Worker state go."""
        blocks.release(self.pool, seq)
        if seq.worker_knows:
            self.worker_drops.append(seq.rid)

    def computed(self, seq: Sequence, n: int) -> None:
        """A step that ran ``n`` tokens of ``seq`` is back: its full blocks may be shared."""
        seq.num_computed += n
        if seq.num_computed // self.pool.block_size > seq.num_registered:  # (most steps: no)
            blocks.register(self.pool, seq)

    def take(self, seq: Sequence, tokens: tuple[int, ...], drafted: int
             ) -> tuple[int, str | None, int | None]:
        """A sampling row's tokens for ``seq``: (tokens appended, finish reason, stop token).
        A speculating row's (``drafted`` > 0, ``Sequence.take_tokens``) are appended up to
        the first that ends it; the accepted drafts among them count as computed, so their
        blocks may be hashed (over accepted tokens only: a rejected one is never
        appended)."""
        if not drafted:
            return (1, *seq.finish_after(tokens[0]))
        appended, reason, stop = seq.take_tokens(tokens)
        self.computed(seq, min(appended, len(tokens) - 1))
        assert self.speculation is not None
        self.speculation.verdict(seq, drafted, len(tokens) - 1)
        return appended, reason, stop

    @property
    def lookup(self) -> tuple[int, int]:
        """The n-gram lengths a row planned ahead is looked up with (AheadRows)."""
        return self.speculation.lookup if self.speculation is not None else (1, 1)

    def speculation_fields(self) -> dict[str, object]:
        """The proposer's counters, as SchedulerStats fields (none when it is off)."""
        spec = self.speculation
        if spec is None:
            return {}
        return {"spec_draft_tokens": spec.draft_tokens,
                "spec_accepted_tokens": spec.accepted_tokens,
                "spec_num_drafts": spec.num_drafts,
                "spec_accepted_per_pos": tuple(spec.accepted_per_pos)}

    def take_worker_drops(self) -> tuple[str, ...]:
        """The rids whose Worker state may go, for the next StepPlan (and then forgotten)."""
        drops, self.worker_drops = tuple(self.worker_drops), []
        return drops

    # --- planning -----------------------------------------------------------------------

    def plan(self, ahead: bool) -> Chunks | None:
        """The next step's chunks: running sequences first, then admissions. None: plan
        nothing now (``ahead``, it would have to preempt)."""
        if self.flow.wanted:
            self.apply_pauses()
        spec = self.speculation
        if ahead and spec is not None and not spec.ahead and any(
                self._waits_for_verdict(seq) for seq in self.running):
            return None  # the pipeline drains to one step while rows speculate
        while self.priority and (
                v := arrival_victim(self.waiting, self.running, self.can_start)):
            if ahead:
                return None  # an urgent arrival preempts: only the plain path may
            self.preempt(v)
        running = self._plan_running(ahead)
        if running is None:
            return None
        planned, preempted = running
        # No admissions in a step that had to preempt (the victim would come straight back
        # and be preempted again), unless nothing runs any more.
        if not preempted or not self.running:
            self._plan_admissions(planned, self.max_num_batched_tokens - sum(
                n for _, n in planned))
        return planned

    def apply_pauses(self) -> None:
        """Take the sequences whose readers are behind out of the batch, once no step in
        flight names them (until then they are not planned ahead)."""
        for seq in self.flow.due():
            if seq.status is State.RUNNING:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self.ledger.fire(seq.rid, "pause")

    def _plan_running(self, ahead: bool) -> tuple[Chunks, bool] | None:
        """The running sequences' next chunks, preempting the newest (or the lowest
        priority) where blocks run out: (chunks, whether it preempted)."""
        budget = self.max_num_batched_tokens
        planned: Chunks = []
        # Victims come from the end: the newest (fcfs) or the lowest priority, then newest.
        queue = deque(sorted(self.running, key=order) if self.priority else self.running)
        preempted = False
        block_size = self.pool.block_size
        spec, sized, room = self.speculation, -1, 0  # (a row's draft room, per batch size)
        past_drafts = spec is not None and spec.ahead
        while queue and budget > 0:
            seq = queue.popleft()
            if ahead and (not seq.may_plan_ahead(past_drafts) or seq.rid in self.flow.wanted):
                continue  # (a pause waits for the steps that name it to return)
            n = min(seq.num_unscheduled, budget)
            if n <= 0:
                continue
            if n == 1 and spec is not None:
                if sized != len(self.running):  # (once a plan, unless it preempts)
                    sized, room = len(self.running), spec.per_row(len(self.running))
                if room:
                    n = self._draft(seq, min(budget, 1 + room))
            # (most rows fit in the blocks they hold: no call for those)
            while seq.num_scheduled + n > len(seq.block_table) * block_size \
                    and not self.reserve(seq, n):
                if ahead:
                    # No preemption while a step runs. Rather than run younger sequences
                    # past an older one, plan nothing: the pipeline drains to one step
                    # and the plain path preempts the newest, as without overlap.
                    for planned_seq, _ in planned:
                        planned_seq.drafts = []  # (their blocks stay, for the next plan)
                        planned_seq.ahead_caps = []
                    return None
                victim = queue.pop() if queue else seq
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                planned.append((seq, n))
                budget -= n
        return planned, preempted

    def _waits_for_verdict(self, seq: Sequence) -> bool:
        """Whether ``seq`` speculates in a step in flight, or may in its next one (a
        token in flight, and ``Speculation.wants``). With a draft model no step is then
        planned ahead: its next step must wait for that verdict or token (the draft's
        pass needs the row's start), and planning the others ahead without it would
        split the rows between two half-full steps in flight (measured: more, emptier
        steps). N-gram rows need no wait: the Worker starts and drafts for them
        (``Speculation.ahead``)."""
        spec = self.speculation
        return seq.drafting or (bool(seq.samples_in_flight) and spec is not None
                                and spec.wants(seq, len(self.running)))

    def _draft(self, seq: Sequence, budget: int) -> int:
        """Propose drafts for a decode row whose tokens are all known; they take token
        budget and blocks (never by preempting: without room it runs without drafts).
        Returns the row's token count."""
        spec = self.speculation
        assert spec is not None
        if seq.samples_in_flight:  # planned ahead: its last token is still being sampled
            if not spec.ahead:  # (a draft model's row: one in back-off, which counts
                spec.step_without_proposal(seq)  # its steps, planned ahead or not)
                return 1
            # The Worker looks its drafts up (AheadRows); their blocks are reserved as
            # if the step in flight accepted all of its own.
            caps = spec.propose_ahead(seq, budget - 1, len(self.running))
            k = max(caps)
            if k and blocks.reserve(self.pool, seq, 1 + k):
                seq.drafts, seq.ahead_caps = [DRAFT_PLACEHOLDER] * k, caps
                return 1 + k
            return 1
        drafts = spec.propose(seq, budget - 1, len(self.running))
        if drafts and blocks.reserve(self.pool, seq, 1 + len(drafts)):
            seq.drafts = drafts
            return 1 + len(drafts)
        return 1

    def _plan_admissions(self, planned: Chunks, budget: int) -> None:
        """Start waiting sequences, front first, while seats, blocks and ``budget`` last;
        their first chunks join ``planned``.

        A prompt whose next block this step computes for another waits a step (then
        starts from that block too) and keeps its place at the front; the ones behind it
        still start. Stopping the line there instead left a step at a burst's arrival
        half empty whenever two prompts shared a block (issue 28: 798 and 1,295 of 2,048
        tokens, every later first token one step later)."""
        computing = blocks.computing(self.pool, planned) if self.waiting else set()
        deferred: list[Sequence] = []  # front ones waiting on a block this step computes
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.block_table:  # resumed with the KV it kept while paused
                n = min(seq.num_unscheduled, budget)
                if not self.reserve(seq, n):
                    break
            else:
                hits = blocks.cache_hits(self.pool, seq)
                if blocks.next_block_computing(self.pool, seq, hits, computing):
                    deferred.append(self.waiting.popleft())
                    continue
                n = min(seq.num_tokens - len(hits) * self.pool.block_size, budget)
                if not self.admit(seq, hits, n):
                    break
            self.waiting.popleft()
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
            self.running.append(seq)
            self.ledger.fire(seq.rid, "schedule")
            planned.append((seq, n))
            computing |= blocks.computing(self.pool, [(seq, n)])
            budget -= n
        # (popped from the front in order, so the queue's order, by priority too, holds)
        self.waiting.extendleft(reversed(deferred))

    def can_start(self, seq: Sequence) -> bool:
        """A seat for a waiting sequence, and blocks for its first chunk."""
        return len(self.running) < self.max_num_seqs and blocks.fits(
            self.pool, seq, self.max_num_batched_tokens)

    # --- blocks -------------------------------------------------------------------------

    def reserve(self, seq: Sequence, n: int) -> bool:
        """Blocks for ``n`` more tokens of ``seq``; KV of what does not run goes first."""
        if blocks.reserve(self.pool, seq, n):
            return True
        self._make_room(self.pool.blocks_for(seq.num_scheduled + n) - len(seq.block_table), seq)
        return blocks.reserve(self.pool, seq, n)

    def admit(self, seq: Sequence, hits: list[int], n: int) -> bool:
        """``blocks.admit``, after evicting KV of what does not run if it must."""
        if blocks.admit(self.pool, seq, hits, n):
            return True
        self._make_room(self.pool.blocks_for(len(hits) * self.pool.block_size + n), seq)
        return blocks.admit(self.pool, seq, hits, n)

    def _make_room(self, need: int, keep: Sequence) -> None:
        """Free KV of sequences that are not running, in the Pacer's order, until ``need``
        blocks fit. Each recomputes when it runs again."""
        for seq in self.flow.holding_kv(keep, self.waiting):
            if self.pool.can_allocate(need):
                return
            self.drop_kv(seq)
            if seq.status is State.PAUSED:
                self.ledger.fire(seq.rid, "preempt")
            # (a resumed one is PREEMPTED already: that state allows either)

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: give back the blocks now (no step is in flight)."""
        assert not seq.in_flight
        self.running.remove(seq)
        self.drop_kv(seq)
        self.waiting.add(seq, preempted=True)
        self.ledger.fire(seq.rid, "preempt")

    def drop_kv(self, seq: Sequence) -> None:
        """Preemption by recompute: its blocks go back, the Worker forgets it."""
        blocks.release(self.pool, seq)
        seq.reset_for_recompute()
        if seq.worker_knows:
            seq.worker_knows = False
            self.worker_drops.append(seq.rid)
        self.num_preemptions += 1
