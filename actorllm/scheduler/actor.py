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
"""

from __future__ import annotations

import logging
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
from actorllm.scheduler.kv_pool import BlockPool
from actorllm.scheduler.outgoing import Outgoing
from actorllm.scheduler.policy import POLICIES
from actorllm.scheduler.sequence import Sequence, take_prompt_pieces
from actorllm.scheduler.speculation import Speculation, count_error, drafts_of, row_tokens
from actorllm.scheduler.totals import StepTotals
from actorllm.wire.mailbox import Inbox, Outbox, batches, send_soon
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
)

log = logging.getLogger(__name__)


class Scheduler:
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
                       view=self.ledger.view(req.rid), incarnation=self.next_incarnation)
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
        cols = PlanColumns()
        cols.fill(planned)
        plan = cols.freeze(self.next_step_id, self.batch.take_worker_drops())
        self.next_step_id += 1
        self.in_flight.append(plan)
        if self.tracer is not None:
            self.tracer.record("plan", actor="scheduler", step=plan.step_id, seqs=[
                list(row) for row in zip(plan.rids, plan.num_tokens, plan.sample, strict=True)])
        return plan

    def on_result(self, result: StepResult) -> None:
        """Commit a step's result by walking its plan's columns."""
        # The Worker runs plans in order, so a result answers the oldest plan in flight.
        if not self.in_flight or result.step_id != self.in_flight[0].step_id:
            self.late_results_dropped += 1  # a duplicate or stale result: never an error
            log.debug("dropped result of step %d", result.step_id)
            return
        plan = self.in_flight.popleft()
        self.totals.add_result(result, len(plan.rids))
        error = result.error or count_error(plan, result)  # (a count: a Worker bug)
        if self.tracer is not None:
            self.tracer.record("result", actor="scheduler", step=result.step_id,
                               tokens=[[rid, *t] for rid, t in zip(
                                   plan.sampled_rids(), row_tokens(result), strict=False)],
                               error=error, forward_s=result.forward_s)
        if error is None and not self.fenced and self.tracer is None \
                and _plain_decode(plan, result, self.lp_live):
            self._commit_decode(plan, result.token_ids)
            return
        seqs = [self.seqs.get(rid) for rid in plan.rids]
        ok, running, computed = error is None, State.RUNNING, self.batch.computed
        for seq, n, sampled, drafts in zip(seqs, plan.num_tokens, plan.sample,
                                           drafts_of(plan), strict=True):
            if seq is None:
                continue
            seq.step_returned(sampled, drafts)
            if ok and seq.view.local is running:
                computed(seq, n - drafts)  # accepted drafts: in _commit
        if self._pass_fence():  # freed ones are gone: look the rids up again
            seqs = [self.seqs.get(rid) for rid in plan.rids]
        if error is not None:
            for seq in seqs:
                if seq is not None and seq.status is State.RUNNING:
                    self._finish(seq, "fail", "error", error=error)
            return
        self._commit(plan, seqs, result)

    def _commit_decode(self, plan: StepPlan, tokens: tuple[int, ...]) -> None:
        """:meth:`on_result` and :meth:`_commit` of a plain decode step (``_plain_decode``)
        in one pass over its rows: the same changes, each row's in the same order, but one
        loop and no call per row but the token's own. Why: at 256 rows the two passes
        were ~0.3 ms of the loop's turn between two steps (issue 28). Only with nothing
        fenced: then no row's sequence has finished (a finished one in flight is fenced),
        and there is no fence to pass before the rows."""
        seqs, running, out = self.seqs, State.RUNNING, self.outgoing
        computed = self.batch.computed
        bs = self.pool.block_size
        for rid, token, fed in zip(plan.rids, tokens, plan.token_ids, strict=True):
            seq = seqs.get(rid)
            if seq is not None:
                seq.in_flight -= 1
                seq.samples_in_flight -= 1
            if seq is None or seq.view.local is not running:  # (not while nothing is fenced:
                # kept as _commit's rule, should that change)
                if fed == FEED_LAST_SAMPLE:
                    self.ahead_tokens_dropped += 1  # planned ahead past its end
                else:
                    self.late_results_dropped += 1  # finished (abort, stop) while it ran
                continue
            if (seq.num_computed + 1) // bs > seq.num_registered:  # (1 step in bs)
                computed(seq, 1)
            else:
                seq.num_computed += 1
            reason, stop_reason = seq.finish_after(token)
            out.token(seq, token)
            if reason is not None:
                self._finish(seq, "finish", reason, stop_reason)

    def _pass_fence(self) -> bool:
        """Invariant 3: finished sequences that no step in flight names any more give
        their blocks back (until then a step may still read them). Whether any did."""
        passed = [seq for seq in self.fenced if not seq.in_flight]
        self.fenced = [seq for seq in self.fenced if seq.in_flight]
        for seq in passed:
            self._free(seq)
        return bool(passed)

    def _commit(self, plan: StepPlan, seqs: list[Sequence | None], result: StepResult) -> None:
        """A step's tokens and prompt logprobs for the sequences still running (the
        tokens are a column aligned with the plan's sampling rows); refused rows fail."""
        running = State.RUNNING  # (a view's local is None once its sequence is freed)
        pieces: dict[str, dict[str, Any]] = {}
        if self.lp_live or result.pooled:  # (pooled: an embedding's vector, kept for its finish)
            pieces, gaps = take_prompt_pieces(
                [q for q in seqs if q is not None and q.view.local is running],
                result.prompt_logprobs, result.pooled)
            for seq, gap in gaps:
                # A Worker bug: no list with holes for the client; the others live on.
                log.error("%s: %s", seq.rid, gap)
                self._finish(seq, "fail", "error", error=gap)
        logprobs = dict(zip(result.logprob_rows, result.logprobs, strict=True))
        sampling = [i for i, sampled in enumerate(plan.sample) if sampled]
        refused = dict(zip(result.refused_rows, result.refused, strict=True))
        out, rows = self.outgoing, result.token_ids  # an int per row, unless rows speculated
        rows = row_tokens(result) if result.num_sampled else rows  # (then a tuple per row)
        for j, (i, tokens) in enumerate(zip(sampling, rows, strict=True)):
            seq = seqs[i]
            if seq is None or seq.view.local is not running:
                if plan.token_ids[sum(plan.num_tokens[:i])] == FEED_LAST_SAMPLE:
                    self.ahead_tokens_dropped += 1  # planned ahead past its end
                else:
                    self.late_results_dropped += 1  # finished (abort, stop) while it ran
                continue
            if refused and j in refused:  # its grammar refused the draw (a masking bug)
                self._finish(seq, "fail", "error", error=refused[j])
                continue
            piece = pieces.pop(seq.rid, None) if pieces else None  # (rare: both)
            lp = logprobs.get(j) if logprobs else None
            if type(tokens) is int:  # the hot path: no object for the row
                reason, stop_reason = seq.finish_after(tokens)
                out.token(seq, tokens, lp, piece)
            else:
                drafted = plan.num_drafts[i] if plan.num_drafts else 0  # speculation
                n, reason, stop_reason = self.batch.take(seq, tokens, drafted)
                out.tokens(seq, tokens if n == len(tokens) else tokens[:n], lp, piece)
            if reason is not None:
                self._finish(seq, "finish", reason, stop_reason)
        if not pieces and all(plan.sample):
            return  # (a row that scores its prompt only never samples)
        for seq in seqs:
            if seq is None or seq.view.local is not running:
                continue
            piece = pieces.pop(seq.rid, None)
            if piece is not None:  # a prefill chunk that sampled nothing
                self.outgoing.piece(seq, piece)
            if seq.max_tokens == 0 and seq.num_computed == seq.num_tokens and not seq.in_flight:
                self._finish(seq, "finish", "length")  # the prompt is scored: nothing to sample

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


def _plain_decode(plan: StepPlan, result: StepResult, lp_live: int) -> bool:
    """Whether ``result`` answers a plain decode step: every row one token that samples
    (so no drafts), and nothing rare in the result (logprobs, refusals, prompt
    logprobs, pooled states) or owed by a live sequence (prompt logprobs)."""
    n = len(plan.rids)
    return (len(plan.token_ids) == n == len(result.token_ids) and not lp_live
            and not (result.num_sampled or result.logprob_rows or result.refused_rows
                     or result.prompt_logprobs or result.pooled))
