"""Typed, bounded mailboxes: the only way actors talk.

An actor holds the *receiving* side of its own inbox and the *sending* side of its
peers' inboxes; it never learns whether a peer is in this process (trio memory
channels, here) or another one (ZeroMQ, :mod:`actorllm.wire.transport`). Both sides
share the small interface below: ``send`` blocks while the box is full
(backpressure), and a box reports its depth and high-water mark.

Wake-ups, not messages, are what a busy event loop charges for: every ``await`` that
yields waits for every other runnable task to take its turn, and a loop serving hundreds
of streams makes that turn long. So an actor takes what is waiting in one go
(:func:`batches`: the next message and every one already behind it) and sends with
:func:`send_soon` (no yield while the peer has room): a burst of N messages costs it one
wake-up, not N (docs/architecture.md, "Wake-ups per burst").
"""

from __future__ import annotations

import contextlib
import logging
import typing
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import trio

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
T_contra = TypeVar("T_contra", contravariant=True)

log = logging.getLogger(__name__)

# A hook for tracing every hop: (mailbox name, "send" | "recv", message).
HopHook = Callable[[str, str, Any], None]


class MailboxTypeError(TypeError):
    """A message of the wrong type was sent to a typed mailbox."""


class MailboxClosed(Exception):
    """The mailbox was closed; no more messages will come or go."""


class Outbox(Protocol[T_contra]):
    """The sending side of a mailbox."""

    name: str

    async def send(self, msg: T_contra) -> None: ...

    def send_nowait(self, msg: T_contra) -> None: ...


class Inbox(Protocol[T_co]):
    """The receiving side of a mailbox."""

    name: str

    async def receive(self) -> T_co: ...

    def receive_nowait(self) -> T_co: ...

    def __aiter__(self) -> AsyncIterator[T_co]: ...


def accepted_types(message_type: Any) -> tuple[type, ...]:
    """The concrete classes a mailbox declared for ``message_type`` accepts."""
    args = typing.get_args(message_type)
    return tuple(args) if args else (message_type,)


class Mailbox(Generic[T]):
    """An in-process mailbox on a trio memory channel.

    ``Mailbox[StepResult]("scheduler", StepResult, capacity=64)``; ``message_type`` may
    be a ``Union`` of message classes. Sending anything else raises MailboxTypeError.
    """

    def __init__(self, name: str, message_type: Any, capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError("a mailbox needs room for at least one message")
        self.name = name
        self.types = accepted_types(message_type)
        self.capacity = capacity
        self._send, self._recv = trio.open_memory_channel[T](capacity)
        self.high_water = 0
        self.sent = 0
        self.hop_hook: HopHook | None = None

    @property
    def depth(self) -> int:
        """Messages waiting to be received."""
        return self._send.statistics().current_buffer_used

    async def send(self, msg: T) -> None:
        """Deliver ``msg``, waiting while the box is full."""
        self._check(msg)
        try:
            await self._send.send(msg)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise MailboxClosed(self.name) from None
        self._sent(msg)

    def send_nowait(self, msg: T) -> None:
        """Deliver without waiting; raises trio.WouldBlock when full (MailboxClosed when
        closed, as :meth:`send` does)."""
        self._check(msg)
        try:
            self._send.send_nowait(msg)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise MailboxClosed(self.name) from None
        self._sent(msg)

    def _check(self, msg: T) -> None:
        if not isinstance(msg, self.types):
            raise MailboxTypeError(
                f"mailbox {self.name!r} takes {[t.__name__ for t in self.types]}, "
                f"not {type(msg).__name__}"
            )

    def _sent(self, msg: T) -> None:
        self.sent += 1
        self.high_water = max(self.high_water, self.depth)
        if self.hop_hook is not None:
            self.hop_hook(self.name, "send", msg)

    async def receive(self) -> T:
        """The next message, waiting for one if the box is empty."""
        with self._receiving():
            msg = await self._recv.receive()
        return self._received(msg)

    def receive_nowait(self) -> T:
        """The next message; raises trio.WouldBlock when empty, MailboxClosed when closed
        and drained (as :meth:`receive` does)."""
        with self._receiving():
            msg = self._recv.receive_nowait()
        return self._received(msg)

    @contextlib.contextmanager
    def _receiving(self) -> Iterator[None]:
        """A closed and drained box raises MailboxClosed, whichever way it is read."""
        try:
            yield
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise MailboxClosed(self.name) from None

    def _received(self, msg: T) -> T:
        if self.hop_hook is not None:
            self.hop_hook(self.name, "recv", msg)
        return msg

    def close(self) -> None:
        """Close the sending side: receivers drain what is left, then stop."""
        self._send.close()

    async def __aiter__(self) -> AsyncIterator[T]:
        with contextlib.suppress(MailboxClosed):  # closed and drained: the iteration ends
            while True:
                yield await self.receive()

    def __repr__(self) -> str:
        return f"Mailbox({self.name!r}, depth={self.depth}/{self.capacity})"


# The most messages an actor takes per wake-up: bounds how long it holds the loop.
READ_AHEAD = 256


async def receive_waiting(inbox: Inbox[T], limit: int = READ_AHEAD) -> list[T]:
    """The next message (waiting for one, a schedule point) and every message already
    waiting behind it, up to ``limit``, taken without yielding. Raises MailboxClosed
    only when nothing at all is left."""
    msgs = [await inbox.receive()]
    while len(msgs) < limit:
        try:
            msgs.append(inbox.receive_nowait())
        except (trio.WouldBlock, MailboxClosed):
            break
    return msgs


async def batches(inbox: Inbox[T], limit: int = READ_AHEAD) -> AsyncIterator[list[T]]:
    """:func:`receive_waiting` until the inbox is closed and drained: an actor that
    handles each list before its next turn pays one wake-up per burst."""
    with contextlib.suppress(MailboxClosed):
        while True:
            yield await receive_waiting(inbox, limit)


async def send_soon(outbox: Outbox[T], msg: T) -> None:
    """Send ``msg`` without yielding if the peer has room; else wait as ``send`` does.
    Order holds: a box with room has no sender waiting (trio channels, ZmqOutbox)."""
    try:
        outbox.send_nowait(msg)
    except trio.WouldBlock:
        await outbox.send(msg)
