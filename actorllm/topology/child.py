"""A child process of a multi-process topology: its command line, entry point and control loop.

``python -m actorllm.topology ROLE CONFIG_JSON DIR PPID LEVEL`` runs :func:`main`.
The child binds its inboxes and ``<role>.ctl``, shakes hands with the parent over
``parent.ctl``, loads its :class:`~actorllm.topology.placement.Parts`, runs its
actors, and answers the parent's ``Heartbeat`` and ``DrainQuery`` until told to
``Shutdown``. The constants of that control protocol live here; the parent's side
(:mod:`actorllm.topology.supervisor`) imports them.

No orphans. A child asks the kernel for SIGHUP when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), checks ``getppid()`` at start and every heartbeat,
and exits if the parent's heartbeats stop for ``PARENT_TIMEOUT``. A child whose
parent died removes the socket directory on its way out. SIGTERM (the parent's
last-resort stop) and SIGHUP both end a child cleanly. Once a child begins to
exit, ``alarm(SHUTDOWN_GRACE)`` guarantees that it does. Children ignore SIGINT: a
Ctrl-C reaches the parent, which stops them in order.

A data-parallel replica on another host (``actorllm replica``,
:mod:`actorllm.topology.remote`) runs this same code through :func:`run_child`, with
TCP endpoints for the ipc ones, no parent process id to watch (its parent's heartbeats
and the rendezvous store tell it the main host is gone) and :class:`RemoteHooks` that
publish where it listens and mark a clean stop.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
import signal
import sys
from typing import Any, Protocol

import attrs
import trio

from actorllm.config import EngineConfig, read_model_info
from actorllm.lifecycle.trace import Tracer
from actorllm.topology.placement import (
    Parts,
    Wiring,
    actor_problems,
    build_actors,
    build_runner,
    set_hop_hooks,
    split_role,
)
from actorllm.wire.control import (
    DrainQuery,
    DrainReport,
    Heartbeat,
    Hello,
    Ready,
    Shutdown,
    StartFailed,
)
from actorllm.wire.handshake import HandshakeError, check_hello, make_hello
from actorllm.wire.messages import ControlMessage
from actorllm.wire.transport import IpcDir, ZmqInbox, ZmqOutbox, context

log = logging.getLogger(__name__)

CONTROL_CAPACITY = 256
PARENT_CTL = "parent.ctl"
TOKENIZER_FILE = "tokenizer.json"  # the parent's tokenizer, for a detokenizer child

HEARTBEAT_INTERVAL = 0.5  # both directions
PARENT_TIMEOUT = 10.0  # a parent silent this long is presumed gone
# A ready replica on another host silent this long is dead to its parent (no process to
# watch; a false alarm only loses that replica's requests with --on-engine-death stay).
REMOTE_TIMEOUT = 3.0
HANDSHAKE_TIMEOUT = 30.0
SHUTDOWN_GRACE = 5  # seconds a child may take to stop before it is killed
CONTROL_LINGER_MS = 1000  # a child's last control messages get this long to leave

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_HANDSHAKE = 3
EXIT_ORPHANED = 4


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
    if split_role(role)[0] == "engine":  # (engine0, engine1, ...: data-parallel replicas)
        info = read_model_info(config.model, config.max_model_len)
        return Parts(info=info, runner=build_runner(config, info))
    if role == "detokenizer":
        import tokenizers

        from actorllm.detokenizer.decoding import TokenizerDecode
        from actorllm.text.hf import serial_tokenizers

        serial_tokenizers()  # (inherited from the parent too, unless it was started apart)
        path = ipc.file(TOKENIZER_FILE)
        try:
            backend = tokenizers.Tokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises its own exception type
            raise ValueError(f"cannot load the tokenizer from {path}: {exc}") from None
        # TokenizerDecode, not a bare function: the Detokenizer's piece table needs it.
        return Parts(decode=TokenizerDecode(backend))
    raise ValueError(f"unknown role {role!r}")


class RemoteHooks(Protocol):
    """What a replica on another host adds to a child's life (see module docstring)."""

    def announce(self, ctl: ZmqInbox[Any], wiring: Wiring) -> None:
        """Its inboxes are bound: say where, before the Hello."""

    def stopping(self) -> None:
        """The parent said Shutdown: the main host going away now is no loss."""


@attrs.define
class _ChildExit:
    code: int = EXIT_OK


def sole_error(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-member exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _begin_exit(why: str) -> None:
    log.info("exiting: %s", why)
    signal.alarm(SHUTDOWN_GRACE)  # SIGALRM's default action ends us if cleanup hangs


async def _child_main(role: str, config: EngineConfig, ipc: IpcDir, parent_pid: int | None,
                      remote: RemoteHooks | None) -> int:
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
        if remote is not None:
            remote.announce(ctl_in, wiring)
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
            result.code = await _child_body(role, config, ipc, parent_pid, ctl_in, ctl_out,
                                            wiring, remote)
            nursery.cancel_scope.cancel()
    finally:
        wiring.close()
        ctl_in.close()
        ctl_out.close()
        if orphaned.is_set() or result.code == EXIT_ORPHANED or (
                parent_pid is not None and os.getppid() != parent_pid):
            ipc.remove()  # nobody else is left to do it
    return result.code


async def _child_body(role: str, config: EngineConfig, ipc: IpcDir, parent_pid: int | None,
                      ctl_in: ZmqInbox[Any], ctl_out: ZmqOutbox[Any], wiring: Wiring,
                      remote: RemoteHooks | None) -> int:
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
                                            actors, remote)
                nursery.cancel_scope.cancel()
        except Exception as exc:
            # An actor crashed: tell the parent why before the exit code does.
            error = sole_error(exc)
            try:
                ctl_out.send_nowait(StartFailed(role, f"{type(error).__name__}: {error}"))
            except trio.WouldBlock:
                pass
            raise
        return code
    finally:
        if tracer is not None:
            tracer.close()


async def _serve_control(role: str, parent_pid: int | None, ctl_in: ZmqInbox[Any],
                         ctl_out: ZmqOutbox[Any], wiring: Wiring,
                         actors: dict[str, Any], remote: RemoteHooks | None) -> int:
    """Answer the parent until it says Shutdown or is gone; returns the exit code."""
    last_heard = trio.current_time()
    code = EXIT_OK
    async with trio.open_nursery() as nursery:

        async def watchdog() -> None:
            nonlocal code
            for seq in itertools.count(1):
                await trio.sleep(HEARTBEAT_INTERVAL)
                silent = trio.current_time() - last_heard
                if silent > PARENT_TIMEOUT or (parent_pid is not None
                                               and os.getppid() != parent_pid):
                    _begin_exit(f"parent {parent_pid or ''} is gone (silent {silent:.1f} s)")
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
                if remote is not None:
                    remote.stopping()
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
    return run_child(role, config, IpcDir(ipc_path, owner=False), parent_pid)


def run_child(role: str, config: EngineConfig, ipc: IpcDir, parent_pid: int | None,
              remote: RemoteHooks | None = None) -> int:
    """Run child ``role`` until it stops; returns its exit code. ``parent_pid`` None and
    ``remote``: a replica on another host (:mod:`actorllm.topology.remote`)."""
    try:
        code = trio.run(_child_main, role, config, ipc, parent_pid, remote)
    except BaseException:
        log.exception("%s process crashed", role)
        code = EXIT_FAILED
    # Every socket is closed; terminating the context lets the lingering ones finish
    # (the caller's os._exit would otherwise cut ZeroMQ's I/O thread short).
    context().destroy(linger=0)
    log.info("%s process: exit code %d", role, code)
    return code
