"""The Scheduler actor: owns every Sequence, the waiting and running queues, and the
KV block pool, and makes every finish decision.

It touches nothing else. It hears from the Tokenizer (``SequenceRequest``, and
``AbortRequest`` forwarded on the same edge), the Worker (``StepResult``) and the
Detokenizer (``StopMatched``); it speaks ``StepPlan`` to the Worker and
``TokenBatch`` to the Detokenizer.

Theory of operation:
- One step is in flight at a time. Planning happens only when none is, so a plan
  never races a result.
- Handling a message is synchronous (``handle``); a separate task does the sending.
  So the inbox always drains, even while the Detokenizer is slow: the cycle
  Scheduler -> Detokenizer -> Scheduler (``StopMatched``) cannot deadlock.
- The step fence: a sequence that finishes while a step that uses it is in flight
  (abort, stop string) keeps its blocks until that step's result is back.
- Flow control: ``FlowControl(pause)`` (the client's reader is behind) takes a sequence
  out of the batch when the next step is planned; it keeps its blocks (PAUSED) until
  another sequence needs them, then it is preempted in place (recompute on resume).
  ``FlowControl(resume)`` puts it first in the waiting queue (PREEMPTED).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import trio

from actorllm.kv import BlockPool
from actorllm.lifecycle import Ledger, State
from actorllm.mailbox import Inbox, Outbox
from actorllm.messages import (
    AbortRequest,
    FlowControl,
    PromptLogprobs,
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
from actorllm.pacing import Pacing
from actorllm.sequence import PromptLogprobsGap, Sequence
from actorllm.trace import Tracer

log = logging.getLogger(__name__)


class Scheduler(Pacing):
    """Continuous batching with chunked prefill and preemption by recompute."""

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
        tracer: Tracer | None = None,
    ) -> None:
        self.inbox, self.worker, self.detokenizer = inbox, worker, detokenizer
        self.pool = BlockPool(num_blocks, block_size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.tracer = tracer
        self.ledger = Ledger("scheduler", tracer)
        self.seqs: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.fenced: list[Sequence] = []  # finished, waiting for the step in flight
        # PAUSED (in the order they paused: the longest-paused gives its blocks up first,
        # being the least likely to be read soon), and pauses asked for, not yet applied.
        self.paused: dict[str, Sequence] = {}
        self.pause_wanted: set[str] = set()
        self.in_flight: StepPlan | None = None
        self.next_step_id = 0
        self.next_incarnation = 0
        self.worker_drops: list[str] = []  # rids whose Worker state may go (StepPlan.drop)
        self._outputs: list[TokenOut] = []
        self._freed: list[str] = []
        self._stats_dirty = False
        self._wake = trio.Event()
        # Counters (exported through SchedulerStats).
        self.num_preemptions = 0
        self.late_results_dropped = 0
        self.late_stops_dropped = 0
        self.steps = 0
        self.forward_s = 0.0
        self.sample_s = 0.0
        if tracer is not None:  # what `actorllm replay --redrive` needs to rebuild us
            tracer.record("config", actor="scheduler", num_blocks=num_blocks,
                          block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)

    # --- the actor --------------------------------------------------------------

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
            await self.flush()
            if self.in_flight is None:
                plan = self.schedule()
                if plan is not None:
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
            self.on_flow(msg)  # actorllm/pacing.py
        elif isinstance(msg, StopMatched):
            seq = self.seqs.get(msg.rid)
            # A stop found for an earlier request under this rid must not end this one.
            if seq is None or seq.incarnation != msg.incarnation or not self.finish_early(
                    msg.rid, "stop", msg.stop):
                self.late_stops_dropped += 1
        else:  # the mailbox's type check makes this unreachable
            raise TypeError(type(msg).__name__)
        self._stats_dirty = True

    # --- arrivals and early finishes -----------------------------------------------

    def on_request(self, req: SequenceRequest) -> None:
        if req.rid in self.seqs:
            # The Frontend keeps rids unique while live; a duplicate here is a bug upstream.
            raise AssertionError(f"duplicate live rid {req.rid!r} reached the scheduler")
        self.ledger.fire(req.rid, "enqueue", prompt_tokens=len(req.prompt_token_ids))
        seq = Sequence(
            rid=req.rid,
            prompt_ids=list(req.prompt_token_ids),
            params=req.params,
            max_tokens=req.max_tokens,
            eos_ids=frozenset(req.eos_token_ids),
            view=self.ledger.view(req.rid),
            arrival_time=req.arrival_time,
            incarnation=self.next_incarnation,
        )
        self.next_incarnation += 1
        self.seqs[seq.rid] = seq
        self.waiting.append(seq)
        if self.tracer is not None:
            self.tracer.record("input", actor="scheduler", msg="SequenceRequest", rid=req.rid,
                               prompt_tokens=len(req.prompt_token_ids), max_tokens=req.max_tokens,
                               params=req.params, eos_token_ids=req.eos_token_ids)

    def finish_early(self, rid: str, reason: str, stop: str | None = None) -> bool:
        """Abort, or a stop string: stop future work now. False if nothing was live."""
        seq = self.seqs.get(rid)
        if self.tracer is not None:
            self.tracer.record("input", actor="scheduler", msg=reason, rid=rid)
        if seq is None or seq.status is State.FINISHED:
            return False  # idempotent: already finished, freed, or never seen
        self._finish(seq, "abort" if reason == "abort" else "finish", reason, stop)
        return True

    # --- planning ------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan the next step: running sequences first, then admissions. None if idle."""
        assert self.in_flight is None
        if self.pause_wanted:
            self._apply_pauses()
        budget = self.max_num_batched_tokens
        planned: list[tuple[Sequence, int]] = []
        queue = list(self.running)
        preempted = False
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self._reserve(seq, n):
                # Take blocks from the newest running sequence not yet in this step.
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                planned.append((seq, n))
                budget -= n
        # No admissions in a step that had to preempt: the victim would be let straight
        # back in with a chunk and preempted again next step, recomputing for nothing.
        # (Unless nothing runs any more: then the front of the queue may start over.)
        admit = not preempted or not self.running
        # Preempted sequences sit at the front of `waiting`, so they come back first.
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed, budget)  # resumed: KV may be kept
            if not self._reserve(seq, n):
                break
            self.waiting.popleft()
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
            self.running.append(seq)
            self.ledger.fire(seq.rid, "schedule")
            planned.append((seq, n))
            budget -= n
        if not planned:
            if self.waiting and not self.running:
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
        self.in_flight = plan
        for seq, _ in planned:
            seq.in_flight = True
        if self.tracer is not None:
            self.tracer.record("plan", actor="scheduler", step=plan.step_id,
                               seqs=[[s.rid, len(s.token_ids), s.sample] for s in plan.seqs])
        return plan

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Make sure ``seq`` has blocks for ``n`` more computed tokens."""
        need = self.pool.blocks_for(seq.num_computed + n) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            self._evict_paused(need, seq)  # KV of what does not run goes first
        if not self.pool.can_allocate(need):
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: give back the blocks now (no step is in flight)."""
        assert not seq.in_flight
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        self._reset_for_recompute(seq)
        if seq.worker_knows:
            seq.worker_knows = False
            self.worker_drops.append(seq.rid)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.ledger.fire(seq.rid, "preempt")

    # --- results ---------------------------------------------------------------------

    def on_result(self, result: StepResult) -> None:
        plan = self.in_flight
        if plan is None or result.step_id != plan.step_id:
            self.late_results_dropped += 1  # a duplicate or stale result: never an error
            log.debug("dropped result of step %d", result.step_id)
            return
        self.in_flight = None
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
            seq.in_flight = False
            if seq.status is State.RUNNING and result.error is None:
                seq.num_computed += len(s.token_ids)
        # The fence has passed: sequences that finished meanwhile give their blocks back.
        for seq in self.fenced:
            self._free(seq)
        self.fenced = []
        if result.error is not None:
            for s in plan.seqs:
                seq = self.seqs.get(s.rid)
                if seq is not None and seq.status is State.RUNNING:
                    self._finish(seq, "fail", "error", error=result.error)
            return
        pieces = self._prompt_pieces(plan, result.prompt_logprobs)
        for tok in result.tokens:
            seq = self._running(tok.rid)
            if seq is None:
                self.late_results_dropped += 1  # finished (abort, stop) while the step ran
                continue
            self._append(seq, tok.token_id, tok.logprob, pieces.pop(seq.rid, None))
        for s in plan.seqs:
            seq = self._running(s.rid)
            if seq is None:
                continue
            piece = pieces.pop(seq.rid, None)
            if piece is not None:  # a prefill chunk that sampled nothing
                self._outputs.append(TokenOut(seq.rid, spec=seq.detok_spec_once(), **piece))
            if seq.max_tokens == 0 and seq.num_computed == seq.num_tokens:
                self._finish(seq, "finish", "length")  # the prompt is scored: nothing to sample

    def _prompt_pieces(self, plan: StepPlan, results: tuple[PromptLogprobs, ...]
                       ) -> dict[str, dict[str, Any]]:
        """The prompt logprobs this step reported, per running rid, as TokenOut fields."""
        by_rid = {r.rid: r for r in results}
        pieces: dict[str, dict[str, Any]] = {}
        for s in plan.seqs:
            seq = self._running(s.rid)
            if seq is None or not seq.owes_prompt_logprobs:
                continue
            try:
                piece = seq.take_prompt_logprobs(by_rid.get(s.rid))
            except PromptLogprobsGap as gap:
                # A Worker bug. The client must not get a list with holes, and the other
                # requests need not die with this one.
                log.error("%s: %s", s.rid, gap)
                self._finish(seq, "fail", "error", error=str(gap))
                continue
            if piece is not None:
                pieces[s.rid] = piece
        return pieces

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

    def _reset_for_recompute(self, seq: Sequence) -> None:
        """Preemption: nothing of ``seq`` stays cached; what was reported stays reported."""
        seq.reset_for_recompute()

    def _fenced(self, seq: Sequence) -> bool:
        """Invariant 3: blocks a step in flight reads go back only after its result."""
        return seq.in_flight

    def _free(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        del self.seqs[seq.rid]
        self.pause_wanted.discard(seq.rid)
        if seq.worker_knows:
            self.worker_drops.append(seq.rid)
        self.ledger.fire(seq.rid, "free")
        self.ledger.drop(seq.rid)
        self._freed.append(seq.rid)

    # --- introspection ------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_used=self.pool.num_used,
            kv_blocks_total=self.pool.num_blocks,
            num_preemptions=self.num_preemptions,
            late_results_dropped=self.late_results_dropped,
            num_paused=len(self.paused),
            steps=self.steps,
            forward_s=self.forward_s,
            sample_s=self.sample_s,
        )

    def drain_problems(self) -> list[str]:
        """What is still held (empty after a clean drain: invariant 4)."""
        problems = []
        if self.seqs:
            problems.append(f"scheduler holds sequences {sorted(self.seqs)}")
        if self.pool.num_used:
            problems.append(f"{self.pool.num_used} KV blocks still in use")
        if self.in_flight is not None:
            problems.append(f"step {self.in_flight.step_id} still in flight")
        if len(self.ledger):
            problems.append(f"scheduler ledger holds {sorted(self.ledger.views)}")
        return problems
