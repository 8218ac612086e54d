"""The Scheduler actor: owns every Sequence, the batch (scheduler/batch.py: the queues and
the KV block pool), the steps in flight, and makes every finish decision.

It hears from the Tokenizer (``SequenceRequest``, ``AbortRequest``), the Worker
(``StepResult``) and the Detokenizer (``StopMatched``); it speaks ``StepPlan`` to the
Worker, ``TokenBatch`` to the Detokenizer. Theory of operation:
- At most ``max_steps_in_flight`` steps run (1, or 2 for overlap scheduling). With 2 the
  next step is planned while one runs, a token the running step samples going as
  ``FEED_LAST_SAMPLE`` for the Worker to feed forward. Planning ahead never preempts:
  where the plain path would, it plans nothing and the pipeline drains to one step.
  Nor within ``quiet_s`` of a request's arrival: while a burst arrives, each step is
  planned when the one before returns, so an arrival joins the next step.
- Handling a message is synchronous (``handle``); a separate task sends (no deadlock).
- The step fence: a sequence that finishes while steps that use it are in flight keeps
  its blocks until every one of them is back.
- Prefix caching (kv_pool.py, seq_blocks.py): blocks are shared by reference count and
  cached or evicted only with none left; a fenced sequence keeps its references.
- Flow control (flow.py): ``FlowControl(pause)`` parks a sequence (PAUSED, blocks kept).
- Speculation (speculation.py): a decode row may carry drafts, checked in order.
- Outputs go as columns (outgoing.py): a plain token builds no object.
- A step's result is committed by the base class in commit.py.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import trio

from actorllm import clock
from actorllm.config import SpeculativeConfig
from actorllm.lifecycle.table import Ledger, State
from actorllm.lifecycle.trace import Tracer
from actorllm.scheduler.batch import Batch
from actorllm.scheduler.columns import PlanColumns
from actorllm.scheduler.commit import ResultCommit
from actorllm.scheduler.kv_pool import BlockPool
from actorllm.scheduler.outgoing import Outgoing
from actorllm.scheduler.policy import POLICIES
from actorllm.scheduler.sequence import Sequence
from actorllm.scheduler.speculation import Speculation
from actorllm.scheduler.totals import StepTotals
from actorllm.wire.mailbox import Inbox, Outbox, batches, send_soon
from actorllm.wire.messages import (
    AbortRequest,
    FlowControl,
    SchedulerInput,
    SchedulerStats,
    SequenceRequest,
    StepPlan,
    StepResult,
    StopMatched,
    TokenBatch,
)


class Scheduler(ResultCommit):
    """Continuous batching: chunked prefill, preemption by recompute, prefix caching, an
    optional priority order, pauses for slow readers, one or two steps in flight."""

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
        pool: BlockPool | None = None,
        speculative: SpeculativeConfig | None = None,
        quiet_s: float = 0.0,
    ) -> None:
        """``pool``: the KV block pool to own, of ``num_blocks`` x ``block_size`` (default:
        a fresh one); ``speculative``: draft proposals (scheduler/speculation.py);
        ``quiet_s``: how long after an arrival no step is planned ahead (actorllm.clock)."""
        if max_steps_in_flight not in (1, 2):
            raise ValueError(f"max_steps_in_flight must be 1 or 2, got {max_steps_in_flight}")
        self.inbox, self.worker, self.detokenizer = inbox, worker, detokenizer
        if pool is None:
            pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        elif (pool.num_blocks, pool.block_size) != (num_blocks, block_size):
            raise ValueError(f"a pool of {pool.num_blocks} x {pool.block_size} given for "
                             f"{num_blocks} x {block_size}")
        if scheduling_policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {scheduling_policy!r}")
        self.tracer = tracer
        self.ledger = Ledger("scheduler", tracer)
        self.batch = Batch(pool, self.ledger, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens,
                           priority=scheduling_policy == "priority",
                           speculation=speculative and Speculation(speculative))
        self.seqs: dict[str, Sequence] = {}
        self.fenced: list[Sequence] = []  # finished, waiting for the step in flight
        self.max_steps_in_flight = max_steps_in_flight
        self.in_flight: deque[StepPlan] = deque()  # sent, result not yet back; oldest first
        self.next_step_id = 0
        self.next_incarnation = 0
        self.outgoing, self.lp_live = Outgoing(), 0  # lp_live: live rids asking prompt logprobs
        self._wake = trio.Event()
        self.quiet_s, self.last_arrival = quiet_s, float("-inf")
        # Counters (exported through SchedulerStats); ahead_tokens_dropped: rows planned
        # ahead for a sequence that ended meanwhile.
        self.late_results_dropped = self.late_stops_dropped = 0
        self.ahead_tokens_dropped = 0
        self.totals = StepTotals()
        if tracer is not None:  # what `actorllm replay --redrive` needs to rebuild us
            tracer.record("config", actor="scheduler", num_blocks=num_blocks,
                          block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          max_steps_in_flight=max_steps_in_flight, quiet_s=quiet_s,
                          enable_prefix_caching=enable_prefix_caching,
                          scheduling_policy=scheduling_policy)

    async def run(self) -> None:
        """Receive and decide in one task, send in another (see the module docstring)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sender)
            # All that waits is handled before planning: a burst shares the next step.
            async for msgs in batches(self.inbox):
                for msg in msgs:
                    self.handle(msg)
                self._wake.set()

    async def _sender(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            # Plan first: the next step runs while the Detokenizer and Frontend work (the
            # checkpoint lets the Worker take the plan before they wake: Worker._feed).
            while len(self.in_flight) < self.max_steps_in_flight:
                if self.in_flight and clock.now() - self.last_arrival < self.quiet_s:
                    break  # requests are arriving: plan when the step in flight returns
                t0 = time.perf_counter()  # the step's plan phase (SchedulerStats.plan_s)
                plan = self.schedule()
                self.totals.plan_s += time.perf_counter() - t0
                if plan is None:
                    break
                await send_soon(self.worker, plan)
                await trio.lowlevel.checkpoint()
            await self.flush()

    async def flush(self) -> None:
        """Send what the decisions so far produced to the Detokenizer."""
        out = self.take_batch()
        if out is not None:
            await send_soon(self.detokenizer, out)

    def take_batch(self) -> TokenBatch | None:
        return self.outgoing.take(self.stats)  # decided since the last call, if anything

    # The batch's, for stats and tests (worker_drops: rids the next StepPlan drops).
    pool = property(lambda self: self.batch.pool)
    waiting = property(lambda self: self.batch.waiting)
    running = property(lambda self: self.batch.running)
    paused = property(lambda self: self.batch.flow.paused)
    worker_drops = property(lambda self: self.batch.worker_drops)
    num_preemptions = property(lambda self: self.batch.num_preemptions)

    def handle(self, msg: Any) -> None:
        """Apply one message to the Scheduler's state. Never blocks."""
        if isinstance(msg, StepResult):
            t0 = time.perf_counter()  # the step's commit phase (SchedulerStats.commit_s)
            self.on_result(msg)
            self.totals.commit_s += time.perf_counter() - t0
        elif isinstance(msg, SequenceRequest):
            self.on_request(msg)
        elif isinstance(msg, AbortRequest):
            self.finish_early(msg.rid, "abort")
        elif isinstance(msg, FlowControl):
            self.on_flow(msg)
        elif isinstance(msg, StopMatched):
            seq = self.seqs.get(msg.rid)
            # A stop found for an earlier request under this rid must not end this one.
            if seq is None or seq.incarnation != msg.incarnation or not self.finish_early(
                    msg.rid, "stop", msg.stop):
                self.late_stops_dropped += 1
        else:  # the mailbox's type check makes this unreachable
            raise TypeError(type(msg).__name__)
        self.outgoing.stats_changed = True

    def on_request(self, req: SequenceRequest) -> None:
        if req.rid in self.seqs:
            # The Frontend keeps rids unique while live; a duplicate here is a bug upstream.
            raise AssertionError(f"duplicate live rid {req.rid!r} reached the scheduler")
        self.ledger.fire(req.rid, "enqueue", prompt_tokens=len(req.prompt_token_ids))
        self.last_arrival = clock.now()
        seq = Sequence(req.rid, list(req.prompt_token_ids), req.params, req.max_tokens,
                       frozenset(req.eos_token_ids), req.arrival_time,
                       view=self.ledger.view(req.rid), incarnation=self.next_incarnation,
                       return_prompt_ids=req.return_prompt_ids)
        self.next_incarnation += 1
        self.seqs[seq.rid] = seq
        self.lp_live += req.params.prompt_logprobs is not None
        self.batch.add(seq)
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

    def on_flow(self, msg: FlowControl) -> None:
        """A reader fell behind (pause, applied at the next plan) or caught up (resume)."""
        if self.tracer is not None:
            self.tracer.record("input", actor="scheduler", msg=("resume", "pause")[msg.pause],
                               rid=msg.rid)
        self.batch.pace(msg, self.seqs.get(msg.rid))

    def schedule(self) -> StepPlan | None:
        """Plan the next step (scheduler/batch.py) and put it in flight. None if idle.

        With a step in flight this plans *ahead* (overlap scheduling): it runs what does
        not wait on that step's results and never preempts; where the plain path would
        preempt, it plans nothing (see the module docstring).
        """
        assert len(self.in_flight) < self.max_steps_in_flight
        ahead = bool(self.in_flight)
        paused = len(self.paused)
        planned = self.batch.plan(ahead)
        if len(self.paused) != paused:
            self.outgoing.stats_changed = True  # num_paused changed after handle() had flushed
        if planned is None:
            return None
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
        cols = PlanColumns(self.batch.lookup)
        cols.fill(planned)
        plan = cols.freeze(self.next_step_id, self.batch.take_worker_drops())
        self.next_step_id += 1
        self.in_flight.append(plan)
        if self.tracer is not None:
            self.tracer.record("plan", actor="scheduler", step=plan.step_id, seqs=[
                list(row) for row in zip(plan.rids, plan.num_tokens, plan.sample, strict=True)])
        return plan

    def _pass_fence(self) -> bool:
        """Invariant 3: finished sequences that no step in flight names any more give
        their blocks back (until then a step may still read them). Whether any did."""
        passed = [seq for seq in self.fenced if not seq.in_flight]
        self.fenced = [seq for seq in self.fenced if seq.in_flight]
        for seq in passed:
            self._free(seq)
        return bool(passed)

    def _finish(self, seq: Sequence, event: str, reason: str, stop_reason: Any = None,
                error: str | None = None) -> None:
        """The one terminal transition; blocks go back now or after the fence."""
        self.batch.remove(seq)
        self.ledger.fire(seq.rid, event, reason=reason)
        self.outgoing.final(seq, reason, stop_reason, error)
        if seq.in_flight:  # invariant 3: a step in flight still reads its blocks
            self.fenced.append(seq)
        else:
            self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.batch.release(seq)
        del self.seqs[seq.rid]
        self.lp_live -= seq.params.prompt_logprobs is not None
        self.ledger.fire(seq.rid, "free")
        self.ledger.drop(seq.rid)
        self.outgoing.freed.append(seq.rid)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_blocks_used=self.pool.num_used, kv_blocks_total=self.pool.num_blocks,
            num_preemptions=self.num_preemptions, num_paused=len(self.paused),
            late_results_dropped=self.late_results_dropped, replica=self.replica,
            **self.totals.fields(),
            prefix_cache_queries=self.pool.queries, prefix_cache_hits=self.pool.hits,
            **self.batch.speculation_fields())

    def drain_problems(self) -> list[str]:
        """What is still held (empty after a clean drain: invariant 4)."""
        return [why for held, why in (
            (self.seqs, f"scheduler holds sequences {sorted(self.seqs)}"),
            (self.pool.num_used, f"{self.pool.num_used} KV blocks still in use"),
            (self.in_flight, f"steps {[p.step_id for p in self.in_flight]} still in flight"),
            (len(self.ledger), f"scheduler ledger holds {sorted(self.ledger.views)}"),
        ) if held]
