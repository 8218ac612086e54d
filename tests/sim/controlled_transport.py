"""A mailbox whose delivery the test chooses, message by message.

Same interface as :class:`actorllm.wire.mailbox.Mailbox` (typed, bounded, ``send`` blocks
while full, ``depth`` and ``high_water``), but a sent message does not become
receivable at once: it waits on the *wire* of its edge until the test calls
:meth:`ControlledMailbox.deliver`. One mailbox is one actor's inbox; each sender
gets its own :class:`EdgeOutbox`, so an inbox fed by three actors has three wires.
Each wire is FIFO (like trio channels and ZeroMQ PUSH/PULL); the test reorders
*across* wires, which is every interleaving a real deployment can produce.

Every delivered message is round-tripped through :mod:`actorllm.wire.codec`, as if the
edge crossed a process boundary: an actor that relied on object identity, or a
message the codec cannot carry, fails here.

Hooks (``on_send``, ``on_recv``) let the checker see each message when it leaves
its sender (invariant 1: nothing for a rid on any wire before the Frontend knows it)
and when its receiver takes it (the step fence: a plan is in flight until the
Scheduler has *received* its result).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import outcome
import trio

from actorllm.wire import codec
from actorllm.wire.mailbox import MailboxClosed, MailboxTypeError, accepted_types

# (edge name, message) -> tag; called in the sender's task when it sends (if the box is full,
# before it waits: the message has left its sender, it just cannot go on the wire yet).
# The tag travels with the message (the checker uses it to remember which incarnation of
# a rid a message was sent for); the actors never see it.
SendHook = Callable[[str, Any], Any]
# (mailbox name, message, tag) -> None; called in the receiver's task as it takes one.
RecvHook = Callable[[str, Any, Any], None]


class ControlledMailbox:
    """One actor's inbox. ``deliver(edge)`` moves the oldest message of ``edge`` into it."""

    def __init__(self, name: str, message_type: Any, capacity: int = 64,
                 *, roundtrip: bool = True) -> None:
        if capacity < 1:
            raise ValueError("a mailbox needs room for at least one message")
        self.name = name
        self.types = accepted_types(message_type)
        self.capacity = capacity
        self.roundtrip = roundtrip
        self.wires: dict[str, deque[tuple[Any, Any]]] = {}  # edge -> (message, tag), FIFO
        self._ready: deque[tuple[Any, Any]] = deque()  # delivered, not yet received
        self._closed = False
        self._dead = False
        self._lot = trio.lowlevel.ParkingLot()  # receivers waiting for a delivery
        # Senders waiting for room, in order: task -> (edge, message, tag).
        self._blocked: OrderedDict[Any, tuple[str, Any, Any]] = OrderedDict()
        self.high_water = 0
        self.sent = 0
        self.on_send: SendHook | None = None
        self.on_recv: RecvHook | None = None

    # --- what the test sees ------------------------------------------------------------

    @property
    def depth(self) -> int:
        """Messages sent and not yet received: on a wire or delivered."""
        return len(self._ready) + sum(len(w) for w in self.wires.values())

    def edge(self, sender: str) -> EdgeOutbox:
        """The sending side for ``sender``: one FIFO wire into this inbox."""
        name = f"{sender}->{self.name}"
        self.wires.setdefault(name, deque())
        return EdgeOutbox(self, name)

    def pending(self) -> dict[str, int]:
        """Messages waiting on each wire (edges with none are left out)."""
        return {e: len(w) for e, w in self.wires.items() if w}

    def blocked(self) -> list[tuple[str, Any]]:
        """(edge, message) of each sender waiting for room, in the order they will go."""
        return [(edge, msg) for edge, msg, _ in self._blocked.values()]

    def peek(self, edge: str) -> Any:
        """The message ``deliver(edge)`` would hand over next."""
        return self.wires[edge][0][0]

    def deliver(self, edge: str) -> Any:
        """Make the oldest message on ``edge`` receivable; returns it. Call inside trio."""
        msg, tag = self.wires[edge].popleft()
        if self.roundtrip:
            msg = codec.decode(codec.encode(msg))
        self._ready.append((msg, tag))
        self._lot.unpark()
        return msg

    # --- the Mailbox interface -----------------------------------------------------------

    def _check(self, msg: Any) -> None:
        if not isinstance(msg, self.types):
            raise MailboxTypeError(
                f"mailbox {self.name!r} takes {[t.__name__ for t in self.types]}, "
                f"not {type(msg).__name__}"
            )
        if self._closed:
            raise MailboxClosed(self.name)

    def _tag(self, edge: str, msg: Any) -> Any:
        return self.on_send(edge, msg) if self.on_send is not None else None

    def _put(self, edge: str, msg: Any, tag: Any) -> None:
        self.wires[edge].append((msg, tag))
        self.sent += 1
        self.high_water = max(self.high_water, self.depth)

    async def send(self, edge: str, msg: Any) -> None:
        """Queue ``msg`` on ``edge``'s wire, waiting while the box is full (backpressure).

        Blocked senders are served in arrival order, as trio's memory channels do, so one
        sender's messages never overtake each other even when it has several tasks.
        """
        self._check(msg)
        await trio.lowlevel.checkpoint_if_cancelled()
        tag = self._tag(edge, msg)
        if self._dead:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        if self.depth < self.capacity and not self._blocked:
            self._put(edge, msg, tag)
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        task = trio.lowlevel.current_task()
        self._blocked[task] = (edge, msg, tag)

        def abort_fn(_: Any) -> trio.lowlevel.Abort:
            del self._blocked[task]
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort_fn)

    def send_nowait(self, edge: str, msg: Any) -> None:
        self._check(msg)
        if self._dead:
            return
        if self.depth >= self.capacity or self._blocked:
            raise trio.WouldBlock
        self._put(edge, msg, self._tag(edge, msg))

    async def receive(self) -> Any:
        while not self._ready:
            if self._closed and not self.depth:
                raise MailboxClosed(self.name)
            await self._lot.park()
        return self._take()

    def receive_nowait(self) -> Any:
        if not self._ready:
            raise trio.WouldBlock
        return self._take()

    def _take(self) -> Any:
        msg, tag = self._ready.popleft()
        if self._blocked:  # room now: the longest-waiting sender's message goes on its wire
            task, (edge, waiting, waiting_tag) = self._blocked.popitem(last=False)
            self._put(edge, waiting, waiting_tag)
            trio.lowlevel.reschedule(task)
        if self.on_recv is not None:
            self.on_recv(self.name, msg, tag)
        return msg

    def kill(self) -> None:
        """Its actor's process died: what waits for it is lost, and what is sent to it from
        now on vanishes (a transport to a dead peer drops it; nobody reads it)."""
        self._dead = True
        for wire in self.wires.values():
            wire.clear()
        self._ready.clear()
        while self._blocked:
            task, _ = self._blocked.popitem(last=False)
            trio.lowlevel.reschedule(task)

    def close(self) -> None:
        """No more sends; receivers stop once everything sent has been delivered and taken."""
        self._closed = True
        self._lot.unpark_all()
        while self._blocked:
            task, _ = self._blocked.popitem(last=False)
            trio.lowlevel.reschedule(task, outcome.Error(MailboxClosed(self.name)))

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            try:
                yield await self.receive()
            except MailboxClosed:
                return

    def __repr__(self) -> str:
        return f"ControlledMailbox({self.name!r}, wires={self.pending()}, ready={len(self._ready)})"


class EdgeOutbox:
    """What one sender holds: ``send`` puts messages on its own wire into the inbox."""

    def __init__(self, box: ControlledMailbox, name: str) -> None:
        self.box, self.name = box, name

    async def send(self, msg: Any) -> None:
        await self.box.send(self.name, msg)

    def send_nowait(self, msg: Any) -> None:
        self.box.send_nowait(self.name, msg)

    @property
    def depth(self) -> int:
        return self.box.depth

    @property
    def high_water(self) -> int:
        return self.box.high_water

    def __repr__(self) -> str:
        return f"EdgeOutbox({self.name!r})"
