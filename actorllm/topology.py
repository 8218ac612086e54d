"""Topologies: which actor runs in which process, the child processes, and their supervisor.

Three placements of the same five actors (``--topology``):

    single    main: Frontend Tokenizer Scheduler Worker Detokenizer
    engine    main: Frontend Tokenizer Detokenizer | engine: Scheduler Worker       (vLLM-like)
    pipeline  main: Frontend Tokenizer | engine: Scheduler Worker | detokenizer: Detokenizer
                                                                                (SGLang-like)

"main" is the process that called :func:`actorllm.engine.open_engine` (the API
process); the others are children it starts with ``python -m actorllm.topology``.

Sockets. All live in one private 0700 directory (:class:`~actorllm.transport.IpcDir`),
removed when the engine stops. An inbox that hears from another process is a
:class:`~actorllm.transport.ZmqInbox` bound at ``<dir>/<actor>.sock``; each edge that
leaves a process is its own PUSH socket connected there, so every edge keeps its
FIFO order (an abort never overtakes its request). Edges inside a process stay
trio memory channels. Control traffic has its own sockets: the parent binds
``parent.ctl``, each child binds ``<role>.ctl``.

Start-up. The parent binds its sockets, spawns each child (``subprocess``; the
config travels as JSON, never pickle) and waits. A child binds its sockets, sends
``Hello``; the parent checks it and answers with its own ``Hello``, which the child
checks in turn (protocol, codec version and message-schema fingerprint: a mismatch
is refused on both sides with an error naming the difference). Then the child
loads what it needs (the engine child: the model and KV cache; the detokenizer
child: the tokenizer the parent wrote as ``tokenizer.json``), starts its actors and
sends ``Ready``, or ``StartFailed`` with the reason and exits 1. The parent raises
:class:`EngineStartError` with that reason, or with the exit code of a child that
died without one, or after ``READY_TIMEOUT``.

Supervision policy: no restart. Both sides send a ``Heartbeat`` every
``HEARTBEAT_INTERVAL``. The parent learns of a child's exit at once (a pidfd in
trio's loop). When a child dies after start-up (or stops heart-beating for
``CHILD_TIMEOUT`` and is killed), the whole engine is dead: ``AsyncEngine.alive``
becomes False, every live request fails with ``RequestError(code="engine_dead")``
saying ``"<role> process exited with code N"``, new requests are refused with the
same message, and the remaining children are stopped when the engine context
exits. Restarting would need generation numbers on every message and a replay of
lost requests; a supervisor above actorllm (systemd, Kubernetes) restarts the
whole server instead, with /health telling it when.

No orphans. A child asks the kernel for SIGHUP when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), checks ``getppid()`` at start and every heartbeat,
and exits if the parent's heartbeats stop for ``PARENT_TIMEOUT``. A child whose
parent died removes the socket directory on its way out. SIGTERM (the parent's
last-resort stop) and SIGHUP both end a child cleanly. Once a child begins to
exit, ``alarm(SHUTDOWN_GRACE)`` guarantees that it does. Children ignore SIGINT: a
Ctrl-C reaches the parent, which stops them in order.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from actorllm import codec
from actorllm.config import EngineConfig, ModelInfo
from actorllm.mailbox import Mailbox, Outbox
from actorllm.messages import (
    ControlMessage,
    DetokenizerInput,
    DrainQuery,
    DrainReport,
    FrontendInput,
    Heartbeat,
    Hello,
    MailboxStat,
    Ready,
    SchedulerInput,
    Shutdown,
    StartFailed,
    TokenizerInput,
    WorkerInput,
)
from actorllm.trace import Tracer
from actorllm.transport import (
    HandshakeError,
    IpcDir,
    ZmqInbox,
    ZmqOutbox,
    check_hello,
    context,
    frame_version,
    make_hello,
)

log = logging.getLogger(__name__)

ACTORS = ("frontend", "tokenizer", "scheduler", "worker", "detokenizer")
MAIN = "main"

PLACEMENTS: dict[str, dict[str, str]] = {
    "single": dict.fromkeys(ACTORS, MAIN),
    "engine": {"frontend": MAIN, "tokenizer": MAIN, "detokenizer": MAIN,
               "scheduler": "engine", "worker": "engine"},
    "pipeline": {"frontend": MAIN, "tokenizer": MAIN, "scheduler": "engine",
                 "worker": "engine", "detokenizer": "detokenizer"},
}

# (sender, receiving inbox): every edge of DESIGN.md section 1.
EDGES: tuple[tuple[str, str], ...] = (
    ("frontend", "tokenizer"),
    ("tokenizer", "scheduler"),
    ("tokenizer", "frontend"),
    ("scheduler", "worker"),
    ("scheduler", "detokenizer"),
    ("worker", "scheduler"),
    ("detokenizer", "frontend"),
    ("detokenizer", "scheduler"),
)

INBOX_TYPES: dict[str, Any] = {
    "tokenizer": TokenizerInput,
    "scheduler": SchedulerInput,
    "worker": WorkerInput,
    "detokenizer": DetokenizerInput,
    "frontend": FrontendInput,
}

WORKER_CAPACITY = 2  # one step in flight, one queued: more would only add latency
CONTROL_CAPACITY = 256
PARENT_CTL = "parent.ctl"
TOKENIZER_FILE = "tokenizer.json"  # the parent's tokenizer, for a detokenizer child

HEARTBEAT_INTERVAL = 0.5
CHILD_TIMEOUT = 10.0  # parent side: a child silent this long is killed
PARENT_TIMEOUT = 10.0  # child side: a parent silent this long is presumed gone
HANDSHAKE_TIMEOUT = 30.0
READY_TIMEOUT = 300.0  # loading a large model can take minutes; failures report at once
SHUTDOWN_GRACE = 5  # seconds a child may take to stop before it is killed
CONTROL_LINGER_MS = 1000  # a child's last control messages get this long to leave

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_HANDSHAKE = 3
EXIT_ORPHANED = 4


class EngineStartError(RuntimeError):
    """A child process could not start; the message says which and why."""


def child_roles(topology: str) -> tuple[str, ...]:
    """The child processes a topology needs, in start order."""
    return tuple(dict.fromkeys(r for r in PLACEMENTS[topology].values() if r != MAIN))


def describe_exit(code: int) -> str:
    """``1``, or ``-9 (killed by SIGKILL)``."""
    if code < 0:
        try:
            return f"{code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


# --- one process's mailboxes and actors ------------------------------------------------


class Wiring:
    """The mailboxes of one process in one topology.

    ``inboxes[actor]`` for each actor placed here: a :class:`ZmqInbox` (with a bound
    socket) when some sender lives elsewhere, else a plain :class:`Mailbox`.
    ``out(sender, target)``: the target's inbox when it is local, else a
    :class:`ZmqOutbox` of its own for that edge.
    """

    def __init__(self, role: str, topology: str, capacity: int, ipc: IpcDir | None) -> None:
        place = PLACEMENTS[topology]
        self.role = role
        self.inboxes: dict[str, Mailbox[Any]] = {}
        self.outboxes: dict[tuple[str, str], Outbox[Any]] = {}
        self.remote_inboxes: list[ZmqInbox[Any]] = []
        self.remote_outboxes: list[ZmqOutbox[Any]] = []
        try:
            for actor in ACTORS:
                if place[actor] != role:
                    continue
                cap = WORKER_CAPACITY if actor == "worker" else capacity
                if any(place[s] != role for s, t in EDGES if t == actor):
                    assert ipc is not None, "a multi-process topology needs an IpcDir"
                    inbox: Mailbox[Any] = ZmqInbox(actor, INBOX_TYPES[actor], cap,
                                                   ipc.endpoint(f"{actor}.sock"))
                    self.remote_inboxes.append(inbox)  # type: ignore[arg-type]
                else:
                    inbox = Mailbox(actor, INBOX_TYPES[actor], cap)
                self.inboxes[actor] = inbox
            for sender, target in EDGES:
                if place[sender] != role:
                    continue
                if place[target] == role:
                    self.outboxes[(sender, target)] = self.inboxes[target]
                else:
                    assert ipc is not None
                    box: ZmqOutbox[Any] = ZmqOutbox(
                        ipc.endpoint(f"{target}.sock"), INBOX_TYPES[target],
                        name=f"{sender}->{target}", hwm=capacity)
                    self.outboxes[(sender, target)] = box
                    self.remote_outboxes.append(box)
        except BaseException:
            self.close()
            raise

    def out(self, sender: str, target: str) -> Outbox[Any]:
        return self.outboxes[(sender, target)]

    def problems(self) -> list[str]:
        """Messages still waiting in this process's mailboxes (invariant 4)."""
        return [f"mailbox {m.name} holds {m.depth}" for m in self.inboxes.values() if m.depth]

    def stats(self) -> tuple[MailboxStat, ...]:
        return tuple(MailboxStat(m.name, m.depth, m.high_water) for m in self.inboxes.values())

    @property
    def rejected(self) -> int:
        """Frames refused by this process's data sockets so far."""
        return sum(box.rejected for box in self.remote_inboxes)

    def close(self) -> None:
        for box in self.remote_outboxes:
            box.close()
        for inbox in self.remote_inboxes:
            inbox.close()


