"""The parent's record of each child process, and how it starts and stops them.

:class:`Child` is what the :class:`~actorllm.topology.supervisor.Supervisor` knows of
one child; :func:`spawn` starts a local one and :func:`stop_children` ends them all
(``Shutdown``, then SIGTERM, then SIGKILL) and releases what the parent held for them.
The Supervisor decides when; this module only does it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import trio

from actorllm.topology.child import SHUTDOWN_GRACE
from actorllm.wire.control import DrainReport, Hello, MailboxStat, Shutdown
from actorllm.wire.transport import ZmqOutbox

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class Child:
    """One child process as its supervisor sees it."""

    role: str
    proc: subprocess.Popen[bytes] | None  # None: a replica on another host
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
    def running(self) -> bool:
        """The child has not exited yet (it may still be unreaped)."""
        return self.proc.poll() is None if self.proc is not None else not self.exited.is_set()


def spawn(role: str, argv: list[str]) -> Child:
    """Start the local child ``role`` with ``argv``; must run in the trio thread."""
    env = dict(os.environ)
    # The child must import this very actorllm, installed or not: put the directory
    # that holds the actorllm package (this file is actorllm/topology/children.py)
    # first on its path.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # Popen here, in the trio thread, not trio.lowlevel.open_process: that forks from a
    # worker thread, and PR_SET_PDEATHSIG fires when the forking *thread* exits.
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env)
    pidfd: int | None = None
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pass  # no pidfd (old kernel): the Supervisor polls instead
    log.info("started the %s process (pid %d)", role, proc.pid)
    return Child(role, proc, pidfd, last_heard=trio.current_time())


async def stop_children(children: Iterable[Child], reason: str,
                        left: Callable[[Child], bool]) -> None:
    """Stop every child: Shutdown, then SIGTERM, then SIGKILL; reap them all and close
    their control sockets and pidfds. ``left(child)`` says whether a remote one (no
    process to signal) is gone."""
    children = list(children)

    def running(c: Child) -> bool:
        return c.running if c.proc is not None else not left(c)

    for child in children:
        if not child.running:
            continue
        try:
            if not child.ready or child.ctl is None:
                # Still loading (it reads no control messages then) or refused: SIGTERM
                # ends it as cleanly, and at once.
                raise trio.WouldBlock
            child.ctl.send_nowait(Shutdown(reason))
        except trio.WouldBlock:
            if child.proc is not None:  # (a remote one leaves when the store closes)
                child.proc.terminate()
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        live = [c for c in children if running(c)]
        if not live:
            break
        for child in live:
            if sig is not None and child.proc is not None:
                log.warning("%s process did not stop; sending %s", child.role, sig.name)
                child.proc.send_signal(sig)
        with trio.move_on_after(SHUTDOWN_GRACE if sig is None else 2.0):
            while any(running(c) for c in live):
                await trio.sleep(0.02)
    for child in children:
        _release(child)


def _release(child: Child) -> None:
    """Reap a stopped child and close what the parent held for it."""
    if child.proc is not None:
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
