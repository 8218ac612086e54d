"""One simulated engine: the real actors wired through controlled mailboxes, and the
steps a test may take (see tests/sim/harness.py for the theory of operation)."""


from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing
from steps import Tables

from actorllm.config import ModelInfo, SpeculativeConfig
from actorllm.detokenizer.actor import Detokenizer
from actorllm.frontend.actor import DuplicateRequestId, Frontend
from actorllm.frontend.readers import UNLIMITED
from actorllm.lifecycle.table import IllegalTransition
from actorllm.metrics import EngineMetrics
from actorllm.scheduler.actor import Scheduler
from actorllm.tokenizer.actor import INLINE_CHARS, PromptEncoder, Tokenizer
from actorllm.wire.mailbox import MailboxClosed
from actorllm.wire.messages import (
    DetokenizerInput,
    FrontendInput,
    GenerateRequest,
    SamplingParams,
    SchedulerInput,
    SequenceRequest,
    StepPlan,
    TokenizerInput,
    WorkerInput,
)
from actorllm.wire.outputs import RequestError

from .bugs import actor_class
from .checks import Checks
from .common import EDGES, STOP_STRINGS, InvariantViolation, SimConfig, TextModel
from .controlled_transport import ControlledMailbox
from .guest import GuestLoop
from .recorder import Client, Incarnation, Recorder
from .scripted_draft import DraftingWorker
from .scripted_worker import ScriptedWorker
from .watch import Watches

ENGINE_SIDE = ("tokenizer", "scheduler", "worker", "detokenizer")  # what engine_dies kills
DEATH = "the engine died (simulated)"
# Up to 3 drafts, from 2-grams or 1-grams (the scripted vocabulary is small: they recur).
SPECULATIVE = SpeculativeConfig("ngram", 3, 2, 1)
# A draft model's: 3 placeholders a row, filled by the Worker (no directory is read here).
DRAFT_MODEL = SpeculativeConfig("draft_model", 3, model="sim")


class ThreadHop(Tokenizer):
    """The Tokenizer with a thread hop the test controls: a big input waits in ``jobs``
    until :meth:`World.finish_thread` lets it return (a real thread would return whenever
    the OS says, which no test can replay)."""

    jobs: deque[trio.Event]
    hops = 0

    async def off_loop(self, msg: GenerateRequest) -> SequenceRequest:
        done = trio.Event()
        self.jobs.append(done)
        self.hops += 1
        await done.wait()
        return self.encoder.encode(msg)


