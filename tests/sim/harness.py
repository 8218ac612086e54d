"""The deterministic simulation harness: the real actors, a scripted Worker, and a transport
whose delivery order the test chooses (DESIGN.md §7).

What runs: the real :class:`~actorllm.frontend.Frontend`, :class:`~actorllm.tokenizer.Tokenizer`
(with the tiny BPE tokenizer of ``tests/helpers.py``), :class:`~actorllm.scheduler.Scheduler`
and :class:`~actorllm.detokenizer.Detokenizer`; a :class:`~sim.scripted_worker.ScriptedWorker`
in place of the model; one :class:`~sim.controlled_transport.ControlledMailbox` per inbox,
so a message moves only when the test delivers it. Nothing sleeps; the clock is trio's
``MockClock``.

Theory of operation — running trio under a synchronous test driver. Hypothesis rules are
plain functions, and the actors are trio tasks. The :class:`GuestLoop` runs trio in *guest
mode* (``trio.lowlevel.start_guest_run``) on a host loop that is nothing but a deque of
callbacks, drained in this thread. With ``MockClock(autojump_threshold=0)`` trio never
blocks on I/O, so it never starts its I/O thread: every step of every task happens inside
``GuestLoop.run_until``, in this thread, in an order fixed by trio's deterministic
scheduling (importing hypothesis switches it on). :meth:`World.call` runs one action inside
trio, then waits with ``trio.testing.wait_all_tasks_blocked()`` until every task is blocked
(on a mailbox nobody has delivered to, a step the Worker has not answered, a full box), and
only then returns to the rule. Between rules, trio is not running at all.

What is checked (DESIGN.md §3), and where:

1. every message is seen as its sender sends it (``on_send``): a rid the Frontend has never
   registered, or a Frontend message for a rid not in its registry, is a violation;
2. every actor writes its transitions to one :class:`Recorder` (the Ledger's tracer), which
   replays each rid's merged history against the spec as it grows, one incarnation of the
   rid at a time, and counts terminal events; each client's collector is watched for
   anything put after its final output; clients' outputs never go past a matched stop
   string; a live rid must be refused (``DuplicateRequestId``);
3. the pool's ``free`` is watched: no block referenced by a step still in flight (sent by
   the Scheduler, its result not yet received by it) may be freed; after every rule the
   pool and the sequences' block tables must partition the blocks;
4. at drain (``World.drain``): every registry, ledger, pool, decode state, wire and the
   Worker's state is empty, and every history ends released;
5. a stale or duplicated result, an abort or a stop for a finished sequence, or a
   ``StopMatched`` sent for an earlier request with the same rid must leave the Scheduler
   exactly as it was; an abort (the client's, or the Frontend's own when a child fails)
   reaches every choice not yet answered; nothing ends in ``abort`` that nobody aborted;
6. a ``n > 1`` parent is gathered only after every child is released, and its client sees
   the final output only after every child has ended (an error may come at once; its
   live siblings must then be aborted, which 5 checks);
7. each choice's text equals the decode of the committed token ids (those the Scheduler
   sent to the Detokenizer), cut at the first stop string, with nothing lost or doubled,
   and its finish reason is the one the Scheduler decided.

Violations found inside the trio run are recorded, not raised (an exception there would
look like an actor crash); :meth:`World.check` raises the first one after each rule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import outcome
import trio
import trio.testing

from actorllm.config import ModelInfo
from actorllm.detokenizer import Detokenizer, hf_decode_fn
from actorllm.frontend import DuplicateRequestId, EndOfOutput, Frontend, RequestError
from actorllm.invariants import History, check_gather
from actorllm.lifecycle import IllegalTransition, State, load_spec
from actorllm.mailbox import MailboxClosed
from actorllm.messages import (
    AbortRequest,
    DetokenizerInput,
    FrontendInput,
    GenerateRequest,
    OutputBatch,
    RequestFailed,
    SamplingParams,
    SchedulerInput,
    SequenceRequest,
    StepPlan,
    StepResult,
    StopMatched,
    TokenBatch,
    TokenizeRequest,
    TokenizerInput,
    WorkerInput,
)
from actorllm.metrics import EngineMetrics
from actorllm.scheduler import Scheduler
from actorllm.tokenizer import PromptEncoder, Tokenizer

from .bugs import actor_class
from .controlled_transport import ControlledMailbox
from .scripted_worker import ScriptedWorker, prompt_score

SPEC = load_spec()
TERMINAL = SPEC.terminal_events

# Every edge of the single topology, in the order a drain delivers them.
EDGES = (
    "frontend->tokenizer",
    "tokenizer->frontend",
    "tokenizer->scheduler",
    "scheduler->worker",
    "worker->scheduler",
    "scheduler->detokenizer",
    "detokenizer->scheduler",
    "detokenizer->frontend",
)

# The scripted Worker's vocabulary: short ASCII pieces of the tiny tokenizer, so decoding is
# concatenative (see TextModel) and the stop strings below are easy to hit.
VOCAB_TEXTS = ("a", "b", "t", "he", " ", "!")
STOP_STRINGS = ("!", "ab", "the", "b b", "hehe")
PROMPTS = ("Hi", "The river runs", "Hello! How are you?")  # 3, 8 and 11 tokens


class InvariantViolation(AssertionError):
    """A DESIGN.md §3 invariant does not hold. ``invariant`` is its number, as text."""

    def __init__(self, invariant: str, message: str) -> None:
        self.invariant = invariant
        title = SPEC.invariants.get(invariant, invariant)
        super().__init__(f"invariant {invariant} ({title}): {message}")


@attrs.frozen
class SimConfig:
    """Sizes small enough that preemption, chunked prefill and backpressure all happen."""

    num_blocks: int = 8
    block_size: int = 4
    max_num_seqs: int = 3
    max_num_batched_tokens: int = 8
    max_model_len: int = 16
    capacity: int = 3  # every inbox but the Worker's
    worker_capacity: int = 2  # as in actorllm.engine
    roundtrip: bool = True  # send every delivered message through the codec
    bugs: frozenset[str] = frozenset()  # planted bugs (sim/bugs.py): "frontend.bug_...", ...


# --- text: the reference for invariant 7 ---------------------------------------------------


class TextModel:
    """Decoding as the Detokenizer does it, and the stop-string reference.

    The scripted Worker only emits ``VOCAB_TEXTS`` tokens (and eos), each a complete UTF-8
    string, so ``decode(ids) == "".join(piece(t) for t in ids)`` (asserted here). That
    makes the reference simple: a stop string matches at the first token whose piece
    completes it, exactly where the incremental matcher sees it.
    """

    def __init__(self, hf_tokenizer: Any) -> None:
        self.decode = hf_decode_fn(hf_tokenizer)
        self.eos_id: int = hf_tokenizer.eos_token_id
        by_text: dict[str, int] = {}
        for tid in range(len(hf_tokenizer)):
            by_text.setdefault(self.decode([tid], True), tid)
        self.vocab = tuple(by_text[t] for t in VOCAB_TEXTS)
        self._piece = {t: self.decode([t], True) for t in (*self.vocab, self.eos_id)}
        for a in self._piece:
            for b in self._piece:
                assert self.decode([a, b], True) == self._piece[a] + self._piece[b], (a, b)

    def piece(self, tid: int) -> str:
        return self._piece.get(tid) if tid in self._piece else self.decode([tid], True)

    def reference(self, ids: Sequence[int], stops: Sequence[str],
                  include: bool) -> tuple[int | None, str, str | None]:
        """(tokens up to the stop match or None, the text a client must read, the stop)."""
        buf = ""
        for k, tid in enumerate(ids, 1):
            buf += self.piece(tid)
            hits = [(i, s) for s in stops if (i := buf.find(s)) >= 0]
            if hits:
                # The one complete first, then the one begun first (as the Detokenizer).
                i, stop = min(hits, key=lambda h: (h[0] + len(h[1]), h[0]))
                return k, buf[: i + len(stop)] if include else buf[:i], stop
        return None, buf, None


# --- the merged history ---------------------------------------------------------------------


@attrs.define(eq=False)
class Incarnation:
    """One request that used ``rid``: from its ``register`` to its ``forget``/``gather``."""

    rid: str
    number: int
    events: list[tuple[int, str, str]] = attrs.Factory(list)  # (global index, actor, event)
    history: History = attrs.Factory(lambda: History(SPEC))  # the checker's fold of it
    terminal: list[tuple[str, object]] = attrs.Factory(list)  # (event, reason)
    children: tuple[str, ...] = ()
    child_incs: dict[int, Incarnation] = attrs.Factory(dict)
    parent: Incarnation | None = None
    committed: list[int] = attrs.Factory(list)  # token ids the Scheduler sent on
    aborts_sent: int = 0  # AbortRequests the Frontend sent for it

    @property
    def ended(self) -> bool:
        """Released by the Frontend: its rid may be used again."""
        return bool(self.events) and self.events[-1][2] in ("forget", "gather")

    def index_of(self, event: str) -> int | None:
        return next((i for i, _, e in self.events if e == event), None)

    def describe(self) -> str:
        return f"{self.rid!r}#{self.number} [{' '.join(f'{a}:{e}' for _, a, e in self.events)}]"


class Recorder:
    """A Tracer for every actor: the one merged transition history, checked as it grows
    by the invariant checker of actorllm/invariants.py."""

    def __init__(self, report: Callable[[str, str], None]) -> None:
        self.report = report
        self.count = 0  # transitions so far: a clock that orders every actor's events
        self.current: dict[str, Incarnation] = {}
        self.all: list[Incarnation] = []
        self._parent_of: dict[str, Incarnation] = {}

    def transition(self, actor: str, rid: str, event: str, before: str, after: str,
                   details: dict[str, object] | None = None) -> None:
        details = details or {}
        inc = self.current.get(rid)
        if event == "register" and (inc is None or inc.ended):
            inc = self._new(rid)
        elif inc is None:
            self.report("1", f"{actor} fired {event!r} for {rid!r} before the Frontend "
                        "registered it")
            inc = self._new(rid)
        index = self.count
        self.count += 1
        inc.events.append((index, actor, event))
        found = inc.history.push(event, actor)
        if found is not None:
            self.report(found.invariant, f"{found.message}: {inc.describe()}")
        if event in TERMINAL:
            inc.terminal.append((event, details.get("reason")))
        if event == "fan_out":
            inc.children = tuple(details.get("children", ()))  # type: ignore[arg-type]
            for child in inc.children:
                self._parent_of[child] = inc
        if event == "register" and rid in self._parent_of:
            parent = self._parent_of.pop(rid)
            inc.parent = parent
            parent.child_incs[parent.children.index(rid)] = inc
        if event == "gather":
            def state_of(child: str) -> str | None:
                c = inc.child_incs.get(inc.children.index(child))
                return c.history.state if c is not None else None

            why = check_gather(SPEC, inc.children, state_of)
            if why is not None:
                self.report("6", f"parent {rid!r}: {why}: {inc.describe()}")

    def record(self, kind: str, **fields: Any) -> None:
        """Non-transition facts (the Scheduler's plans and inputs): not needed here."""

    def _new(self, rid: str) -> Incarnation:
        prev = self.current.get(rid)
        inc = Incarnation(rid, prev.number + 1 if prev is not None else 0)
        self.current[rid] = inc
        self.all.append(inc)
        return inc

    @staticmethod
    def children_of(inc: Incarnation) -> list[Incarnation]:
        return [inc.child_incs[i] for i in sorted(inc.child_incs)]

    def live(self, rid: str) -> bool:
        """Whether the Frontend should still hold ``rid`` (registered, not yet forgotten)."""
        inc = self.current.get(rid)
        return inc is not None and not inc.ended


# --- clients --------------------------------------------------------------------------------


@attrs.define(eq=False)
class Client:
    """One API caller: what it asked for, what it has read, and how it behaves."""

    rid: str
    params: SamplingParams
    stream: bool
    mark: int  # Recorder.count when it submitted
    outcome: str = "pending"  # "accepted" | "duplicate" | "raised ..."
    expect_duplicate: bool = False
    inc: Incarnation | None = None
    collector: Any = None
    submit_returned: bool = False
    paused: bool = False
    disconnected: bool = False
    # Recorder.count when each abort call started and when it returned (None: still waiting)
    abort_marks: list[list[int | None]] = attrs.Factory(list)
    text: dict[int, list[str]] = attrs.Factory(dict)
    ids: dict[int, list[int]] = attrs.Factory(dict)
    prompt_lps: dict[int, list[Any]] = attrs.Factory(dict)  # per choice, as read
    prompt_ids: list[int] = attrs.Factory(list)  # what the Tokenizer will make of the prompt
    reason: dict[int, tuple[str, object]] = attrs.Factory(dict)
    final: bool = False
    error: RequestError | None = None

    @property
    def n(self) -> int:
        return self.params.n

    def choice(self, index: int) -> Incarnation | None:
        """The incarnation behind choice ``index``."""
        if self.inc is None:
            return None
        return self.inc if self.n == 1 else self.inc.child_incs.get(index)

    def readable(self) -> bool:
        if self.collector is None or self.final or self.disconnected or self.paused:
            return False
        return self.stream or self.collector.finished


# --- running trio under a synchronous driver --------------------------------------------------


def _leaf(exc: BaseException) -> BaseException:
    """The one real error inside nested single-member exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class GuestLoop:
    """A trio run in guest mode, stepped by hand (see the module docstring)."""

    MAX_TICKS = 100_000  # a settle that needs more is a livelock, not a slow test

    def __init__(self, main: Callable[[], Awaitable[None]]) -> None:
        self._queue: deque[Callable[[], object]] = deque()
        self.result: outcome.Outcome[None] | None = None
        self.clock = trio.testing.MockClock(autojump_threshold=0)
        trio.lowlevel.start_guest_run(
            main,
            run_sync_soon_threadsafe=self._queue.append,
            done_callback=self._done,
            clock=self.clock,
        )

    def _done(self, result: outcome.Outcome[None]) -> None:
        self.result = result

    def run_until(self, predicate: Callable[[], bool]) -> None:
        """Run trio's callbacks until ``predicate()``; re-raise if the run died."""
        for _ in range(self.MAX_TICKS):
            if predicate():
                return
            if self.result is not None:
                self._raise()
            self._queue.popleft()()
        raise RuntimeError("the simulation did not settle (livelock?)")

    def _raise(self) -> None:
        assert self.result is not None
        try:
            self.result.unwrap()
        except BaseException as exc:
            raise _leaf(exc) from None
        raise RuntimeError("the trio run ended while the simulation was still using it")

    def finish(self) -> None:
        """Run to the end (the caller has cancelled everything); re-raise a failure."""
        self.run_until(lambda: self.result is not None)
        try:
            self.result.unwrap()  # type: ignore[union-attr]
        except BaseException as exc:
            raise _leaf(exc) from None


# --- the world ------------------------------------------------------------------------------


def message_rids(msg: Any) -> list[str]:
    """Every rid a message concerns."""
    if isinstance(msg, TokenizeRequest | AbortRequest | SequenceRequest | RequestFailed
                  | StopMatched):
        return [msg.rid]
    if isinstance(msg, StepPlan):
        return [s.rid for s in msg.seqs] + list(msg.forget)
    if isinstance(msg, StepResult):
        return [t.rid for t in msg.tokens]
    if isinstance(msg, TokenBatch):
        return [o.rid for o in msg.outputs] + list(msg.freed)
    if isinstance(msg, OutputBatch):
        return [d.rid for d in msg.deltas] + [f.rid for f in msg.finished] + list(msg.freed)
    return []


class World:
    """One simulated engine. Each public method is one step the test may take."""

    def __init__(self, hf_tokenizer: Any, text: TextModel, config: SimConfig | None = None,
                 metrics: EngineMetrics | None = None) -> None:
        self.config = cfg = config or SimConfig()
        self.text = text
        self.hf_tokenizer = hf_tokenizer  # the Tokenizer's, for the prompt logprobs check
        self.recompute_skipped_reported = False
        self.violations: list[InvariantViolation] = []
        self.rec = Recorder(self.report)
        self.clients: list[Client] = []
        self.live_client: dict[str, Client] = {}
        self.outstanding: dict[int, StepPlan] = {}  # steps sent, result not yet received
        self._sched_tag: Any = None
        self._running = 0  # harness tasks (submit, abort) not yet finished
        self._closing = False
        self._idle = False

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
                                 metrics=metrics, tracer=self.rec)  # type: ignore[arg-type]
        info = ModelInfo(path="sim", vocab_size=len(hf_tokenizer),
                         max_model_len=cfg.max_model_len, eos_token_ids=(text.eos_id,),
                         generation_defaults={})
        self.tokenizer = Tokenizer(PromptEncoder(hf_tokenizer, info), b["tokenizer"],
                                   b["scheduler"].edge("tokenizer"),
                                   b["frontend"].edge("tokenizer"),
                                   tracer=self.rec)  # type: ignore[arg-type]
        self.scheduler = cls("scheduler", Scheduler)(b["scheduler"], b["worker"].edge("scheduler"),
                                   b["detokenizer"].edge("scheduler"),
                                   num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                                   max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   tracer=self.rec)  # type: ignore[arg-type]
        self.worker = cls("worker", ScriptedWorker)(b["worker"], b["scheduler"].edge("worker"),
                                                    text.vocab, text.eos_id)
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
        self.loop = GuestLoop(self._main)
        self.loop.run_until(lambda: self._idle)

    # --- plumbing ---------------------------------------------------------------------------

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            for name, actor in self.actors.items():
                nursery.start_soon(actor.run, name=f"actor:{name}")
            await trio.testing.wait_all_tasks_blocked()
            self._idle = True
            await trio.sleep_forever()

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
        client.prompt_ids = list(self.hf_tokenizer(prompt).input_ids)
        self.clients.append(client)
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
        client.submit_returned = True
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
        if client.submit_returned and client.collector is not None \
                and not client.collector.finished:
            self.abort(rid)

    def set_paused(self, rid: str, paused: bool) -> None:
        """A slow reader stops (or resumes) reading; outputs merge in its collector."""
        client = self.live_client.get(rid)
        if client is not None:
            client.paused = paused
            self.call(lambda: None)

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
        return not (self._running or self.worker.pending or self.worker.outgoing
                    or any(b.depth for b in self.boxes.values()))

    def drain(self, max_rounds: int = 2000) -> None:
        """Resume every reader, then deliver everything and answer every step until nothing
        moves; then check invariant 4. (A step takes a few rounds to travel the whole loop,
        and a tight pool can make a few dozen requests take a few hundred steps.)"""
        for client in self.clients:
            client.paused = False

        def round_() -> None:
            for edge in EDGES:
                for _ in range(len(self._edges[edge].wires[edge])):
                    self._edges[edge].deliver(edge)
            while self.worker.pending:
                self.worker.answer()

        for _ in range(max_rounds):
            self.check()
            if self.quiet():
                break
            self.call(round_)
        if not self.quiet():
            self.report("4", f"no drain after {max_rounds} rounds: {self.drain_problems()}")
        self.call(lambda: None)  # the readers resumed above read what is left
        self.check()
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
        }
        return [name for name, hit in reached.items() if hit]

    def drain_problems(self) -> list[str]:
        s = self.scheduler
        problems: list[str] = []
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

    # --- hooks (run inside trio: record, never raise) ----------------------------------------

    def _on_send(self, edge: str, msg: Any) -> Any:
        """A message leaves its sender (it may still wait for room before its wire)."""
        rids = message_rids(msg)
        for rid in rids:
            if rid not in self.rec.current:
                self.report("1", f"{type(msg).__name__} for {rid!r} was sent on {edge} before "
                            "the Frontend registered it")
        if edge == "frontend->tokenizer":
            fe = self.frontend
            if msg.rid not in fe.registry or msg.rid not in fe.ledger.views:
                self.report("1", f"the Frontend sent {type(msg).__name__} for {msg.rid!r} "
                            "while its registry does not hold it")
            elif isinstance(msg, AbortRequest):
                self.rec.current[msg.rid].aborts_sent += 1
        elif edge == "scheduler->worker":
            self.outstanding[msg.step_id] = msg
            # A recompute asking only for prompt positions not reported before preemption.
            self.recompute_skipped_reported = self.recompute_skipped_reported or any(
                s.prompt_logprobs_from is not None and s.prompt_logprobs_from > s.start_pos + 1
                for s in msg.seqs)
        elif edge == "scheduler->detokenizer":
            for out in msg.outputs:
                if out.rid in self.rec.current:
                    self.rec.current[out.rid].committed.extend(out.token_ids)
        return self.rec.current.get(rids[0]) if len(rids) == 1 else None

    def _on_recv(self, box: str, msg: Any, tag: Any) -> None:
        if box == "scheduler":
            self._sched_tag = tag

    def _watch_scheduler(self) -> None:
        """Wrap the Scheduler's ``handle`` and its pool's ``free`` (invariants 3 and 5)."""
        s = self.scheduler
        handle, free = s.handle, s.pool.free

        def checked_handle(msg: Any) -> None:
            why = None  # set: the message must leave the Scheduler exactly as it was
            if isinstance(msg, StepResult):
                if self.outstanding.pop(msg.step_id, None) is None:
                    why = f"a stale or duplicated result of step {msg.step_id}"
            elif isinstance(msg, AbortRequest | StopMatched):
                seq = s.seqs.get(msg.rid)
                if seq is None or seq.status is State.FINISHED:
                    why = f"{type(msg).__name__} for {msg.rid!r}, which has already finished"
                elif isinstance(msg, StopMatched) and self._sched_tag is not self.rec.current.get(
                        msg.rid):
                    why = (f"StopMatched({msg.rid!r}, {msg.stop!r}) sent for an earlier request "
                           f"with this rid, arriving while {self.rec.current[msg.rid].describe()}"
                           " is live")
            before = self._scheduler_snapshot() if why else None
            handle(msg)
            if why and self._scheduler_snapshot() != before:
                self.report("5", f"{why} changed the Scheduler's state")

        def checked_free(blocks: list[int]) -> None:
            for b in blocks:
                for step, plan in self.outstanding.items():
                    for seq in plan.seqs:
                        if b in seq.block_table:
                            self.report("3", f"block {b} freed while step {step} (which "
                                        f"uses it for {seq.rid!r}) is in flight")
            free(blocks)

        s.handle = checked_handle  # type: ignore[method-assign]
        s.pool.free = checked_free  # type: ignore[method-assign]

    def _scheduler_snapshot(self) -> tuple[object, ...]:
        s = self.scheduler
        seqs = tuple(sorted((q.rid, q.status, tuple(q.output_ids), tuple(q.block_table),
                             q.num_computed, q.in_flight) for q in s.seqs.values()))
        return (seqs, tuple(q.rid for q in s.waiting), tuple(q.rid for q in s.running),
                tuple(q.rid for q in s.fenced), frozenset(s.pool._used),
                s.in_flight.step_id if s.in_flight else None, tuple(s.worker_drops),
                tuple(s._outputs), tuple(s._freed))

    # --- clients ------------------------------------------------------------------------------

    def _link_clients(self) -> None:
        """Find each new client's incarnation and collector (both exist before any output)."""
        for client in self.clients:
            if client.inc is not None or client.expect_duplicate:
                continue
            inc = self.rec.current.get(client.rid)
            st = self.frontend.registry.get(client.rid)
            if inc is None or inc.events[0][0] < client.mark or st is None:
                continue
            client.inc = inc
            client.collector = st.collector
            self._watch_collector(client)

    def _watch_collector(self, client: Client) -> None:
        """Invariant 2 at the collector: nothing is put into it after its final output."""
        col = client.collector
        if "collector.bug_drop_merged" in self.config.bugs:
            col.bug_drop_merged = True
        put_delta, put_finish, put_error = col.put_delta, col.put_finish, col.put_error
        done: set[int] = set()

        def delta(index: int, *args: Any) -> None:
            if index in done:
                self.report("2", f"{client.rid!r}: output for choice {index} after its finish")
            put_delta(index, *args)

        def finish(index: int, *args: Any) -> None:
            if index in done:
                self.report("2", f"{client.rid!r}: choice {index} finished twice")
            done.add(index)
            put_finish(index, *args)

        def error(exc: RequestError) -> None:
            if len(done) == client.n:
                self.report("2", f"{client.rid!r}: an error after the final output")
            put_error(exc)

        col.put_delta, col.put_finish, col.put_error = delta, finish, error

    async def _read(self, client: Client) -> None:
        """Read everything the collector has now, through its public ``get``.

        ``get`` returns without a checkpoint when there is news, and waits otherwise; an
        already-cancelled scope turns that wait into "nothing new" at once.
        """
        while not client.final:
            with trio.CancelScope() as scope:
                scope.cancel()
                try:
                    out = await client.collector.get()
                except RequestError as exc:
                    client.error = exc
                    client.final = True
                    self._check_final(client)
                    return
                except EndOfOutput:
                    self.report("2", f"{client.rid!r}: output ended without a final output")
                    return
            if scope.cancelled_caught:
                return
            for c in out.outputs:
                if c.index in client.reason:
                    self.report("2", f"{client.rid!r}: choice {c.index} output after its finish")
                client.text.setdefault(c.index, []).append(c.text)
                client.ids.setdefault(c.index, []).extend(c.token_ids)
                client.prompt_lps.setdefault(c.index, []).extend(c.prompt_logprobs)
                if c.finish_reason is not None:
                    client.reason[c.index] = (c.finish_reason, c.stop_reason)
                self._check_choice(client, c.index)
            if out.finished:
                client.final = True
                if len(client.reason) != client.n:
                    self.report("2", f"{client.rid!r}: final output with choices unfinished")
                self._check_final(client)

    # --- checks ------------------------------------------------------------------------------

    def _check_choice(self, client: Client, index: int) -> None:
        """Invariants 2 (nothing past the stop) and 7 (text == decode(committed ids))."""
        inc = client.choice(index)
        if inc is None:
            self.report("2", f"{client.rid!r}: output for choice {index}, never registered")
            return
        ids, text = client.ids[index], "".join(client.text[index])
        committed = inc.committed
        p = client.params
        where = f"{inc.rid!r} (choice {index})"
        if ids != committed[: len(ids)]:
            self.report("7", f"{where}: the client read ids {ids}, the Scheduler committed "
                        f"{committed}")
            return
        k, ref, _ = self.text.reference(ids, p.stop, p.include_stop_str_in_output)
        if k is not None and k < len(ids):
            self.report("2", f"{where}: output after the stop string matched at token {k}: "
                        f"ids {ids}, text {text!r}")
            return
        if not ref.startswith(text):
            self.report("7", f"{where}: the client read {text!r}, decode gives {ref!r}")
            return
        if not self._check_prompt_logprobs(client, index, where):
            return
        if index not in client.reason:
            return
        reason, stop_reason = client.reason[index]
        kc, full, stop = self.text.reference(committed, p.stop, p.include_stop_str_in_output)
        want = committed[:kc] if kc is not None else committed
        if ids != want or text != full:
            self.report("7", f"{where} finished ({reason}) having read {ids} / {text!r}; "
                        f"committed {committed} decode to {full!r}")
            return
        if not inc.terminal:
            self.report("2", f"{where}: a finish reached the client before any terminal event")
            return
        event, decided = inc.terminal[0]
        if event in ("fail", "reject"):
            self.report("2", f"{where} ended by {event}, yet the client read a finish")
        elif event == "abort":
            expected: tuple[str, object] = ("abort", None)
        elif stop is not None:
            expected = ("stop", stop)
        else:
            expected = (str(decided), None)
            justified = (len(committed) == p.max_tokens if decided == "length" else
                         bool(committed) and committed[-1] == self.text.eos_id)
            if not justified:
                self.report("7", f"{where} finished {decided!r} after {committed}, which "
                            "neither reached max_tokens nor ended in eos or a stop string")
        if event not in ("fail", "reject") and (reason, stop_reason) != expected:
            self.report("7", f"{where}: the client read finish {(reason, stop_reason)}, "
                        f"expected {expected} ({event})")

    def _check_prompt_logprobs(self, client: Client, index: int, where: str) -> bool:
        """Each prompt position reported once, in order, before any token (invariant 7)."""
        got = [None if e is None else (e.token_id, e.logprob)
               for e in client.prompt_lps.get(index, ())]
        if client.params.prompt_logprobs is None:
            want: list[Any] = []
        else:
            ids = client.prompt_ids
            want = [None] + [(ids[p], prompt_score(p)) for p in range(1, len(ids))]
        complete = bool(client.ids.get(index)) or (
            index in client.reason and client.reason[index][0] != "abort")
        if got != want[: len(got)] or (complete and got != want):
            self.report("7", f"{where}: prompt logprobs read {got}, expected {want}")
            return False
        return True

    def _check_final(self, client: Client) -> None:
        """The request's end as its client sees it: invariants 2 and 6."""
        inc = client.inc
        assert inc is not None
        choices = [inc] if client.n == 1 else Recorder.children_of(inc)
        if client.n > 1:
            unended = [c.describe() for c in choices if not c.terminal]
            unended += [f"{client.rid}-{i}" for i in range(client.n) if i not in inc.child_incs]
            # An error may reach the client at once (the Frontend then aborts the siblings,
            # which drain() checks); a successful final output only after every child ended.
            if unended and client.error is None:
                self.report("6", f"the client of {client.rid!r} read the final output while "
                            f"children have not ended: {unended}")
        elif not inc.terminal:
            self.report("2", f"{client.rid!r}: final output before any terminal event")
        if client.error is not None and not any(
                t[0] in ("fail", "reject") for c in choices for t in c.terminal):
            self.report("2", f"{client.rid!r}: the client got an error ({client.error}) but no "
                        "choice failed")

    def _check_abort_reached(self, client: Client, mark: list[int | None],
                             drained: bool) -> None:
        """Invariant 5: an abort reaches every choice not answered before the call returned.

        ``mark`` is (call, return) on the Recorder's clock. Right after the call, choices
        registered before it are judged (the Frontend may still be registering the rest);
        at drain, all of them.
        """
        inc = client.inc
        start, end = mark
        if inc is None or end is None:
            return
        choices = {0: inc} if client.n == 1 else dict(inc.child_incs)
        for i in range(client.n):
            c = choices.get(i)
            if c is None:
                if drained:
                    self.report("5", f"{client.rid!r}: choice {i} never registered")
                continue
            if not drained and c.events[0][0] >= start:
                continue
            responded = c.index_of("respond")
            if (responded is None or responded >= end) and c.aborts_sent == 0 \
                    and not (not drained and self._abort_pending(c)):
                self.report("5", f"{client.rid!r} was aborted, yet no abort was sent for "
                            f"choice {i}: {c.describe()}")

    def _check_siblings_aborted(self, client: Client) -> None:
        """Invariant 5 for the Frontend's own aborts: once a child fails, every sibling that
        had not been answered by then is aborted."""
        children = Recorder.children_of(client.inc)  # type: ignore[arg-type]
        failed = [i for c in children for i, _, e in c.events if e in ("fail", "reject")]
        if not failed:
            return
        for c in children:
            if c.terminal and c.terminal[0][0] in ("fail", "reject"):
                continue
            if c.index_of("respond") is None and c.aborts_sent == 0:
                self.report("5", f"a child of {client.rid!r} failed, yet its sibling was not "
                            f"aborted: {c.describe()}")

    def _abort_pending(self, inc: Incarnation) -> bool:
        """Whether the Frontend has decided to abort ``inc`` but holds the abort until the
        request itself has left (submit sends it right after). drain() checks it went."""
        st = self.frontend.registry.get(inc.rid)
        return st is not None and self.rec.current.get(inc.rid) is inc and st.abort_sent

    def check(self) -> None:
        """Raise the first violation found so far; then check the pool (invariant 3), parents
        (6) and aborts nobody asked for (5)."""
        self._check_pool()
        for inc in self.rec.all:
            if inc.children and not inc.ended and len(inc.child_incs) == len(inc.children) \
                    and all(c.ended for c in inc.child_incs.values()):
                self.report("6", f"every child of {inc.rid!r} was released, yet it was not "
                            "gathered")
            aborted_at = inc.index_of("abort")
            if aborted_at is not None:
                top = inc.parent or inc
                client = next((c for c in self.clients if c.inc is top), None)
                asked = client is None or any(m[0] <= aborted_at  # type: ignore[operator]
                                              for m in client.abort_marks)
                # A child's error aborts its siblings (the client has its error already).
                failed = [i for c in Recorder.children_of(top) for i, _, e in c.events
                          if e in ("fail", "reject")]
                if not asked and not (failed and min(failed) < aborted_at):
                    self.report("5", f"{inc.describe()} was aborted, but its client never "
                                "asked to abort it")
        if self.violations:
            raise self.violations[0]

    def _check_pool(self) -> None:
        s = self.scheduler
        pool = s.pool
        free, used = list(pool._free), set(pool._used)
        if len(set(free)) != len(free) or used & set(free) \
                or len(free) + len(used) != pool.num_blocks:
            self.report("3", f"pool inconsistent: free={free} used={sorted(used)}")
        owners: dict[int, str] = {}
        for seq in s.seqs.values():
            for b in seq.block_table:
                if b in owners:
                    self.report("3", f"block {b} held by both {owners[b]!r} and {seq.rid!r}")
                owners[b] = seq.rid
        if set(owners) != used:
            self.report("3", f"blocks in use {sorted(used)} but held by sequences "
                        f"{sorted(owners)}")