@attrs.define
class Parts:
    """What the actors of one process are built from (each process loads only its own)."""

    info: ModelInfo | None = None
    hf_tokenizer: Any = None
    runner: Any = None  # actorllm.worker.ModelRunner
    decode: Any = None  # actorllm.detokenizer.DecodeFn


def build_actors(role: str, wiring: Wiring, config: EngineConfig, parts: Parts,
                 tracer: Tracer | None) -> dict[str, Any]:
    """The actors placed in ``role`` by ``config.topology``, wired to ``wiring``."""
    from actorllm.detokenizer import Detokenizer
    from actorllm.frontend import Frontend
    from actorllm.scheduler import Scheduler
    from actorllm.tokenizer import PromptEncoder, Tokenizer

    place = PLACEMENTS[config.topology]
    inbox, out = wiring.inboxes, wiring.out
    actors: dict[str, Any] = {}
    if place["frontend"] == role:
        actors["frontend"] = Frontend(inbox["frontend"], out("frontend", "tokenizer"),
                                      tracer=tracer)
    if place["tokenizer"] == role:
        assert parts.info is not None
        actors["tokenizer"] = Tokenizer(PromptEncoder(parts.hf_tokenizer, parts.info),
                                        inbox["tokenizer"], out("tokenizer", "scheduler"),
                                        out("tokenizer", "frontend"), tracer)
    if place["scheduler"] == role:
        actors["scheduler"] = Scheduler(
            inbox["scheduler"], out("scheduler", "worker"), out("scheduler", "detokenizer"),
            num_blocks=parts.runner.num_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, tracer=tracer,
        )
    if place["worker"] == role:
        from actorllm.worker import Worker  # torch: only where a Worker lives

        actors["worker"] = Worker(parts.runner, inbox["worker"], out("worker", "scheduler"))
    if place["detokenizer"] == role:
        actors["detokenizer"] = Detokenizer(parts.decode, inbox["detokenizer"],
                                            out("detokenizer", "frontend"),
                                            out("detokenizer", "scheduler"))
    return actors


