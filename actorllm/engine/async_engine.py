"""Wiring: build the mailboxes, start the actors, hand out an API.

``open_engine`` places the five actors as ``config.topology`` says
(:mod:`actorllm.topology`): all in this process (``single``), or some in child
processes that talk to this one over ZeroMQ (``engine``, ``pipeline``). The actors
do not change; only their mailboxes do. The API layer always talks to the
Frontend, which always lives here.

    async with open_engine(EngineConfig(model=...)) as engine:
        async for out in engine.generate(GenerateRequest(...)):
            ...
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from actorllm.config import EngineConfig
from actorllm.draft_config import check_runner_draft
from actorllm.engine.admission import Admission, Gate
from actorllm.engine.resources import Resources
from actorllm.frontend.actor import Frontend
from actorllm.frontend.collector import OutputCollector
from actorllm.lifecycle.table import load_spec
from actorllm.lifecycle.trace import Tracer
from actorllm.metrics import EngineMetrics
from actorllm.topology.child import TOKENIZER_FILE, sole_error
from actorllm.topology.placement import (
    MAIN,
    PLACEMENTS,
    Parts,
    Wiring,
    actor_problems,
    build_actors,
    build_runner,
    child_roles,
    set_hop_hooks,
    split_role,
)
from actorllm.topology.supervisor import EngineStartError, Supervisor
from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import FailureCode, GenerateRequest, InvalidRequest, ReplicaLost
from actorllm.wire.outputs import RequestError, RequestOutput
from actorllm.wire.transport import IpcDir

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineStartError", "Resources", "build_runner", "open_engine"]

SIGTERM_DRAIN_TIMEOUT = 10.0  # seconds live requests get to finish after a SIGTERM


class AsyncEngine:
    """The API layer's handle on a running engine. Talks to the Frontend only.

    ``admission`` is the one gate for new work (see ``actorllm.engine.admission``): ``alive``
    turns False when the engine stops or one of its processes dies; ``dead_reason`` then
    says why, and every request fails with that message. ``died`` is set only for a
    death (a child process exited, or an actor of this process raised), not for an
    orderly stop: that is what a server restarts for.
    """

    def __init__(self, config: EngineConfig, resources: Resources, frontend: Frontend,
                 actors: dict[str, Any], mailboxes: dict[str, Mailbox[Any]], *,
                 supervisor: Supervisor | None = None) -> None:
        self.config = config
        self.resources = resources
        self.info = resources.info
        self.tokenizer = resources.hf_tokenizer
        self.frontend = frontend
        self.metrics: EngineMetrics = frontend.metrics
        self.actors = actors  # those in this process
        self.mailboxes = mailboxes  # those in this process
        self.supervisor = supervisor  # None in the single topology
        self.admission = Admission()
        self.admission.pending_bytes = lambda: frontend.pending_bytes
        self.admission.max_pending_bytes = config.max_pending_bytes
        self._streams = 0  # generate() calls in progress
        self.nursery: trio.Nursery | None = None  # open_engine's, for sends of its own
        self._counter = itertools.count()

    def new_rid(self, prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:12]}-{next(self._counter)}"

    @property
    def alive(self) -> bool:
        """Not stopped and not dead (it may be draining)."""
        return self.admission.gate in (Gate.OPEN, Gate.DRAINING)

    @property
    def dead_reason(self) -> str | None:
        return self.admission.reason

    @property
    def died(self) -> trio.Event:
        return self.admission.died

    @property
    def unresponsive(self) -> str | None:
        """Why the engine looks frozen (``Supervisor.late``: a child's heartbeats are
        late), or None. ``/health`` says 503 long before the child would be killed; new
        work is still admitted (a late child may only be slow)."""
        if self.supervisor is None or not self.alive:
            return None
        return self.supervisor.late()

    async def submit(self, request: GenerateRequest, *, reserved: bool = False,
                     final_only: bool = False) -> OutputCollector:
        """Register and dispatch; read the returned collector for outputs.

        Raises RequestError(code="engine_dead") once the engine is dead or stopping, and
        InvalidRequest for a non-zero ``priority`` unless the policy is ``priority``.
        ``reserved``: the caller holds an ``admission.reserve()`` made before a drain
        began, so only a stopped or dead engine refuses it. ``final_only``: the collector
        gives one output, everything merged, when the request ends (no stream).
        """
        if request.params.priority and self.config.scheduling_policy != "priority":
            raise InvalidRequest("priority is only honoured with --scheduling-policy "
                                 f"priority, got {request.params.priority}", "priority")
        if not (reserved and self.alive):
            refused = self.admission.refusal()
            if refused is not None:
                raise RequestError(str(refused), FailureCode.ENGINE_DEAD)
        collector = await self.frontend.submit(request, final_only=final_only)
        if not self.alive:  # it died while we dispatched: fail what we just registered
            self.frontend.lose_all(self.dead_reason or "the engine is not running")
        return collector

    async def abort(self, rid: str, reason: str = "user") -> None:
        """Stop ``rid``; ``reason`` labels the ``aborted_requests`` metric."""
        await self.frontend.abort(rid, reason)

    async def generate(self, request: GenerateRequest, *, final_only: bool = False
                       ) -> AsyncIterator[RequestOutput]:
        """Stream deltas for one request; leaving early (or being cancelled) aborts it.
        ``final_only``: one output, at the end, instead of the deltas."""
        collector = await self.submit(request, final_only=final_only)
        self._streams += 1
        try:
            async for out in collector:
                yield out
        finally:
            self._streams -= 1
            collector.discard()  # what was not read no longer counts as waiting
            if not collector.finished:
                with trio.CancelScope(shield=True):
                    await self.frontend.abort(request.rid, "client_disconnect")

    def mark_dead(self, reason: str) -> None:
        """A process of this engine died: fail every live request and refuse new ones."""
        if not self.admission.kill(reason):
            return
        lost = self.frontend.lose_all(reason)
        log.error("engine dead: %s; %d live requests failed", reason, lost)

    def lose_replica(self, role: str, reason: str) -> bool:
        """A data-parallel replica's process died. With ``on_engine_death`` "stay" and
        another replica alive, fail only the requests routed to it and serve on (True);
        else False: the caller kills the whole engine (``mark_dead``)."""
        assert self.supervisor is not None
        live = [r for r in self.supervisor.live_replicas() if r != role]
        if self.config.on_engine_death != "stay" or not live or not self.alive:
            return False
        replica = split_role(role)[1] or 0
        lost = self.frontend.lose_all(reason, replica=replica)
        if self.nursery is not None and "detokenizer" in self.mailboxes:
            # Its decode state for those requests goes too (the Detokenizer owns it).
            self.nursery.start_soon(self.mailboxes["detokenizer"].send, ReplicaLost(replica))
        self.metrics.replica_deaths.inc()
        log.error("replica %d lost: %s; %d of its requests failed, %d replicas serve on",
                  replica, reason, lost, len(live))
        return True

    @property
    def busy(self) -> bool:
        """Requests are registered, or generate() streams are still being read."""
        return bool(self.frontend.registry) or self._streams > 0

    def drain_problems(self) -> list[str]:
        """Everything still held anywhere (invariant 4); empty when the engine is idle.

        Actors and mailboxes of this process are checked now. Those in child
        processes are reported as of their latest answer to ``wait_drained``.
        """
        problems = self._local_problems()
        if self.supervisor is not None:
            problems += self.supervisor.remote_problems()
        return problems

    async def wait_drained(self, timeout: float = 10.0) -> list[str]:
        """Wait until nothing is held (or the timeout passes); returns what is left."""
        with trio.move_on_after(timeout):
            while True:
                # Ask the children (a round trip) only once this process is clean: until
                # then the engine is not drained anyway.
                if self.supervisor is not None and not self._local_problems():
                    await self.supervisor.query_drain(timeout=2.0)
                if not self.drain_problems():
                    break
                await trio.sleep(0.005 if self.supervisor is None else 0.02)
        return self.drain_problems()

    def _local_problems(self) -> list[str]:
        return actor_problems(self.actors) + [
            f"mailbox {m.name} holds {m.depth}" for m in self.mailboxes.values() if m.depth]

    def update_gauges(self) -> None:
        """Copy the latest Scheduler stats and mailbox depths into the metrics."""
        s, m = self.frontend.stats, self.metrics
        m.num_requests_running.set(s.num_running)
        m.num_requests_waiting.set(s.num_waiting)
        m.kv_cache_usage_perc.set(s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total
                                  else 0.0)
        m.on_stats(s)
        router = self.frontend.router
        for r, stats in enumerate(router.stats):
            m.on_replica_stats(stats, router.load[r], router.routed[r], r not in router.dead)
        for box in self.mailboxes.values():
            m.mailbox_depth.labels(mailbox=box.name).set(box.depth)
            m.mailbox_high_water.labels(mailbox=box.name).set(box.high_water)
        if self.supervisor is not None:
            for child in self.supervisor.children.values():
                for stat in child.mailboxes:
                    m.mailbox_depth.labels(mailbox=stat.name).set(stat.depth)
                    m.mailbox_high_water.labels(mailbox=stat.name).set(stat.high_water)


def _may_handle_sigterm() -> bool:
    return (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None))


@asynccontextmanager
async def open_engine(config: EngineConfig | None = None, *,
                      resources: Resources | None = None,
                      handle_sigterm: bool | None = None) -> AsyncIterator[AsyncEngine]:
    """Start the actors of ``config.topology`` (and its child processes); stop them on exit.

    Raises :class:`EngineStartError` if a child process cannot start. With a
    multi-process topology and ``handle_sigterm`` left at None, a SIGTERM while no
    other handler is installed drains live requests (up to SIGTERM_DRAIN_TIMEOUT),
    stops the children, removes the socket directory, and then lets SIGTERM end
    the process as it would have; pass False when the application handles SIGTERM
    itself (and leaves this context to stop).
    """
    config = config or EngineConfig()
    if resources is None:
        resources = await trio.to_thread.run_sync(Resources, config)
    roles = child_roles(config.topology, config.data_parallel_size)
    parts = await _main_parts(config, resources)
    tracer = _open_tracer(config)
    ipc = IpcDir() if roles else None
    wiring: Wiring | None = None
    supervisor: Supervisor | None = None
    stopped = False

    async def stop() -> None:
        """Stop children, close sockets, remove the directory (idempotent, shielded)."""
        nonlocal stopped
        if stopped:
            return
        stopped = True
        with trio.CancelScope(shield=True):
            if supervisor is not None:
                await supervisor.shutdown()
            if wiring is not None:
                wiring.close()
            if ipc is not None:
                ipc.remove()

    try:
        if ipc is not None and "detokenizer" in roles:
            # The detokenizer child decodes with exactly this process's tokenizer.
            with open(ipc.file(TOKENIZER_FILE), "w") as f:
                f.write(resources.hf_tokenizer.backend_tokenizer.to_str())
        wiring = Wiring(MAIN, config.topology, config.mailbox_capacity, ipc,
                        replicas=config.data_parallel_size,
                        local_replicas=config.local_replicas)
        set_hop_hooks(wiring, tracer)
        actors = build_actors(MAIN, wiring, config, parts, tracer)
        engine = AsyncEngine(config, resources, actors["frontend"], actors, wiring.inboxes)
        async with trio.open_nursery() as nursery:
            for name, actor in actors.items():
                nursery.start_soon(_run_actor, engine, name, actor, name=f"actor:{name}")
            engine.nursery = nursery
            await _worker_ready(actors)
            if ipc is not None:
                supervisor = Supervisor(config, ipc, on_death=engine.mark_dead,
                                        on_replica_death=engine.lose_replica, wiring=wiring)
                engine.supervisor = supervisor
                await supervisor.start(nursery)
                if handle_sigterm or (handle_sigterm is None and _may_handle_sigterm()):
                    nursery.start_soon(_drain_on_sigterm, engine, stop)
            try:
                yield engine
            finally:
                engine.admission.stop()
                await stop()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        error = sole_error(group)
        if isinstance(error, EngineStartError):
            raise error from None
        raise
    finally:
        await stop()
        # Closed only here, once the nursery has exited: an actor woken with a message
        # just before the cancel still runs one more step, and that step may trace.
        if tracer is not None:
            tracer.close()


async def _worker_ready(actors: dict[str, Any]) -> None:
    """Wait until an in-process Worker's step thread waits for its first plan
    (``Worker.ready``). Requests must not come before: a burst of them keeps the event
    loop busy, and a thread that starts meanwhile waits for the GIL (the 5 ms switch
    interval, again and again), so the first step started only once the burst was in
    (``LLM.generate``, 256 prompts: ~25 ms a call). vLLM's engine is ready before it
    serves too."""
    ready = getattr(actors.get("worker"), "ready", None)
    if ready is not None:
        await ready.wait()


async def _main_parts(config: EngineConfig, resources: Resources) -> Parts:
    """What the actors placed in this process are built from (weights only if the Worker
    is one of them)."""
    parts = Parts(info=resources.info, hf_tokenizer=resources.hf_tokenizer)
    place = PLACEMENTS[config.topology]
    if place["worker"] == MAIN:
        parts.runner = resources.runner or await trio.to_thread.run_sync(
            resources.load_runner, config)
        check_runner_draft(getattr(parts.runner, "draft", None), config.speculative)
    if place["detokenizer"] == MAIN:
        from actorllm.detokenizer.decoding import hf_decode_fn

        parts.decode = hf_decode_fn(resources.hf_tokenizer)
    return parts


def _open_tracer(config: EngineConfig) -> Tracer | None:
    """The trace file ``config.trace`` names, its header written (None: no tracing)."""
    if not config.trace:
        return None
    tracer = Tracer(config.trace, hops=config.trace_hops)
    tracer.header(config.model, config.as_dict(), load_spec().version)
    return tracer


async def _run_actor(engine: AsyncEngine, name: str, actor: Any) -> None:
    """Run one actor of this process; if it raises, the engine is dead (as if a child
    process had exited): live requests fail with ``engine_dead`` instead of the error
    tearing down the HTTP server that shares this nursery."""
    try:
        await actor.run()
    except Exception as exc:
        if not engine.alive:  # stopping anyway: let it surface as it always did
            raise
        log.exception("the %s actor failed", name)
        cause = sole_error(exc)  # actors run their tasks in nurseries of their own
        engine.mark_dead(f"the {name} actor failed: {type(cause).__name__}: {cause}")


async def _drain_on_sigterm(engine: AsyncEngine, stop: Any) -> None:
    """On SIGTERM: refuse new requests, let live ones finish, stop, then die of SIGTERM."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            break
    # Leaving the receiver restored the default action: a second SIGTERM ends us at once
    # (and the children, through their parent-death signal).
    log.warning("SIGTERM: draining %d live requests (at most %g s)",
                len(engine.frontend.registry), SIGTERM_DRAIN_TIMEOUT)
    engine.admission.drain()
    with trio.move_on_after(SIGTERM_DRAIN_TIMEOUT):
        while engine.busy:
            await trio.sleep(0.02)
    await stop()
    log.warning("SIGTERM: drained and stopped; exiting")
    logging.shutdown()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    await trio.sleep_forever()
