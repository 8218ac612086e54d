"""The parent's side of a multi-process topology: start, watch and stop the children.

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

Data-parallel replicas on other hosts (:mod:`actorllm.topology.remote`) are children
without a process: the Supervisor waits for them to join its rendezvous store, learns
their death from their heartbeats' silence, and tells them to stop; otherwise they are
handled as local ones.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import trio

from actorllm.config import EngineConfig
from actorllm.exit_codes import describe_exit
from actorllm.topology.child import (
    CONTROL_CAPACITY,
    HEARTBEAT_INTERVAL,
    PARENT_CTL,
    REMOTE_TIMEOUT,
    child_argv,
)
from actorllm.topology.children import Child, spawn, stop_children
from actorllm.topology.placement import child_roles, split_role
from actorllm.wire import codec, control, handshake
from actorllm.wire import transport as wire
from actorllm.wire.messages import ControlMessage

log = logging.getLogger(__name__)

CHILD_TIMEOUT = 10.0  # a child silent this long is killed
LATE_AFTER = 3 * HEARTBEAT_INTERVAL  # two beats missed: late (/health 503 until it beats)
READY_TIMEOUT = 300.0  # loading a large model can take minutes; failures report at once


class EngineStartError(RuntimeError):
    """A child process could not start; the message says which and why."""


class Supervisor:
    """Starts the children of one topology, watches them, and stops them.

    ``on_death(message)`` is called once, when a child dies after start-up. ``argv``
    overrides the command that starts a child (tests use it to run impostors). With data
    parallelism, ``on_replica_death(role, message)`` is asked first when a replica's
    process dies: True means the engine lives on without it (``--on-engine-death stay``
    and another replica lives), and ``on_death`` is not called. ``wiring``: this
    process's, needed when some replicas are remote (``config.local_replicas`` < N).
    """

    def __init__(self, config: EngineConfig, ipc: wire.IpcDir, *,
                 on_death: Callable[[str], None],
                 argv: Callable[[str], list[str]] | None = None,
                 ready_timeout: float = READY_TIMEOUT,
                 on_replica_death: Callable[[str, str], bool] | None = None,
                 wiring: Any = None) -> None:
        self.config = config
        self.wiring = wiring
        self.remote: Any = None  # actorllm.topology.remote.RemoteReplicas
        self.ipc = ipc
        self.roles = child_roles(config.topology, config.data_parallel_size)
        self.on_death = on_death
        self.on_replica_death = on_replica_death
        self.argv = argv or (lambda role: child_argv(role, config, ipc))
        self.ready_timeout = ready_timeout
        self.children: dict[str, Child] = {}
        self.dead: str | None = None  # why the engine died, once it has
        self.stopping = False
        self._start_error: str | None = None
        self._settled = trio.Event()  # all ready, or a start error
        self._reports = trio.Event()
        self._tokens = itertools.count(1)
        self._ctl_in: wire.ZmqInbox[Any] | None = None
        self.ticked = -float("inf")  # when _heartbeats last ran: this loop keeps time

    # --- start ---

    async def start(self, nursery: trio.Nursery) -> None:
        """Spawn every child and wait until all are ready; raises EngineStartError."""
        self._ctl_in = wire.ZmqInbox(PARENT_CTL, ControlMessage, CONTROL_CAPACITY,
                                     self.ipc.endpoint(PARENT_CTL), on_reject=self._on_reject)
        remote = [r for r in self.roles
                  if (split_role(r)[1] or 0) >= self.config.local_replicas]
        timeout = self.config.data_parallel_timeout if remote else self.ready_timeout
        if remote:
            from actorllm.topology.remote import RemoteReplicas  # torch.distributed's store

            try:
                self.remote = RemoteReplicas(self.config, self.wiring, self._ctl_in)
            except ValueError as exc:
                raise EngineStartError(str(exc)) from None
        nursery.start_soon(self._control_loop)
        nursery.start_soon(self._heartbeats)  # a child that is ready early needs them
        for role in self.roles:
            if role in remote:
                child = self.children[role] = Child(role, None, None)
                nursery.start_soon(self._watch_remote, child, name=f"watch:{role}")
                continue
            child = self.children[role] = spawn(role, self.argv(role))
            nursery.start_soon(self._watch, child, name=f"watch:{role}")
        with trio.move_on_after(timeout):
            await self._settled.wait()
        if not self._settled.is_set():
            waiting = [c.role for c in self.children.values() if not c.ready]
            away = [r for r in waiting if r in remote]  # the likelier cause: name it
            self._fail_start(self.remote.missing(split_role(away[0])[1], timeout) if away
                             else f"{', '.join(waiting)} process not ready after {timeout:g} s")
        if self._start_error is not None:
            raise EngineStartError(self._start_error)

    def _fail_start(self, message: str) -> None:
        if self._start_error is None:
            self._start_error = message
        self._settled.set()

    def _on_reject(self, data: bytes, why: str) -> None:
        version = handshake.frame_version(data)
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
        assert child.proc is not None
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
        self._died(child, child.kill_reason or (f"{child.role} process exited with code "
                                                f"{describe_exit(code)}"))

    async def _watch_remote(self, child: Child) -> None:
        """A replica on another host: wait for it to join, then for its heartbeats to
        stop (its death) or for it to obey a Shutdown."""
        rank, remote = split_role(child.role)[1], self.remote
        assert rank is not None and remote is not None
        failure: str | None = None
        while failure is None and not self.stopping and not remote.joined(rank):
            failure = remote.failed(rank)  # (refused before it had a control channel)
            await trio.sleep(0.05)
        while failure is None and not self.stopping and not child.ready:
            if remote.stale(rank):  # loading sends no control heartbeats; the store's go on
                failure = f"{remote.name(rank)} joined, then sent no heartbeat while loading"
            await trio.sleep(0.1)
        if failure is not None:
            child.exited.set()
            self._fail_start(failure)
            return
        last = trio.current_time()
        while not self.stopping:  # (then shutdown watches it: see _left)
            now = trio.current_time()
            # After a stall of this loop, heartbeats may wait unread in the socket: judge
            # the silence only once the control loop has had a turn.
            silent, stalled, last = now - child.last_heard, now - last > 1.0, now
            if silent > REMOTE_TIMEOUT and not stalled:
                child.exited.set()
                self._died(child, f"{remote.name(rank)} stopped responding (no heartbeat for "
                                  f"{silent:.1f} s): it died, hung or lost the network")
                return
            await trio.sleep(0.1)

    def _left(self, child: Child) -> bool:
        """Shutdown's view of a remote replica: gone once it has marked itself stopped, or
        is silent, or was never ready (it leaves when the store closes)."""
        if not child.exited.is_set() and (
                not child.ready or trio.current_time() - child.last_heard > REMOTE_TIMEOUT
                or self.remote.stopped(split_role(child.role)[1])):
            child.exited.set()
        return child.exited.is_set()

    def _died(self, child: Child, message: str) -> None:
        """A child that was ready is gone: its replica is lost, or the engine is dead."""
        if child.crash is not None:
            message += f" ({child.crash})"
        log.error("%s", message)
        if self.on_replica_death is not None and split_role(child.role)[1] is not None \
                and self.dead is None and self.on_replica_death(child.role, message):
            return
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
            if isinstance(msg, control.Hello):
                await self._on_hello(child, msg)
            elif isinstance(msg, control.Ready):
                child.ready = True
                log.info("the %s process (pid %d) is ready", child.role, msg.pid)
                if all(c.ready for c in self.children.values()) and \
                        len(self.children) == len(self.roles):
                    self._settled.set()
            elif isinstance(msg, control.StartFailed):
                if child.ready:
                    child.crash = msg.message  # it is about to exit: say why
                else:
                    self._fail_start(f"{child.role} process failed to start: {msg.message}")
            elif isinstance(msg, control.Heartbeat):
                child.mailboxes = msg.mailboxes
            elif isinstance(msg, control.DrainReport):
                child.report = msg
                self._reports.set()

    async def _on_hello(self, child: Child, hello: control.Hello) -> None:
        try:
            handshake.check_hello(hello, expect_role=child.role)
        except handshake.HandshakeError as exc:
            log.error("refusing the %s process: %s", child.role, exc)
            self._fail_start(str(exc))
        else:
            child.hello = hello
        endpoint = self.ipc.endpoint(f"{child.role}.ctl")
        if child.proc is None and self.remote.joined(split_role(child.role)[1]):
            endpoint = self.remote.ctl[split_role(child.role)[1]]  # (published before Hello)
        # Answer either way: a mismatched child then refuses us too, with its own words.
        child.ctl = wire.ZmqOutbox(endpoint, ControlMessage, name=f"parent->{child.role}",
                                   hwm=CONTROL_CAPACITY)
        await child.ctl.send(handshake.make_hello("parent"))

    def late(self) -> str | None:
        """Why the engine looks frozen: a ready local child whose heartbeats are late by
        more than two intervals (``LATE_AFTER``), e.g. a stopped process; else None.

        Judged only while this loop keeps time (its own heartbeat tick is recent): after a
        stall here, the children's heartbeats may wait unread in the socket.
        """
        now = trio.current_time()
        if self.stopping or now - self.ticked > LATE_AFTER:
            return None
        silent = [(now - c.last_heard, c.role) for c in self.children.values()
                  if c.proc is not None and c.ready and not c.exited.is_set()]
        worst = max(silent, default=None)
        if worst is None or worst[0] <= LATE_AFTER:
            return None
        return f"the {worst[1]} process sent no heartbeat for {worst[0]:.1f} s"

    async def _heartbeats(self) -> None:
        for seq in itertools.count(1):
            await trio.sleep(HEARTBEAT_INTERVAL)
            now = self.ticked = trio.current_time()
            for child in self.children.values():
                if child.exited.is_set() or child.ctl is None:
                    continue
                try:
                    child.ctl.send_nowait(control.Heartbeat("parent", seq))
                except trio.WouldBlock:
                    pass
                silent = now - child.last_heard
                if not child.ready or self.stopping or child.proc is None:
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
                child.ctl.send_nowait(control.DrainQuery(token))  # type: ignore[union-attr]
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
        await stop_children(self.children.values(), reason, self._left)
        if self._ctl_in is not None:
            self._ctl_in.close()
        if self.remote is not None:
            self.remote.close()

    def live_replicas(self) -> list[str]:
        """The data-parallel replicas' roles whose process has not exited."""
        return [c.role for c in self.children.values()
                if split_role(c.role)[1] is not None and not c.exited.is_set()]

    def pids(self) -> dict[str, int]:
        """Each local child's process id, by role."""
        return {role: c.proc.pid for role, c in self.children.items() if c.proc is not None}
