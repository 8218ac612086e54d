"""The Frontend actor: the request registry and the client's side of every request.

Owns ``rid -> RequestState``: the output collector, the parent/child map for ``n > 1``,
and what the client has been told. Nobody else writes it.

Ordering rules kept here (DESIGN.md §1):
- Register before dispatch: the state and its collector exist before the first message
  for the rid leaves, so no output can arrive for a rid we do not know.
- A rid is unique while live; it stays live until *both* the client has its final output
  and the Scheduler has freed its blocks (``forget``): a reused rid never meets a stale
  Sequence.
- One terminal output per request; anything after it is counted and dropped.
- Fan-out: ``n > 1`` becomes children ``{rid}-{i}``, ordinary requests to the rest.
- Flow control starts here (the Frontend fills the collectors, so it sees each reader's
  lag): its :class:`ReaderPacing` (frontend/readers.py) decides when a request is paused,
  resumed or cancelled; the ``FlowControl`` and ``AbortRequest`` messages go on one FIFO
  edge with everything else it sends.
"""

from __future__ import annotations

import logging
import time

import attrs
import trio

from actorllm.frontend.collector import OutputCollector
from actorllm.frontend.readers import UNLIMITED, FlowLimits, ReaderPacing
from actorllm.frontend.routing import Router, estimate_cost
from actorllm.frontend.state import RequestState, fan_out
from actorllm.lifecycle.table import Ledger, State
from actorllm.lifecycle.trace import Tracer
from actorllm.metrics import EngineMetrics
from actorllm.wire.mailbox import Inbox, Outbox, batches
from actorllm.wire.messages import (
    AbortRequest,
    FailureCode,
    FinishReason,
    FlowControl,
    FrontendInput,
    GenerateRequest,
    InvalidRequest,
    OutputBatch,
    RequestFailed,
    RequestFinished,
    SchedulerStats,
    TokenizerInput,
)
from actorllm.wire.outputs import RequestError

log = logging.getLogger(__name__)


class DuplicateRequestId(InvalidRequest):
    """A client-supplied rid collides with a live one."""