def actor_problems(actors: dict[str, Any]) -> list[str]:
    """What the actors still hold; the Worker's share is its runner's per-rid state."""
    problems: list[str] = []
    for actor in actors.values():
        check = getattr(actor, "drain_problems", None)
        if check is not None:
            problems += check()
            continue
        runner = getattr(actor, "runner", None)
        if runner is not None and runner.num_states:
            problems.append(f"worker holds sampling state for {runner.num_states} rids")
    return problems


def set_hop_hooks(wiring: Wiring, tracer: Tracer | None) -> None:
    if tracer is not None and tracer.hops:
        for box in wiring.inboxes.values():
            box.hop_hook = lambda name, kind, msg: tracer.hop(name, name, kind, msg)


# --- the child process ---------------------------------------------------------------------


def child_argv(role: str, config: EngineConfig, ipc: IpcDir) -> list[str]:
    """The command line that starts child ``role`` of this process."""
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return [sys.executable, "-m", "actorllm.topology", role, json.dumps(config.as_dict()),
            ipc.path, str(os.getpid()), str(level)]


def set_parent_death_signal(sig: int = signal.SIGHUP) -> bool:
    """Ask Linux to send ``sig`` when the parent dies (PR_SET_PDEATHSIG); False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, sig, 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def load_parts(role: str, config: EngineConfig, ipc: IpcDir) -> Parts:
    """Load what child ``role`` needs. Raises with a one-line reason on failure."""
    if role == "engine":
        from actorllm.config import read_model_info
        from actorllm.engine import build_runner

        info = read_model_info(config.model, config.max_model_len)
        return Parts(info=info, runner=build_runner(config, info))
    if role == "detokenizer":
        import tokenizers

        path = ipc.file(TOKENIZER_FILE)
        try:
            backend = tokenizers.Tokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises its own exception type
            raise ValueError(f"cannot load the tokenizer from {path}: {exc}") from None

        def decode(ids: Any, skip_special: bool) -> str:
            return backend.decode(list(ids), skip_special_tokens=skip_special)

        return Parts(decode=decode)
    raise ValueError(f"unknown role {role!r}")


@attrs.define
class _ChildExit:
    code: int = EXIT_OK


def _sole_error(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-member exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _begin_exit(why: str) -> None:
    log.info("exiting: %s", why)
    signal.alarm(SHUTDOWN_GRACE)  # SIGALRM's default action ends us if cleanup hangs


async def _child_main(role: str, config: EngineConfig, ipc: IpcDir, parent_pid: int) -> int:
    result = _ChildExit()
    orphaned = trio.Event()
    ctl_in: ZmqInbox[Any] = ZmqInbox(f"{role}.ctl", ControlMessage, CONTROL_CAPACITY,
                                     ipc.endpoint(f"{role}.ctl"))
    # Lingers: a StartFailed sent just before exiting must still reach the parent.
    ctl_out: ZmqOutbox[Any] = ZmqOutbox(ipc.endpoint(PARENT_CTL), ControlMessage,
                                        name=f"{role}->parent", hwm=CONTROL_CAPACITY,
                                        linger_ms=CONTROL_LINGER_MS)
    wiring = Wiring(role, config.topology, config.mailbox_capacity, ipc)
    try:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
                    async for signum in signals:
                        if signum == signal.SIGHUP:  # our parent-death signal
                            orphaned.set()
                        _begin_exit(signal.Signals(signum).name)
                        result.code = EXIT_OK
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(on_signal)
            nursery.start_soon(ctl_in.pump)
            for inbox in wiring.remote_inboxes:
                nursery.start_soon(inbox.pump)
            result.code = await _child_body(role, config, ipc, parent_pid, ctl_in, ctl_out,
                                            wiring)
            nursery.cancel_scope.cancel()
    finally:
        wiring.close()
        ctl_in.close()
        ctl_out.close()
        if orphaned.is_set() or os.getppid() != parent_pid or result.code == EXIT_ORPHANED:
            ipc.remove()  # nobody else is left to do it
    return result.code


async def _child_body(role: str, config: EngineConfig, ipc: IpcDir, parent_pid: int,
                      ctl_in: ZmqInbox[Any], ctl_out: ZmqOutbox[Any], wiring: Wiring) -> int:
    await ctl_out.send(make_hello(role))
    hello: Any = None
    with trio.move_on_after(HANDSHAKE_TIMEOUT):
        hello = await ctl_in.receive()
    if hello is None:
        log.error("%s process: no Hello from the parent in %g s", role, HANDSHAKE_TIMEOUT)
        return EXIT_HANDSHAKE
    try:
        if not isinstance(hello, Hello):
            raise HandshakeError(f"expected Hello from the parent, got {type(hello).__name__}")
        check_hello(hello, expect_role="parent")
    except HandshakeError as exc:
        log.error("%s process: refusing the parent: %s", role, exc)
        await ctl_out.send(StartFailed(role, f"refused by the {role} process: {exc}"))
        return EXIT_HANDSHAKE
    try:
        parts = await trio.to_thread.run_sync(load_parts, role, config, ipc,
                                              abandon_on_cancel=True)
    except Exception as exc:
        log.exception("%s process failed to start", role)
        await ctl_out.send(StartFailed(role, str(exc) or type(exc).__name__))
        return EXIT_FAILED
    tracer = Tracer(config.trace, hops=config.trace_hops) if config.trace else None
    try:
        set_hop_hooks(wiring, tracer)
        actors = build_actors(role, wiring, config, parts, tracer)
        try:
            async with trio.open_nursery() as nursery:
                for name, actor in actors.items():
                    nursery.start_soon(actor.run, name=f"actor:{name}")
                await ctl_out.send(Ready(role, os.getpid()))
                code = await _serve_control(role, parent_pid, ctl_in, ctl_out, wiring,
                                            actors)
                nursery.cancel_scope.cancel()
        except Exception as exc:
            # An actor crashed: tell the parent why before the exit code does.
            error = _sole_error(exc)
            try:
                ctl_out.send_nowait(StartFailed(role, f"{type(error).__name__}: {error}"))
            except trio.WouldBlock:
                pass
            raise
        return code
    finally:
        if tracer is not None:
            tracer.close()


async def _serve_control(role: str, parent_pid: int, ctl_in: ZmqInbox[Any],
                         ctl_out: ZmqOutbox[Any], wiring: Wiring,
                         actors: dict[str, Any]) -> int:
    """Answer the parent until it says Shutdown or is gone; returns the exit code."""
    last_heard = trio.current_time()
    code = EXIT_OK
    async with trio.open_nursery() as nursery:

        async def watchdog() -> None:
            nonlocal code
            for seq in itertools.count(1):
                await trio.sleep(HEARTBEAT_INTERVAL)
                silent = trio.current_time() - last_heard
                if os.getppid() != parent_pid or silent > PARENT_TIMEOUT:
                    _begin_exit(f"parent {parent_pid} is gone (silent {silent:.1f} s)")
                    code = EXIT_ORPHANED
                    nursery.cancel_scope.cancel()
                    return
                try:
                    ctl_out.send_nowait(Heartbeat(role, seq, wiring.stats()))
                except trio.WouldBlock:
                    pass  # the parent is not reading; its own watchdog deals with that

        nursery.start_soon(watchdog)
        async for msg in ctl_in:
            last_heard = trio.current_time()
            if isinstance(msg, DrainQuery):
                problems = actor_problems(actors) + wiring.problems()
                await ctl_out.send(DrainReport(role, msg.token, tuple(problems),
                                               wiring.rejected + ctl_in.rejected))
            elif isinstance(msg, Shutdown):
                _begin_exit(f"asked by the parent ({msg.reason})")
                break
            elif not isinstance(msg, Heartbeat):
                log.warning("%s process: unexpected control message %s", role,
                            type(msg).__name__)
        nursery.cancel_scope.cancel()
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of a child: ``python -m actorllm.topology ROLE CONFIG_JSON DIR PPID LEVEL``."""
    args = sys.argv[1:] if argv is None else argv
    role, config_json, ipc_path, parent_pid_s = args[:4]
    level = args[4] if len(args) > 4 else "WARNING"
    parent_pid = int(parent_pid_s)
    # SIGHUP, not SIGTERM: it tells "the parent died" from "the parent asks us to stop".
    # (When the parent dies, its other threads may outlive the one that forked us for a
    # moment, and getppid() still names it then: the signal is the only sure sign.)
    set_parent_death_signal(signal.SIGHUP)
    if os.getppid() != parent_pid:
        return EXIT_ORPHANED  # the parent died before the death signal was armed
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # The death signal can arrive more than once: when the forking thread dies we are
    # re-parented to another thread of the dying parent, whose death signals us again.
    # Outside trio's receiver (before it opens, after it closes) a second SIGHUP must
    # not kill us midway through cleanup; the heartbeat's getppid() check covers the
    # moment before the receiver opens.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logging.basicConfig(level=level,
                        format=f"%(asctime)s %(levelname)s [{role} %(process)d] "
                               "%(name)s: %(message)s")
    config = EngineConfig(**json.loads(config_json))
    ipc = IpcDir(ipc_path, owner=False)
    try:
        code = trio.run(_child_main, role, config, ipc, parent_pid)
    except BaseException:
        log.exception("%s process crashed", role)
        code = EXIT_FAILED
    # Every socket is closed; terminating the context lets the lingering ones finish
    # (the caller's os._exit would otherwise cut ZeroMQ's I/O thread short).
    context().destroy(linger=0)
    log.info("%s process: exit code %d", role, code)
    return code


