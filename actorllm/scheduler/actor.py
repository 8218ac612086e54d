"""The Scheduler actor: owns every Sequence, the waiting and running queues, and the
KV block pool, and makes every finish decision.

It hears from the Tokenizer (``SequenceRequest``, and ``AbortRequest`` on the same edge),
the Worker (``StepResult``) and the Detokenizer (``StopMatched``); it speaks ``StepPlan``
to the Worker and ``TokenBatch`` to the Detokenizer. Theory of operation:
- At most ``max_steps_in_flight`` steps run (1, or 2 for overlap scheduling). With 2 the
  next step is planned while one runs, a token the running step samples going as
  ``FEED_LAST_SAMPLE`` for the Worker to feed forward. Planning ahead never preempts:
  where the plain path would, it plans nothing and the pipeline drains to one step.
- Handling a message is synchronous (``handle``); a separate task sends. So the inbox
  always drains, and Scheduler -> Detokenizer -> Scheduler cannot deadlock.
- The step fence: a sequence that finishes while steps that use it are in flight keeps
  its blocks until every one of them is back.
- Prefix caching (scheduler/kv_pool.py, scheduler/seq_blocks.py): blocks are shared by
  reference count and cached or evicted only with none left; a fenced sequence keeps its references.
- Flow control: ``FlowControl(pause)`` (the client's reader is behind) takes a sequence
  out of the batch at the next plan no step in flight names it; it keeps its blocks
  (PAUSED) until another sequence needs them, then gives them up (recompute on resume).
  ``FlowControl(resume)`` puts it first in the waiting queue (PREEMPTED). (scheduler/flow.py)
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import trio

from actorllm.lifecycle.table import Ledger, State
from actorllm.lifecycle.trace import Tracer
from actorllm.scheduler import seq_blocks as blocks
from actorllm.scheduler.flow import Pacing
from actorllm.scheduler.kv_pool import BlockPool
from actorllm.scheduler.policy import POLICIES, WaitingQueue, arrival_victim, order
from actorllm.scheduler.sequence import Sequence, take_prompt_pieces
from actorllm.wire.mailbox import Inbox, Outbox
from actorllm.wire.messages import (
    FEED_LAST_SAMPLE,
    AbortRequest,
    FlowControl,
    SchedulerInput,
    SchedulerStats,
    SequenceRequest,
    StepPlan,
    StepResult,
    StopMatched,
    TokenBatch,
    TokenLogprob,
    TokenOut,
)

log = logging.getLogger(__name__)


class Scheduler(Pacing):
    """Continuous batching: chunked prefill, preemption by recompute, prefix caching, an
    optional priority order, pauses for slow readers, one or two steps in flight."""

    pool_class = BlockPool  # a seam for the simulation's planted bugs (tests/sim/bugs.py)
    replica = 0  # data-parallel replica, stamped on its stats (set by build_actors)

    def __init__(
        self,
        inbox: Inbox[SchedulerInput],
        worker: Outbox[StepPlan],
        detokenizer: Outbox[TokenBatch],
        *,
        num_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_steps_in_flight: int = 1,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",
        tracer: Tracer | None = None,
    ) -> None:
        if max_steps_in_flight not in (1, 2):
            raise ValueError(f"max_steps_in_flight must be 1 or 2, got {max_steps_in_flight}")
        self.inbox, self.worker, self.detokenizer = inbox, worker, detokenizer
        self.pool = self.pool_class(num_blocks, block_size, enable_prefix_caching)
        if scheduling_policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {scheduling_policy!r}")
        self.priority = scheduling_policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.tracer = tracer
        self.ledger = Ledger("scheduler", tracer)
        self.seqs: dict[str, Sequence] = {}
        self.waiting = WaitingQueue(by_priority=self.priority)
        self.running: list[Sequence] = []
        self.fenced: list[Sequence] = []  # finished, waiting for the step in flight
        self.max_steps_in_flight = max_steps_in_flight
        self.in_flight: deque[StepPlan] = deque()  # sent, result not yet back; oldest first
        # PAUSED (in the order they paused: the longest-paused gives its blocks up first,
        # being the least likely to be read soon), and pauses asked for, not yet applied.
        self.paused: dict[str, Sequence] = {}
        self.pause_wanted: set[str] = set()
        self.next_step_id = 0
        self.next_incarnation = 0
        self.worker_drops: list[str] = []  # rids whose Worker state may go (StepPlan.drop)
        self._outputs: list[TokenOut] = []
        self._freed: list[str] = []
        self._stats_dirty, self._wake = False, trio.Event()
        # Counters (exported through SchedulerStats); ahead_tokens_dropped: rows planned
        # ahead for a sequence that ended meanwhile.
        self.num_preemptions = self.late_results_dropped = self.late_stops_dropped = 0
        self.ahead_tokens_dropped = self.steps = 0
        self.forward_s = self.sample_s = 0.0
        if tracer is not None:  # what `actorllm replay --redrive` needs to rebuild us
            tracer.record("config", actor="scheduler", num_blocks=num_blocks,
                          block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          max_steps_in_flight=max_steps_in_flight,
                          enable_prefix_caching=enable_prefix_caching,
                          scheduling_policy=scheduling_policy)

    async def run(self) -> None:
        """Receive and decide in one task, send in another (see the module docstring)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sender)
            async for msg in self.inbox:
                self.handle(msg)
                self._wake.set()

    async def _sender(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            # Plan first: the next step runs while the Detokenizer and Frontend work.
            while len(self.in_flight) < self.max_steps_in_flight:
                plan = self.schedule()
                if plan is None:
                    break
                await self.worker.send(plan)
            await self.flush()

    async def flush(self) -> None:
        """Send what the decisions so far produced to the Detokenizer."""
        batch = self.take_batch()
        if batch is not None:
            await self.detokenizer.send(batch)

    def take_batch(self) -> TokenBatch | None:
        """The outputs, frees and stats decided since the last call, if any."""
        if not (self._outputs or self._freed or self._stats_dirty):
            return None
        batch = TokenBatch(tuple(self._outputs), tuple(self._freed), self.stats())
        self._outputs, self._freed, self._stats_dirty = [], [], False
        return batch

    def handle(self, msg: Any) -> None:
        """Apply one message to the Scheduler's state. Never blocks."""
        if isinstance(msg, StepResult):
            self.on_result(msg)
        elif isinstance(msg, SequenceRequest):
            self.on_request(msg)
        elif isinstance(msg, AbortRequest):
            self.finish_early(msg.rid, "abort")
        elif isinstance(msg, FlowControl):
            self.on_flow(msg)  # actorllm/scheduler/flow.py
        elif isinstance(msg, StopMatched):
            seq = self.seqs.get(msg.rid)
            # A stop found for an earlier request under this rid must not end this one.
            if seq is None or seq.incarnation != msg.incarnation or not self.finish_early(
                    msg.rid, "stop", msg.stop):
                self.late_stops_dropped += 1
        else:  # the mailbox's type check makes this unreachable
            raise TypeError(type(msg).__name__)
        self._stats_dirty = True

    def on_request(self, req: SequenceRequest) -> None:
        if req.rid in self.seqs:
            # The Frontend keeps rids unique while live; a duplicate here is a bug upstream.
            raise AssertionError(f"duplicate live rid {req.rid!r} reached the scheduler")
        self.ledger.fire(req.rid, "enqueue", prompt_tokens=len(req.prompt_token_ids))
        seq = Sequence(req.rid, list(req.prompt_token_ids), req.params, req.max_tokens,
                       frozenset(req.eos_token_ids), req.arrival_time,
                       view=self.ledger.view(req.rid), incarnation=self.next_incarnation)
        self.next_incarnation += 1
        self.seqs[seq.rid] = seq
        self.waiting.add(seq)
        if self.tracer is not None:
            self.tracer.record("input", actor="scheduler", msg="SequenceRequest", rid=req.rid,
                               prompt_tokens=len(req.prompt_token_ids), max_tokens=req.max_tokens,
                               params=req.params, eos_token_ids=req.eos_token_ids,
                               # Cache hits depend on the ids themselves (for redrive).
                               prompt_token_ids=self.pool.enable_caching and req.prompt_token_ids)

    def finish_early(self, rid: str, reason: str, stop: str | None = None) -> bool:
        """Abort, or a stop string: stop future work now. False if nothing was live."""
        seq = self.seqs.get(rid)
        if self.tracer is not None:
            self.tracer.record("input", actor="scheduler", msg=reason, rid=rid)
        if seq is None or seq.status is State.FINISHED:
            return False  # idempotent: already finished, freed, or never seen
        self._finish(seq, "abort" if reason == "abort" else "finish", reason, stop)
        return True

    def schedule(self) -> StepPlan | None:
        """Plan the next step: running sequences first, then admissions. None if idle.

        With a step in flight this plans *ahead* (overlap scheduling): it runs what does
        not wait on that step's results and never preempts; where the plain path would
        preempt, it plans nothing (see the module docstring).
        """
        assert len(self.in_flight) < self.max_steps_in_flight
        ahead = bool(self.in_flight)
        if self.pause_wanted:
            self._apply_pauses()
        budget = self.max_num_batched_tokens
        planned: list[tuple[Sequence, int]] = []
        while self.priority and (
                v := arrival_victim(self.waiting, self.running, self._can_start)):
            if ahead:
                return None  # an urgent arrival preempts: only the plain path may
            self._preempt(v)
        # Victims come from the end: the newest (fcfs) or the lowest priority, then newest.
        queue = sorted(self.running, key=order) if self.priority else list(self.running)
        preempted = False
        while queue and budget > 0:
            seq = queue.pop(0)
            if ahead and (not seq.may_plan_ahead() or seq.rid in self.pause_wanted):
                continue  # (a pause waits for the steps that name it to return)
            n = min(seq.num_unscheduled, budget)
            if n <= 0:
                continue
            while not self._reserve(seq, n):
                if ahead:
                    # No preemption while a step runs. Rather than run younger sequences
                    # past an older one, plan nothing: the pipeline drains to one step
                    # and the plain path preempts the newest, as without overlap.
                    return None
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                planned.append((seq, n))
                budget -= n
        # No admissions in a step that had to preempt (the victim would come straight back
        # and be preempted again), unless nothing runs any more.
        admit = not preempted or not self.running
        computing = blocks.computing(self.pool, planned) if admit and self.waiting else set()
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.block_table:  # resumed with the KV it kept while paused
                n = min(seq.num_unscheduled, budget)
                if not self._reserve(seq, n):
                    break
            else:
                hits = blocks.cache_hits(self.pool, seq)
                if blocks.next_block_computing(self.pool, seq, hits, computing):
                    break  # it waits a step, then starts from that block too
                n = min(seq.num_tokens - len(hits) * self.pool.block_size, budget)
                if not self._admit(seq, hits, n):
                    break
            self.waiting.popleft()
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
            self.running.append(seq)
            self.ledger.fire(seq.rid, "schedule")
            planned.append((seq, n))
            computing |= blocks.computing(self.pool, [(seq, n)])
            budget -= n
        if not planned:
            if ahead:
                return None  # drops, if any, go with a later plan
            if self.waiting and not self.running and not self.fenced:
                # Cannot happen while the pool holds max_model_len tokens (checked at start).
                raise AssertionError("waiting sequence can never fit in the KV pool")
            if not self.worker_drops:
                return None
            # Nothing to run, but the Worker still holds state for freed rids: an empty
            # step tells it to let go, so a drained engine holds nothing anywhere.
        plan = StepPlan(
            step_id=self.next_step_id,
            seqs=tuple(seq.scheduled(n) for seq, n in planned),
            drop=tuple(self.worker_drops),
        )
        self.worker_drops = []
        self.next_step_id += 1
        self.in_flight.append(plan)
        if self.tracer is not None:
            self.tracer.record("plan", actor="scheduler", step=plan.step_id,
                               seqs=[[s.rid, len(s.token_ids), s.sample] for s in plan.seqs])
        return plan

    def _can_start(self, seq: Sequence) -> bool:
        """A seat for a waiting sequence, and blocks for its first chunk."""
        return len(self.running) < self.max_num_seqs and blocks.fits(
            self.pool, seq, self.max_num_batched_tokens)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: give back the blocks now (no step is in flight)."""
        assert not seq.in_flight and not self.in_flight
        self.running.remove(seq)
        blocks.release(self.pool, seq)
        self._reset_for_recompute(seq)
        if seq.worker_knows:
            seq.worker_knows = False
            self.worker_drops.append(seq.rid)
        self.waiting.add(seq, preempted=True)
        self.num_preemptions += 1
        self.ledger.fire(seq.rid, "preempt")

    def on_result(self, result: StepResult) -> None:
        # The Worker runs plans in order, so a result answers the oldest plan in flight.
        if not self.in_flight or result.step_id != self.in_flight[0].step_id:
            self.late_results_dropped += 1  # a duplicate or stale result: never an error
            log.debug("dropped result of step %d", result.step_id)
            return
        plan = self.in_flight.popleft()
        self.steps += 1
        self.forward_s += result.forward_s
        self.sample_s += result.sample_s
        if self.tracer is not None:
            self.tracer.record("result", actor="scheduler", step=result.step_id,
                               tokens=[[t.rid, t.token_id] for t in result.tokens],
                               error=result.error, forward_s=result.forward_s)
        for s in plan.seqs:
            seq = self.seqs.get(s.rid)
            if seq is None:
                continue
            seq.step_returned(s)
            if seq.status is State.RUNNING and result.error is None:
                seq.num_computed += len(s.token_ids)
                blocks.register(self.pool, seq)
        # Finished sequences no step in flight names any more give their blocks back.
        passed = [seq for seq in self.fenced if self._fence_passed(seq)]
        self.fenced = [seq for seq in self.fenced if seq not in passed]
        for seq in passed:
            self._free(seq)
        if result.error is not None:
            for s in plan.seqs:
                seq = self.seqs.get(s.rid)
                if seq is not None and seq.status is State.RUNNING:
                    self._finish(seq, "fail", "error", error=result.error)
            return
        pieces, gaps = take_prompt_pieces(
            [q for q in (self._running(s.rid) for s in plan.seqs) if q is not None],
            result.prompt_logprobs)
        for seq, gap in gaps:
            # A Worker bug. The client must not get a list with holes, and the other
            # requests need not die with this one.
            log.error("%s: %s", seq.rid, gap)
            self._finish(seq, "fail", "error", error=gap)
        for tok in result.tokens:
            seq = self._running(tok.rid)
            if seq is None:
                if any(s.rid == tok.rid and s.token_ids[0] == FEED_LAST_SAMPLE
                       for s in plan.seqs):
                    self.ahead_tokens_dropped += 1  # planned ahead past its end
                else:
                    self.late_results_dropped += 1  # finished (abort, stop) while it ran
                continue
            self._append(seq, tok.token_id, tok.logprob, pieces.pop(seq.rid, None))
        for s in plan.seqs:
            seq = self._running(s.rid)
            if seq is None:
                continue
            piece = pieces.pop(seq.rid, None)
            if piece is not None:  # a prefill chunk that sampled nothing
                self._outputs.append(TokenOut(seq.rid, spec=seq.detok_spec_once(), **piece))
            if seq.max_tokens == 0 and seq.num_computed == seq.num_tokens \
                    and not seq.in_flight:
                self._finish(seq, "finish", "length")  # the prompt is scored: nothing to sample

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None,
                piece: dict[str, Any] | None = None) -> None:
        reason, stop_reason = seq.finish_after(token)
        self._outputs.append(
            TokenOut(
                rid=seq.rid,
                token_ids=(token,),
                logprobs=(logprob,) if logprob is not None else (),
                spec=seq.detok_spec_once(),
                **(piece or {}),
            )
        )
        if reason is not None:
            self._finish(seq, "finish", reason, stop_reason)

    def _finish(self, seq: Sequence, event: str, reason: str, stop_reason: Any = None,
                error: str | None = None) -> None:
        """The one terminal transition; blocks go back now or after the fence."""
        if seq.status is State.PAUSED:
            del self.paused[seq.rid]
        else:
            (self.running if seq.status is State.RUNNING else self.waiting).remove(seq)
        self.ledger.fire(seq.rid, event, reason=reason)
        # Merged with this step's token for the rid, if any: one TokenOut per rid per batch.
        last = self._outputs[-1] if self._outputs else None
        if last is not None and last.rid == seq.rid and last.finish_reason is None:
            self._outputs.pop()
        else:
            last = None
        out = seq.final_output(reason, stop_reason, error, last)
        self._outputs.append(out)
        if self._fenced(seq):
            self.fenced.append(seq)
        else:
            self._free(seq)

    def _running(self, rid: str) -> Sequence | None:
        """The rid's Sequence if it is RUNNING: only those take a step's results."""
        seq = self.seqs.get(rid)
        return seq if seq is not None and seq.status is State.RUNNING else None

    def _reset_for_recompute(self, seq: Sequence) -> None:  # a seam for tests/sim/bugs.py
        seq.reset_for_recompute()

    def _fenced(self, seq: Sequence) -> bool:
        """Invariant 3: blocks a step in flight reads go back only after its result."""
        return seq.in_flight > 0

    def _fence_passed(self, seq: Sequence) -> bool:
        """For a fenced sequence, after a result: no step in flight names it any more."""
        return not seq.in_flight

    def _free(self, seq: Sequence) -> None:
        blocks.release(self.pool, seq)
        del self.seqs[seq.rid]
        self.pause_wanted.discard(seq.rid)
        if seq.worker_knows:
            self.worker_drops.append(seq.rid)
        self.ledger.fire(seq.rid, "free")
        self.ledger.drop(seq.rid)
        self._freed.append(seq.rid)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_blocks_used=self.pool.num_used, kv_blocks_total=self.pool.num_blocks,
            num_preemptions=self.num_preemptions, num_paused=len(self.paused),
            late_results_dropped=self.late_results_dropped, steps=self.steps,
            forward_s=self.forward_s, sample_s=self.sample_s, replica=self.replica,
            prefix_cache_queries=self.pool.queries, prefix_cache_hits=self.pool.hits)

    def drain_problems(self) -> list[str]:
        """What is still held (empty after a clean drain: invariant 4)."""
        return [why for held, why in (
            (self.seqs, f"scheduler holds sequences {sorted(self.seqs)}"),
            (self.pool.num_used, f"{self.pool.num_used} KV blocks still in use"),
            (self.in_flight, f"steps {[p.step_id for p in self.in_flight]} still in flight"),
            (len(self.ledger), f"scheduler ledger holds {sorted(self.ledger.views)}"),
        ) if held]