class Frontend:
    """The actor. ``submit``/``abort`` are called by API-layer tasks of the same process.

    It owns its :class:`ReaderPacing`, built from ``pacing`` (the class) with ``limits``.
    """

    def __init__(
        self,
        inbox: Inbox[FrontendInput],
        tokenizer: Outbox[TokenizerInput],
        *,
        metrics: EngineMetrics | None = None,
        tracer: Tracer | None = None,
        limits: FlowLimits = UNLIMITED,
        replicas: int = 1,
        pacing: type[ReaderPacing] = ReaderPacing,
    ) -> None:
        self.inbox, self.tokenizer = inbox, tokenizer
        self.registry: dict[str, RequestState] = {}
        self.ledger = Ledger("frontend", tracer)
        self.metrics = metrics or EngineMetrics()
        self.router = Router(replicas)
        self.stats = SchedulerStats()  # all replicas' together (router.stats: each one's)
        self.late_outputs_dropped = 0
        self.route_s = 0.0  # handling OutputBatches, summed: the step's route phase
        self._route_phase = self.metrics.phase["route"]
        # Parents whose children must be aborted, decided in handle() and sent by
        # _abort_sender(). States, not rids: by the time an entry is sent the parent may
        # have ended and a new request may be using its rid.
        self._abort_next: list[tuple[RequestState, str]] = []  # (state, reason)
        self._abort_wake = trio.Event()
        # Leaves whose FlowControl may be owed (the pacing decides, _abort_sender sends).
        self._flow_next: list[RequestState] = []
        self.pacing = pacing(limits, self.metrics, flow=self._queue_flow,
                             cancel=self._abort_for_lag)
        self.metrics.watch_flows(self.pacing)

    @property
    def pending_bytes(self) -> int:
        """Output waiting for its readers, over every streaming request (bytes)."""
        return self.pacing.pending_bytes

    # --- called by the API layer -------------------------------------------------------

    async def submit(self, req: GenerateRequest, *, final_only: bool = False
                     ) -> OutputCollector:
        """Register ``req`` (and its children), then dispatch. Returns its collector
        (``final_only``: one that wakes its reader only at the end, unpaced)."""
        n = req.params.n
        leaves = fan_out(req)
        children = [rid for rid, _, _ in leaves] if n > 1 else []
        self._check_unique([req.rid, *children])
        now = time.monotonic()
        collector = OutputCollector(req.rid, n, final_only=final_only)
        replica = self.router.pick(req)  # one for all the children: they share the prompt
        cost = estimate_cost(req)
        parent = None
        if n > 1:
            parent = req.rid
            self.ledger.fire(parent, "register", n=n)
            self.ledger.fire(parent, "fan_out", children=children)
            self.registry[parent] = RequestState(parent, collector, self.ledger.view(parent),
                                                 children=children, arrival=now,
                                                 replica=replica)
        # Every child is registered before the first one leaves: otherwise child 0 could
        # end before child 1 exists, and the parent would gather early (found by spin).
        for rid, _, index in leaves:
            self._register(rid, collector, parent=parent, index=index, arrival=now,
                           replica=replica, cost=cost)
        # Shielded: once registered, a request is always dispatched (else it would leak),
        # even if the caller is cancelled meanwhile; unless it was lost (the engine died).
        states = [self.registry.get(rid) for rid, _, _ in leaves]
        with trio.CancelScope(shield=True):
            for (rid, params, _), st in zip(leaves, states, strict=True):
                if st is None or self.registry.get(rid) is st:
                    await self._send_request(attrs.evolve(req, rid=rid, params=params,
                                                          arrival_time=now, replica=replica))
        self.metrics.on_arrival()
        return collector

    def _check_unique(self, rids: list[str]) -> None:
        """A rid is unique while live (invariant 2: one terminal output per request)."""
        taken = [r for r in rids if r in self.registry]
        if taken:
            raise DuplicateRequestId(f"request id {taken[0]!r} is already in use", "request_id")

    def _register(self, rid: str, collector: OutputCollector, *, parent: str | None,
                  index: int, arrival: float, replica: int, cost: int) -> None:
        """Make one leaf known: its ledger entry, its registry entry, its replica's load
        and (streaming) its place in the reader pacing."""
        self.ledger.fire(rid, "register")
        st = self.registry[rid] = RequestState(rid, collector, self.ledger.view(rid),
                                               parent=parent, index=index, arrival=arrival,
                                               replica=replica, cost=cost)
        self.router.add(replica, cost)
        if not collector.final_only:
            self.pacing.track(st)

    async def _dispatch(self, rid: str, msg: GenerateRequest) -> None:
        """Send one registered request to the Tokenizer."""
        self.ledger.fire(rid, "dispatch")
        await self.tokenizer.send(msg)

    async def _send_request(self, msg: GenerateRequest) -> None:
        """Dispatch one leaf, then what was decided about it while it waited to go."""
        await self._dispatch(msg.rid, msg)
        st = self.registry.get(msg.rid)
        if st is None:
            return
        st.dispatched = True
        if st.abort_sent:  # aborted while we were still sending: it goes right after
            await self.tokenizer.send(AbortRequest(st.rid, st.replica))
        elif self.pacing.paused(st.collector):  # a sibling's output paused the request
            self._queue_flow([st])

    async def abort(self, rid: str, reason: str = "user") -> None:
        """Stop ``rid`` (and its children). Idempotent; a no-op after it ended. ``reason``
        labels ``aborted_requests``: user, client_disconnect, stream_timeout, drain_timeout."""
        st = self.registry.get(rid)
        if st is not None:
            await self._abort(st, reason)

    async def _abort(self, st: RequestState, reason: str = "user") -> None:
        """Stop this incarnation of a request (and its children), if it is still live."""
        if self.registry.get(st.rid) is not st or st.responded:
            return
        with trio.CancelScope(shield=True):
            for cst in self._abort_targets(st):
                # Compared by identity: while we waited for room in the Tokenizer's
                # mailbox, this child may have ended and a new request taken its rid.
                if self.registry.get(cst.rid) is not cst or cst.responded or cst.abort_sent:
                    continue
                cst.abort_sent = True
                self.metrics.aborted_requests.labels(reason=reason).inc()
                # Not yet dispatched: submit() sends the abort right after the request,
                # so it can never overtake it on the FIFO edge.
                if cst.dispatched:
                    await self.tokenizer.send(AbortRequest(cst.rid, cst.replica))

    def _abort_targets(self, st: RequestState) -> list[RequestState]:
        """The leaves an abort of ``st`` must reach: its live children, or itself."""
        if st.children:
            return [c for c in map(self.registry.get, st.children) if c is not None]
        return [st]

    # --- the actor loop ----------------------------------------------------------------

    async def run(self) -> None:
        """Receive in one task, send aborts from another.

        ``handle`` never blocks, so the inbox always drains; the aborts it decides on
        (siblings of a failed child) go out from a separate task, so a full Tokenizer
        mailbox can never stall the loop that empties ours (the Tokenizer sends us
        ``RequestFailed``: waiting on each other would deadlock).
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._abort_sender)
            nursery.start_soon(self.pacing.watch_stalls)
            # Every OutputBatch waiting is folded in before a reader runs: one that has
            # fallen behind wakes (and writes) once for several steps (wire/mailbox.py).
            async for msgs in batches(self.inbox):
                for msg in msgs:
                    self.handle(msg)
                if self._abort_next or self._flow_next:
                    self._abort_wake.set()

    async def _abort_sender(self) -> None:
        """Send the aborts and FlowControl messages decided elsewhere, in order."""
        while True:
            await self._abort_wake.wait()
            self._abort_wake = trio.Event()
            while self._abort_next or self._flow_next:
                if self._abort_next:
                    await self._abort(*self._abort_next.pop(0))
                else:
                    await self._send_flow(self._flow_next.pop(0))

    def _queue_flow(self, leaves: list[RequestState]) -> None:
        self._flow_next.extend(leaves)
        self._abort_wake.set()

    def _abort_for_lag(self, leaves: list[RequestState]) -> None:
        """The pacing cancelled these leaves: their reader stalled past the timeout."""
        self._abort_next.extend((st, "stream_timeout") for st in leaves)
        self._abort_wake.set()

    async def _send_flow(self, st: RequestState) -> None:
        """Tell the Scheduler what the pacing says of ``st`` now, if that is news."""
        want = self.pacing.paused(st.collector)
        if (self.registry.get(st.rid) is not st or st.responded or st.abort_sent
                or not st.dispatched or st.paused_sent == want):
            return
        st.paused_sent = want
        await self.tokenizer.send(FlowControl(st.rid, want, st.replica))

    def handle(self, msg: FrontendInput) -> None:
        """Apply one message from the Tokenizer or Detokenizer. Never blocks."""
        if isinstance(msg, RequestFailed):
            self._on_failed(msg)
            return
        assert isinstance(msg, OutputBatch)
        t0 = time.perf_counter()
        if msg.rids and (tokens := self._on_deltas(msg)):
            self.metrics.generation_tokens.inc(tokens)  # once per step, not per row
        for fin in msg.finished:
            self._on_finished(fin)
        for rid in msg.freed:
            self._on_freed(rid)
        if msg.stats is not None:
            self.router.on_stats(msg.stats)
            self.stats = self.router.total()
        spent = time.perf_counter() - t0
        self.route_s += spent
        self._route_phase.inc(spent)

    def _live(self, rid: str) -> RequestState | None:
        st = self.registry.get(rid)
        if st is None or st.responded:
            self.late_outputs_dropped += 1
            self.metrics.late_outputs_dropped.inc()
            return None
        return st

    def _on_deltas(self, msg: OutputBatch) -> int:
        """Fold a step's deltas into their collectors in one pass over the columns (one clock
        read; a collector given several rows wakes once); returns the tokens counted."""
        now = time.monotonic()
        extras = dict(zip(msg.rare_rows, msg.rare, strict=True))
        ids, pacing = msg.token_ids, self.pacing
        done = [0] * self.router.replicas  # load that went, by replica: one sub a step
        tokens = at = 0
        for i, (rid, text, n) in enumerate(zip(msg.rids, msg.texts, msg.num_tokens,
                                               strict=True)):
            row, at = ids[at:at + n], at + n
            st = self._live(rid)
            if st is None:
                continue
            tokens += n
            if n:
                done[st.replica] += st.count_tokens(n, now, self.metrics)
            col = st.collector
            if col.failed:
                continue  # cancelled (stream timeout): the reader gets the error, nothing after
            before, waited = col.pending_bytes, col.oldest is not None
            extra = extras.get(i) if extras else None  # (logprobs, prompt logprobs)
            rare = (extra.logprobs, extra.prompt_logprobs, extra.prompt_token_ids) if extra else ()
            col.put_delta(st.index, text, row, *rare)
            if not col.final_only:  # (else no backlog to pace: the reader takes all at the end)
                pacing.on_output(col, col.pending_bytes - before, n, waited)
        for replica, gone in enumerate(done):
            self.router.sub(replica, gone)
        return tokens

    def _on_finished(self, fin: RequestFinished) -> None:
        st = self._live(fin.rid)
        if st is None:
            return
        self.ledger.fire(fin.rid, "respond", reason=fin.finish_reason)
        st.collector.note_finish(fin.num_prompt_tokens, fin.cached_tokens, fin.pooled)
        self.metrics.on_finished(fin.finish_reason, fin.num_prompt_tokens,
                                 time.monotonic() - st.arrival)
        if fin.queue_s is not None:
            self.metrics.queue_time.observe(fin.queue_s)
        if fin.finish_reason == FinishReason.ERROR:
            st.collector.put_error(RequestError(fin.error or "engine error",
                                                FailureCode.INTERNAL))
            if st.parent is not None:  # the client gets the error: its siblings are moot
                self._abort_next.append((self.registry[st.parent], "sibling_failed"))
        elif not st.collector.failed:  # (after a stream timeout the reader gets the error)
            st.collector.put_finish(st.index, fin.finish_reason, fin.stop_reason)
            self.pacing.on_finish(st.collector)
        self.pacing.untrack_if_idle(st.collector)
        self._maybe_forget(st)

    def _on_failed(self, msg: RequestFailed) -> None:
        st = self._live(msg.rid)
        if st is None:
            return
        st.view.witness("reject")  # rejected before the Scheduler: nothing to free
        self.ledger.fire(msg.rid, "respond", reason="error")
        self.metrics.on_finished("error", 0, time.monotonic() - st.arrival)
        st.collector.put_error(RequestError(msg.message, msg.code, msg.param))
        if st.parent is not None:
            self._abort_next.append((self.registry[st.parent], "sibling_failed"))
        self.pacing.untrack_if_idle(st.collector)
        self._maybe_forget(st)

    def _on_freed(self, rid: str) -> None:
        st = self.registry.get(rid)
        if st is None:
            self.late_outputs_dropped += 1
            return
        st.view.witness("free")
        self._maybe_forget(st)

    def _maybe_forget(self, st: RequestState) -> None:
        """Remove a request both of whose owners are done with it (RELEASED)."""
        if not st.view.within(State.RELEASED):
            return
        self.ledger.fire(st.rid, "forget")
        self.ledger.drop(st.rid)
        del self.registry[st.rid]
        self.router.sub(st.replica, st.cost)
        st.cost = 0
        if st.parent is not None:
            parent = self.registry[st.parent]
            if self._gatherable(parent):
                self.ledger.fire(parent.rid, "gather")
                self.ledger.drop(parent.rid)
                del self.registry[parent.rid]

    def _gatherable(self, parent: RequestState) -> bool:
        """Invariant 6: a parent ends iff every child has been released."""
        return all(c not in self.registry for c in parent.children)

    def lose_all(self, message: str, replica: int | None = None) -> int:
        """The engine process died: fail every live request with ``message``. With
        ``replica``, only that data-parallel replica died: fail only the requests routed
        to it, and route nothing more there."""
        if replica is not None:
            self.router.kill(replica)
            self.stats = self.router.total()
        lost = 0
        for rid, st in list(self.registry.items()):
            if st.children or rid not in self.registry or (
                    replica is not None and st.replica != replica):
                continue
            self.ledger.fire(rid, "lose")  # (from any state a live leaf is in; keeps responded)
            if not st.responded:
                self.ledger.fire(rid, "respond", reason="error")
                st.collector.put_error(RequestError(message, FailureCode.ENGINE_DEAD))
                self.metrics.on_finished("error", 0, time.monotonic() - st.arrival)
                if not st.abort_sent:  # (an abort already counted it, under its reason)
                    self.metrics.aborted_requests.labels(reason="engine_dead").inc()
                self.pacing.untrack_if_idle(st.collector)
            self._maybe_forget(st)
            lost += 1
        return lost

    def drain_problems(self) -> list[str]:
        return ([f"frontend registry holds {sorted(self.registry)}"] if self.registry else []) \
            + ([f"frontend ledger holds {sorted(self.ledger.views)}"] if len(self.ledger) else [])