# --- the parent's side --------------------------------------------------------------------


@attrs.define(eq=False)
class Child:
    """One child process as its supervisor sees it."""

    role: str
    proc: subprocess.Popen[bytes]
    pidfd: int | None
    exited: trio.Event = attrs.Factory(trio.Event)
    hello: Hello | None = None
    ready: bool = False
    ctl: ZmqOutbox[Any] | None = None
    last_heard: float = 0.0
    mailboxes: tuple[MailboxStat, ...] = ()
    report: DrainReport | None = None
    kill_reason: str | None = None
    crash: str | None = None  # what a crashing child said before it exited

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.poll() is None


class Supervisor:
    """Starts the children of one topology, watches them, and stops them.

    ``on_death(message)`` is called once, when a child dies after start-up. ``argv``
    overrides the command that starts a child (tests use it to run impostors).
    """

    def __init__(self, config: EngineConfig, ipc: IpcDir, *,
                 on_death: Callable[[str], None],
                 argv: Callable[[str], list[str]] | None = None,
                 ready_timeout: float = READY_TIMEOUT) -> None:
        self.config = config
        self.ipc = ipc
        self.roles = child_roles(config.topology)
        self.on_death = on_death
        self.argv = argv or (lambda role: child_argv(role, config, ipc))
        self.ready_timeout = ready_timeout
        self.children: dict[str, Child] = {}
        self.dead: str | None = None  # why the engine died, once it has
        self.stopping = False
        self._start_error: str | None = None
        self._settled = trio.Event()  # all ready, or a start error
        self._reports = trio.Event()
        self._tokens = itertools.count(1)
        self._ctl_in: ZmqInbox[Any] | None = None

    # --- start ---

    async def start(self, nursery: trio.Nursery) -> None:
        """Spawn every child and wait until all are ready; raises EngineStartError."""
        self._ctl_in = ZmqInbox(PARENT_CTL, ControlMessage, CONTROL_CAPACITY,
                                self.ipc.endpoint(PARENT_CTL), on_reject=self._on_reject)
        nursery.start_soon(self._ctl_in.pump)
        nursery.start_soon(self._control_loop)
        nursery.start_soon(self._heartbeats)  # a child that is ready early needs them
        for role in self.roles:
            child = self._spawn(role)
            nursery.start_soon(self._watch, child, name=f"watch:{role}")
        with trio.move_on_after(self.ready_timeout):
            await self._settled.wait()
        if not self._settled.is_set():
            waiting = [c.role for c in self.children.values() if not c.ready]
            self._fail_start(f"{', '.join(waiting)} process not ready after "
                             f"{self.ready_timeout:g} s")
        if self._start_error is not None:
            raise EngineStartError(self._start_error)

    def _spawn(self, role: str) -> Child:
        env = dict(os.environ)
        # The child must import this very actorllm, installed or not.
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # Popen here, in the trio thread, not trio.lowlevel.open_process: that forks from a
        # worker thread, and PR_SET_PDEATHSIG fires when the forking *thread* exits.
        proc = subprocess.Popen(self.argv(role), stdin=subprocess.DEVNULL, env=env)
        pidfd: int | None = None
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            pass  # no pidfd (old kernel): _watch polls instead
        child = Child(role, proc, pidfd, last_heard=trio.current_time())
        self.children[role] = child
        log.info("started the %s process (pid %d)", role, proc.pid)
        return child

    def _fail_start(self, message: str) -> None:
        if self._start_error is None:
            self._start_error = message
        self._settled.set()

    def _on_reject(self, data: bytes, why: str) -> None:
        version = frame_version(data)
        if version is not None and version != codec.VERSION and not self._settled.is_set():
            self._fail_start(f"a child process speaks codec version {version}, this process "
                             f"speaks {codec.VERSION}: mismatched actorllm installations")

    # --- watch ---

    async def _watch(self, child: Child) -> None:
        if child.pidfd is not None:
            try:
                await trio.lowlevel.wait_readable(child.pidfd)
            except trio.ClosedResourceError:
                pass  # shutdown() closed it: the child has been reaped
        else:
            while child.running:
                await trio.sleep(0.05)
        code = child.proc.wait()  # reaps it
        child.exited.set()
        if self.stopping:
            return
        if not child.ready:
            with trio.move_on_after(0.5):  # its StartFailed may still be in the socket
                await self._settled.wait()
            self._fail_start(f"{child.role} process exited with code {describe_exit(code)} "
                             "during start-up")
            return
        if code > 0 and child.kill_reason is None and child.crash is None:
            with trio.move_on_after(0.2):  # a crash report may still be in the socket
                while child.crash is None:
                    await trio.sleep(0.01)
        message = child.kill_reason or (f"{child.role} process exited with code "
                                        f"{describe_exit(code)}")
        if child.crash is not None:
            message += f" ({child.crash})"
        log.error("%s", message)
        if self.dead is None:
            self.dead = message
            self.on_death(message)

    async def _control_loop(self) -> None:
        assert self._ctl_in is not None
        async for msg in self._ctl_in:
            child = self.children.get(getattr(msg, "role", ""))
            if child is None:
                log.warning("control message %s from unknown role %r", type(msg).__name__,
                            getattr(msg, "role", None))
                continue
            child.last_heard = trio.current_time()
            if isinstance(msg, Hello):
                await self._on_hello(child, msg)
            elif isinstance(msg, Ready):
                child.ready = True
                log.info("the %s process (pid %d) is ready", child.role, msg.pid)
                if all(c.ready for c in self.children.values()) and \
                        len(self.children) == len(self.roles):
                    self._settled.set()
            elif isinstance(msg, StartFailed):
                if child.ready:
                    child.crash = msg.message  # it is about to exit: say why
                else:
                    self._fail_start(f"{child.role} process failed to start: {msg.message}")
            elif isinstance(msg, Heartbeat):
                child.mailboxes = msg.mailboxes
            elif isinstance(msg, DrainReport):
                child.report = msg
                self._reports.set()

    async def _on_hello(self, child: Child, hello: Hello) -> None:
        try:
            check_hello(hello, expect_role=child.role)
        except HandshakeError as exc:
            log.error("refusing the %s process: %s", child.role, exc)
            self._fail_start(str(exc))
        else:
            child.hello = hello
        # Answer either way: a mismatched child then refuses us too, with its own words.
        child.ctl = ZmqOutbox(self.ipc.endpoint(f"{child.role}.ctl"), ControlMessage,
                              name=f"parent->{child.role}", hwm=CONTROL_CAPACITY)
        await child.ctl.send(make_hello("parent"))

    async def _heartbeats(self) -> None:
        for seq in itertools.count(1):
            await trio.sleep(HEARTBEAT_INTERVAL)
            now = trio.current_time()
            for child in self.children.values():
                if child.exited.is_set() or child.ctl is None:
                    continue
                try:
                    child.ctl.send_nowait(Heartbeat("parent", seq))
                except trio.WouldBlock:
                    pass
                silent = now - child.last_heard
                if not child.ready or self.stopping:
                    continue  # loading a model sends no heartbeats; READY_TIMEOUT covers it
                if silent > CHILD_TIMEOUT and child.kill_reason is None:
                    child.kill_reason = (f"{child.role} process stopped responding "
                                         f"(no heartbeat for {silent:.1f} s)")
                    log.error("%s: killing it", child.kill_reason)
                    child.proc.kill()

    # --- drain ---

    async def query_drain(self, timeout: float = 2.0) -> list[str]:
        """Ask every live child what it still holds; returns their problems."""
        token = next(self._tokens)
        live = [c for c in self.children.values()
                if c.ready and c.ctl is not None and not c.exited.is_set()]
        for child in live:
            try:
                child.ctl.send_nowait(DrainQuery(token))  # type: ignore[union-attr]
            except trio.WouldBlock:
                pass
        with trio.move_on_after(timeout):
            while any(c.report is None or c.report.token < token for c in live
                      if not c.exited.is_set()):
                await self._reports.wait()
                self._reports = trio.Event()
        return self.remote_problems()

    def remote_problems(self) -> list[str]:
        """The children's problems as of their latest DrainReport (see query_drain)."""
        problems: list[str] = []
        for child in self.children.values():
            if child.exited.is_set():
                continue  # a dead process holds nothing
            if child.report is None:
                problems.append(f"{child.role} process: no drain report yet "
                                "(await engine.wait_drained())")
            else:
                problems += [f"{child.role} process: {p}" for p in child.report.problems]
        return problems

    @property
    def rejected_frames(self) -> dict[str, int]:
        """Frames each child's sockets refused, as of its latest DrainReport."""
        return {c.role: c.report.rejected_frames for c in self.children.values()
                if c.report is not None}

    # --- stop ---

    async def shutdown(self, reason: str = "engine stopping") -> None:
        """Stop every child: Shutdown, then SIGTERM, then SIGKILL; reap them all."""
        self.stopping = True
        for child in self.children.values():
            if not child.running:
                continue
            try:
                if not child.ready or child.ctl is None:
                    # Still loading (it reads no control messages then) or refused: SIGTERM
                    # ends it as cleanly, and at once.
                    raise trio.WouldBlock
                child.ctl.send_nowait(Shutdown(reason))
            except trio.WouldBlock:
                child.proc.terminate()
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            live = [c for c in self.children.values() if c.running]
            if not live:
                break
            for child in live:
                if sig is not None:
                    log.warning("%s process did not stop; sending %s", child.role, sig.name)
                    child.proc.send_signal(sig)
            with trio.move_on_after(SHUTDOWN_GRACE if sig is None else 2.0):
                while any(c.running for c in live):
                    await trio.sleep(0.02)
        for child in self.children.values():
            child.proc.wait()
            child.exited.set()
            if child.ctl is not None:
                child.ctl.close()
            if child.pidfd is not None:
                try:
                    trio.lowlevel.notify_closing(child.pidfd)
                except RuntimeError:
                    pass
                os.close(child.pidfd)
                child.pidfd = None
        if self._ctl_in is not None:
            self._ctl_in.close()

    def pids(self) -> dict[str, int]:
        return {role: child.pid for role, child in self.children.items()}


if __name__ == "__main__":
    # Delegate to the imported module so that its classes are the ones everyone uses.
    from actorllm.topology import main as _main

    _code = _main()
    # Like multiprocessing's children: skip interpreter finalization, which with torch and
    # transformers loaded takes seconds of freeing memory that the kernel reclaims anyway.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