class World(Watches, Checks):
    """One simulated engine. Each public method is one step the test may take."""

    def __init__(self, hf_tokenizer: Any, text: TextModel, config: SimConfig | None = None,
                 metrics: EngineMetrics | None = None) -> None:
        self.config = cfg = config or SimConfig()
        self.text = text
        self.hf_tokenizer = hf_tokenizer  # the Tokenizer's, for the prompt logprobs check
        self.recompute_skipped_reported = False
        self.shared_seen = False  # a block had two holders at once (coverage)
        self.violations: list[InvariantViolation] = []
        self.rec = Recorder(self.report)
        self.clients: list[Client] = []
        self.live_client: dict[str, Client] = {}
        self.outstanding: dict[int, StepPlan] = {}  # steps sent, result not yet received
        self.table_mirror = Tables()  # the plans' block-table diffs, applied in send order
        self.plan_tables: dict[int, dict[str, tuple[int, ...]]] = {}  # step -> rid -> table
        # id(message) -> its tag, from when its actor takes it until it handles it: an
        # actor takes every message waiting before it handles the first.
        self._sched_tags: dict[int, Any] = {}
        self._tok_tags: dict[int, Any] = {}  # (aborts and pauses: forwarded as they came)
        # (the Frontend's leaf, its incarnation) of every request a stream timeout cancelled
        self._timeout_leaves: list[tuple[Any, Incarnation]] = []
        self._running = 0  # harness tasks (submit, abort) not yet finished
        self._closing = False
        self._idle = False
        self.dead = False  # engine_dies ran: only the Frontend is left
        self.death_mark: int | None = None  # Recorder.count when the engine died
        self._scopes: dict[str, trio.CancelScope] = {}
        self.urgent_preemptions = 0  # priority: a running sequence preempted for an arrival
        self.ended_mid_speculation = 0  # an abort or stop reached a row with drafts in flight

        def box(name: str, kind: Any, capacity: int = cfg.capacity) -> ControlledMailbox:
            b = ControlledMailbox(name, kind, capacity, roundtrip=cfg.roundtrip)
            b.on_send = self._on_send
            b.on_recv = self._on_recv
            return b

        self.boxes = {
            "tokenizer": box("tokenizer", TokenizerInput),
            "scheduler": box("scheduler", SchedulerInput),
            "worker": box("worker", WorkerInput, cfg.worker_capacity),
            "detokenizer": box("detokenizer", DetokenizerInput),
            "frontend": box("frontend", FrontendInput),
        }
        b = self.boxes
        def cls(actor: str, base: type[Any]) -> type[Any]:
            return actor_class(actor, base, cfg.bugs)

        self.frontend = cls("frontend", Frontend)(b["frontend"], b["tokenizer"].edge("frontend"),
                                 metrics=metrics, tracer=self.rec,
                                 limits=cfg.flow or UNLIMITED)  # type: ignore[arg-type]
        info = ModelInfo(path="sim", vocab_size=len(hf_tokenizer),
                         max_model_len=cfg.max_model_len, eos_token_ids=(text.eos_id,),
                         generation_defaults={})
        self.tokenizer = cls("tokenizer", ThreadHop)(
            PromptEncoder(hf_tokenizer, info), b["tokenizer"], b["scheduler"].edge("tokenizer"),
            b["frontend"].edge("tokenizer"), tracer=self.rec,
            inline_chars=cfg.inline_chars or INLINE_CHARS)  # type: ignore[arg-type]
        self.tokenizer.jobs = deque()
        self.scheduler = cls("scheduler", Scheduler)(b["scheduler"], b["worker"].edge("scheduler"),
                                   b["detokenizer"].edge("scheduler"),
                                   num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                                   max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   max_steps_in_flight=cfg.max_steps_in_flight,
                                   scheduling_policy=cfg.scheduling_policy,
                                   speculative=(DRAFT_MODEL if cfg.draft_model else
                                                SPECULATIVE) if cfg.speculative else None,
                                   tracer=self.rec)  # type: ignore[arg-type]
        if self.scheduler.batch.speculation is not None:
            # Rows start at an estimate (0.25; 0.35 with a draft model, whose drafts cost
            # more) at which they propose, one miss backs them off (a planned-ahead row
            # beside speculating ones), and a hit keeps them going.
            self.scheduler.batch.speculation.prior = (0.7 if cfg.draft_model else 0.5, 2.0)
        worker = DraftingWorker if cfg.draft_model else ScriptedWorker
        self.worker = cls("worker", worker)(b["worker"], b["scheduler"].edge("worker"),
                                            text.vocab, text.eos_id, cfg.block_size)
        self.detokenizer = cls("detokenizer", Detokenizer)(text.decode, b["detokenizer"],
                                       b["frontend"].edge("detokenizer"),
                                       b["scheduler"].edge("detokenizer"))
        self.actors: dict[str, Any] = {
            "frontend": self.frontend, "tokenizer": self.tokenizer,
            "scheduler": self.scheduler, "worker": self.worker,
            "detokenizer": self.detokenizer,
        }
        self._edges = {e: b[e.split("->")[1]] for e in EDGES}
        self._watch_scheduler()
        self._watch_frontend_aborts()
        self.loop = GuestLoop(self._main)
        self.loop.run_until(lambda: self._idle)

    # --- plumbing ---------------------------------------------------------------------------

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            # Mock time passes only when the test ticks (a stream timeout is the test's to
            # choose); the stepper keeps trio from sleeping on I/O while everything waits.
            self.loop.clock.autojump_threshold = math.inf
            nursery.start_soon(_stepper, name="stepper")
            for name, actor in self.actors.items():
                nursery.start_soon(self._run_actor, name, actor, name=f"actor:{name}")
            await trio.testing.wait_all_tasks_blocked()
            self._idle = True
            await trio.sleep_forever()

    async def _run_actor(self, name: str, actor: Any) -> None:
        with trio.CancelScope() as scope:  # engine_dies cancels the engine's actors
            self._scopes[name] = scope
            await actor.run()

    def call(self, action: Callable[[], object]) -> None:
        """Run ``action()`` inside trio, let everything settle, let clients read."""
        self._idle = False

        async def command() -> None:
            action()
            await trio.testing.wait_all_tasks_blocked()
            self._link_clients()
            for client in self.clients:
                if client.readable():
                    await self._read(client)
            # A read may wake the Frontend's sender (FlowControl(resume)): let it send
            # before the step ends, so quiet() and the checks see the message.
            await trio.testing.wait_all_tasks_blocked()
            self._idle = True

        self._token.run_sync_soon(self._nursery.start_soon, command)
        try:
            self.loop.run_until(lambda: self._idle)
        except Exception as crash:
            if self.violations:  # what went wrong first, not the crash it led to
                raise self.violations[0] from crash
            raise

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        self._running += 1

        async def task() -> None:
            try:
                await fn(*args)
            except MailboxClosed:
                if not self._closing:
                    raise
            finally:
                self._running -= 1

        self._nursery.start_soon(task)

    def close(self, reraise: bool = True) -> None:
        """Stop every task and end the trio run; ``reraise``: report an actor's crash.

        The Frontend's sends are shielded (a registered request is always dispatched), so
        cancelling is not enough: closing the mailboxes fails the sends that still wait.
        """

        def stop() -> None:
            self._closing = True
            self._nursery.cancel_scope.cancel()  # first: the unshielded waiters get Cancelled
            for box in self.boxes.values():
                box.close()

        if self.loop.result is None:
            self._token.run_sync_soon(stop)
        try:
            self.loop.finish()
        except BaseException:
            if reraise:
                raise

    def report(self, invariant: str, message: str) -> None:
        self.violations.append(InvariantViolation(invariant, message))

    # --- what the test does -----------------------------------------------------------------

    def submit(self, rid: str, params: SamplingParams, prompt: str, stream: bool) -> Client:
        """An API caller submits a request (the call may wait on backpressure)."""
        client = Client(rid, params, stream, self.rec.count)
        client.eager = self.config.flow is not None
        client.paused = self.config.readers_start_paused  # (paused_at: now, in mock time)
        client.paused_at = self.loop.clock.current_time()
        client.prompt_ids = list(self.hf_tokenizer(prompt).input_ids)
        self.clients.append(client)
        if self.dead:  # AsyncEngine.submit: a dead engine refuses at the door
            client.outcome = "refused"
            client.error = RequestError(DEATH, "engine_dead")
            client.final = client.submit_returned = True
            return client
        req = GenerateRequest(rid, params, prompt=prompt)
        self.call(lambda: self._spawn(self._submit, client, req))
        return client

    async def _submit(self, client: Client, req: GenerateRequest) -> None:
        rids = [req.rid] + [f"{req.rid}-{i}" for i in range(req.params.n if req.params.n > 1
                                                            else 0)]
        client.expect_duplicate = any(self.rec.live(r) for r in rids)
        if not client.expect_duplicate:
            self.live_client[req.rid] = client
        try:
            client.collector = await self.frontend.submit(req)
        except DuplicateRequestId:
            client.outcome = "duplicate"
        except IllegalTransition as exc:  # the ledger refusing what the Frontend let through
            client.outcome = f"raised {exc!r}"
        else:
            client.outcome = "accepted"
        if self.dead:  # AsyncEngine.submit: it died while we dispatched
            self.frontend.lose_all(DEATH)
        client.submit_returned = True
        if client.disconnected and client.outcome == "accepted":
            # Gone while its submit was still waiting: the server's response still ends
            # with its clean-up (AsyncEngine.generate's), which discards what is unread and
            # aborts what has not finished (with flow control on, a request nobody reads is
            # paused, so it would otherwise wait for a timeout; without it, its output
            # would wait in the pacing for a reader that never comes).
            client.collector.discard()
            if not client.collector.finished:
                self._spawn(self._abort, req.rid)
        if client.expect_duplicate and client.outcome != "duplicate":
            self.report("2", f"{req.rid!r} was live, yet submit {client.outcome}: a live rid "
                        "must be refused with DuplicateRequestId")
        elif not client.expect_duplicate and client.outcome != "accepted":
            self.report("4", f"{req.rid!r} was released, yet submit {client.outcome}")

    def abort(self, rid: str) -> None:
        """An API caller aborts ``rid`` (idempotent; a no-op after it ended)."""
        self.call(lambda: self._spawn(self._abort, rid))

    async def _abort(self, rid: str) -> None:
        client = self.live_client.get(rid)
        mark: list[int | None] = [self.rec.count, None]
        if client is not None:
            client.abort_marks.append(mark)
        await self.frontend.abort(rid)
        mark[1] = self.rec.count
        if client is not None:
            self._check_abort_reached(client, mark, drained=False)

    def disconnect(self, rid: str) -> None:
        """The client goes away: it stops reading and, like ``AsyncEngine.generate``, aborts
        the request if its final output has not arrived."""
        client = self.live_client.get(rid)
        if client is None or client.disconnected:
            return
        client.disconnected = True
        if client.submit_returned and client.collector is not None:
            self.call(client.collector.discard)  # unread output no longer counts
            if not client.collector.finished:
                self.abort(rid)

    def set_paused(self, rid: str, paused: bool) -> None:
        """A slow reader stops (or resumes) reading; outputs merge in its collector."""
        client = self.live_client.get(rid)
        if client is not None:
            if paused and not client.paused:
                client.paused_at = self.loop.clock.current_time()
            client.paused = paused
            self.call(lambda: None)

    def tick(self, seconds: float) -> None:
        """Mock time passes (a stalled reader may run past its stream timeout)."""
        self.call(lambda: self.loop.clock.jump(seconds))
        self._check_stalls()

    def finish_thread(self) -> None:
        """The Tokenizer's oldest thread job returns."""
        self.call(lambda: self.tokenizer.jobs.popleft().set())

    def engine_dies(self) -> None:
        """The engine's process dies (AsyncEngine.mark_dead): its actors stop, what was on
        its way to or inside it is gone, and the Frontend fails every live request."""

        def kill() -> None:
            self.dead = True
            self.death_mark = self.rec.count
            for name in ENGINE_SIDE:
                self._scopes[name].cancel()
                self.boxes[name].kill()
            self.worker.pending.clear()  # (its outgoing results stay with its dead sender)
            self.tokenizer.jobs.clear()
            self.outstanding.clear()
            self.frontend.lose_all(DEATH)

        self.call(kill)

    def pending_edges(self) -> list[str]:
        return [e for e in EDGES if self._edges[e].wires.get(e)]

    def deliver(self, edge: str) -> None:
        """Deliver the oldest message waiting on ``edge``."""
        self.call(lambda: self._edges[edge].deliver(edge))

    def pump(self, hold: frozenset[str] = frozenset(), limit: int = 64) -> None:
        """Deliver one message at a time, edge by edge, until only held edges have any."""
        for _ in range(limit):
            edges = [e for e in self.pending_edges() if e not in hold]
            if not edges:
                return
            self.deliver(edges[0])

    def complete_step(self, salt: int = 0, eos_mask: int = 0) -> None:
        self.call(lambda: self.worker.answer(salt, eos_mask))

    def fail_step(self) -> None:
        self.call(self.worker.fail)

    def duplicate_result(self) -> None:
        self.call(self.worker.duplicate)

    def late_result(self, back: int) -> None:
        self.call(lambda: self.worker.late(back))

    # --- drain --------------------------------------------------------------------------------

    def quiet(self) -> bool:
        engine = not self.dead and (self.worker.pending or self.worker.outgoing
                                    or self.tokenizer.jobs)
        return not (self._running or engine or any(b.depth for b in self.boxes.values()))

    def drain(self, max_rounds: int = 2000) -> None:
        """Resume every reader, then deliver everything and answer every step until nothing
        moves; then check invariant 4. (A step takes a few rounds to travel the whole loop,
        and a tight pool can make a few dozen requests take a few hundred steps.)

        With a stream timeout, the readers still stopped first stay stopped past it (what
        a client that never comes back does): their requests must be cancelled."""
        flow = self.config.flow
        if flow is not None and flow.stream_timeout is not None and not self.dead:
            self.tick(flow.stream_timeout + 1.0)
        for client in self.clients:
            client.paused = False

        def round_() -> None:
            for edge in EDGES:
                for _ in range(len(self._edges[edge].wires[edge])):
                    self._edges[edge].deliver(edge)
            while self.worker.pending:
                self.worker.answer()
            while self.tokenizer.jobs:
                self.tokenizer.jobs.popleft().set()

        # A round first, even in a world that looks quiet: the readers resumed above read
        # in it (call() lets them), and their reads send FlowControl(resume) that the
        # next rounds must deliver. (Checking quiet() before any read let a drain end
        # with a resume still in the Tokenizer's mailbox: a request left PAUSED.)
        for _ in range(max_rounds):
            self.call(round_)
            self.check()
            if self.quiet():
                break
        if not self.quiet():
            self.report("4", f"no drain after {max_rounds} rounds: {self.drain_problems()}")
        if self.scheduler.paused and not self.dead:  # every reader reads now: none paused
            self.report("11", f"still paused after every reader caught up: "
                        f"{sorted(self.scheduler.paused)}")
        problems = self.drain_problems()
        if problems:
            self.report("4", "after drain: " + "; ".join(problems))
        for inc in self.rec.all:
            if not inc.ended:
                self.report("4", f"history never ended: {inc.describe()}")
        for client in self.clients:
            if client.outcome == "accepted" and not client.disconnected and not client.final:
                self.report("2", f"client of {client.rid!r} never got a final output")
            for mark in client.abort_marks:
                self._check_abort_reached(client, mark, drained=True)
            if client.n > 1 and client.inc is not None:
                self._check_siblings_aborted(client)
            if self.dead:
                self._check_lost(client)
        self.check()

    def coverage(self) -> list[str]:
        """Which corners this run reached (for hypothesis' statistics)."""
        s, events = self.scheduler, [e for inc in self.rec.all for _, _, e in inc.events]
        reached = {
            "preempted": s.num_preemptions > 0,
            "late or duplicate result dropped": s.late_results_dropped > 0,
            "stop string matched": any(r[1] in STOP_STRINGS for c in self.clients
                                       for r in c.reason.values()),
            "rejected": "reject" in events,
            "step failed": "fail" in events,
            "aborted": "abort" in events,
            "n>1 gathered": "gather" in events,
            "rid reused": any(inc.number for inc in self.rec.all),
            "backpressure": any(b.high_water >= b.capacity for b in self.boxes.values()),
            "prompt logprobs read": any(
                c.params.prompt_logprobs is not None and r[0] != "abort"
                for c in self.clients for r in c.reason.values()),
            "prompt scored only": any(c.params.max_tokens == 0 and r[0] == "length"
                                      for c in self.clients for r in c.reason.values()),
            "recompute owed prompt logprobs": self.recompute_skipped_reported,
            "token fed forward": self.worker.fed_forward > 0,
            "planned past the end": s.ahead_tokens_dropped > 0,
            "prefix cache hit": s.pool.hits > 0,
            "cached block evicted": s.pool.evictions > 0,
            "block shared while in use": self.shared_seen,
            "paused": "pause" in events,
            "resumed": "resume" in events,
            "preempted while paused": any(_preempted_while_paused(inc.events)
                                          for inc in self.rec.all),
            "engine died": self.dead,
            "lost a live request": any(c.error is not None and c.error.code == "engine_dead"
                                       and c.outcome == "accepted" for c in self.clients),
            "stream timeout": any(c.timed_out for c in self.clients),
            "tokenized in a thread": self.tokenizer.hops > 0,
            "urgent arrival preempted": self.urgent_preemptions > 0,
            "drafts verified": self.worker.drafts_verified > 0,
            "draft rejected": self.worker.drafts_rejected > 0,
            "all drafts accepted": self.worker.drafts_all_accepted > 0,
            "drafted ahead": self.worker.ahead_drafting > 0,
            "ended between proposal and verdict": self.ended_mid_speculation > 0,
            "drafts filled by the draft model": getattr(self.worker, "drafts_filled", 0) > 0,
            "draft accepted": s.batch.speculation is not None
            and s.batch.speculation.accepted_tokens > 0,
            "row backed off": s.batch.speculation is not None
            and s.batch.speculation.backoffs > 0,
        }
        return [name for name, hit in reached.items() if hit]

    def drain_problems(self) -> list[str]:
        s = self.scheduler
        problems: list[str] = []
        pacing = self.frontend.pacing
        if pacing.flows or pacing.pending_bytes:
            problems.append(f"reader pacing holds {len(pacing.flows)} collectors, "
                            f"{pacing.pending_bytes} bytes")
        if self.dead:  # the engine's actors died with their state: only the Frontend is left
            problems += self.frontend.drain_problems()
            problems += [f"mailbox {b!r} holds {b.depth}" for b in self.boxes.values()
                         if b.depth]
            return problems + ([f"{self._running} API calls still waiting"]
                               if self._running else [])
        for actor in self.actors.values():
            problems += actor.drain_problems()
        if s.waiting or s.running or s.fenced or s.worker_drops:
            problems.append(f"scheduler queues: waiting={[q.rid for q in s.waiting]} "
                            f"running={[q.rid for q in s.running]} fenced={len(s.fenced)} "
                            f"worker_drops={s.worker_drops}")
        problems += [f"mailbox {b!r} holds {b.depth}" for b in self.boxes.values() if b.depth]
        if self._running:
            problems.append(f"{self._running} API calls still waiting")
        return problems


async def _stepper() -> None:
    """Wake whenever every other task waits, so trio's loop never sleeps on I/O (what
    MockClock's autojump does, without moving the clock)."""
    while True:
        await trio.testing.wait_all_tasks_blocked()
        await trio.lowlevel.checkpoint()


def _preempted_while_paused(events: list[tuple[int, str, str]]) -> bool:
    paused = False
    for _, _, e in events:
        if e == "preempt" and paused:
            return True
        paused = (paused or e == "pause") and e != "resume"
    return False
