"""ZeroMQ mailboxes: the same interface as :class:`actorllm.wire.mailbox.Mailbox`, across processes.

An edge between two processes is one PUSH socket (the sender's :class:`ZmqOutbox`)
connected to one PULL socket (the receiver's :class:`ZmqInbox`), over ``ipc://``
endpoints in a private 0700 directory (:class:`IpcDir`). Every frame is one
message in the one msgpack codec (:mod:`actorllm.wire.codec`); there is no pickle.

Theory of operation (trio, no threads):

- A ZeroMQ socket exposes one file descriptor, ``zmq.FD``, that becomes readable
  when the socket's state *may* have changed, for sending as well as receiving.
  It is edge-triggered and any operation on the socket may consume the edge, so
  the rule is: try the operation with ``NOBLOCK``; on ``EAGAIN`` look at
  ``zmq.EVENTS``; only if the event is still absent, wait with
  ``trio.lowlevel.wait_readable(fd)``, and then start over.
- Only one task may wait on one FD. A :class:`ZmqInbox` is read by its one
  receiver (the owning actor), which reads the socket itself; a
  :class:`ZmqOutbox` serialises its senders with a lock, so at most one of them
  waits on its FD.
- No reader task between the socket and the actor. An earlier design had one, a
  "pump" moving frames into the mailbox ahead of the actor; its task switch and
  bookkeeping made a hop 100 us instead of 83 (docs/architecture.md, "The cost
  of a hop").
- Bounded everywhere. Frames leave the socket only as the actor receives them;
  while it does not, the PULL socket's RCVHWM fills, then the PUSH socket's
  SNDHWM, and the sender's ``send`` waits (on POLLOUT, through the same
  FD/EVENTS dance). Nothing buffers without limit (the kernel's socket buffer
  adds its fixed size, as for any socket).
- Because a :class:`ZmqInbox` *is* a Mailbox, actors of the receiving process
  send to it directly (its memory channel); only remote peers go through the
  socket. A local send wakes a receiver parked on the FD by cancelling the scope
  it waits in. An actor never knows which kind of inbox or outbox it holds.
- A frame that is not a valid message for the inbox (garbage from a rogue peer,
  another codec version, a wrong type) is counted in ``rejected`` and dropped; it
  never crashes the process.

The handshake between processes is :mod:`actorllm.wire.handshake`.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import trio
import zmq

from actorllm.wire import codec
from actorllm.wire.mailbox import Mailbox, MailboxTypeError, accepted_types

T = TypeVar("T")

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 << 20  # a peer that sends more is disconnected by ZeroMQ itself
READ_BATCH = 256  # frames read from a socket per look, before other tasks run
_LOG_FIRST_REJECTS = 10  # then one line every 1000 rejected frames

# Unix socket paths must fit in sun_path (108 bytes); keep room for "/scheduler.sock".
_MAX_DIR_LEN = 80

_context: zmq.Context[Any] | None = None


def context() -> zmq.Context[Any]:
    """The process's one ZeroMQ context (made on first use; lives until exit)."""
    global _context
    if _context is None:
        _context = zmq.Context()
    return _context


class FrameTooLarge(ValueError):
    """A message whose frame is over :data:`MAX_FRAME_BYTES`: it was not sent."""


class IpcDir:
    """A private (0700) directory holding the ``ipc://`` endpoints of one engine.

    The owner (the parent process) removes it with :meth:`remove`, or at interpreter
    exit at the latest. Children open it with ``owner=False`` and never remove it
    unless their parent is gone (see :mod:`actorllm.topology.child`).
    """

    def __init__(self, path: str | None = None, *, owner: bool = True) -> None:
        if path is None:
            base = tempfile.gettempdir()
            if len(base) > _MAX_DIR_LEN - 20:
                base = "/tmp"  # a long $TMPDIR would overflow sun_path
            path = tempfile.mkdtemp(prefix="actorllm-", dir=base)  # mkdtemp makes it 0700
        self.path = path
        self.owner = owner
        if owner:
            os.chmod(path, 0o700)
            atexit.register(self.remove)

    def endpoint(self, name: str) -> str:
        """The ``ipc://`` address of the socket called ``name``."""
        return f"ipc://{self.path}/{name}"

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def remove(self) -> None:
        """Delete the directory and every socket file in it (idempotent)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self.owner:
            atexit.unregister(self.remove)

    def __repr__(self) -> str:
        return f"IpcDir({self.path!r})"


def _close_socket(sock: zmq.Socket[Any], fd: int, linger_ms: int = 0) -> None:
    if sock.closed:
        return
    try:
        # Wake (with ClosedResourceError) any task parked on this FD before it goes away.
        trio.lowlevel.notify_closing(fd)
    except RuntimeError:
        pass  # not inside trio: nobody can be waiting
    sock.close(linger=linger_ms)


class ZmqOutbox(Generic[T]):
    """The sending side of a remote mailbox: a PUSH socket connected to its endpoint.

    ``send`` type-checks like a Mailbox, encodes with the codec and waits while the
    peer is full (SNDHWM reached). Messages keep their order. ``linger_ms``: how long
    frames still queued at ``close`` may take to leave (0: dropped; data edges of a
    stopping engine carry nothing anyone waits for). ``endpoint`` None: connected later
    (:meth:`connect`), once the peer has said where it listens; until then a send waits.
    """

    def __init__(self, endpoint: str | None, message_type: Any, *, name: str, hwm: int = 256,
                 linger_ms: int = 0, ctx: zmq.Context[Any] | None = None) -> None:
        self.name = name
        self.linger_ms = linger_ms
        self.endpoint = endpoint or "(not connected yet)"
        self.types = accepted_types(message_type)
        self.sent = 0
        self._sock = (ctx or context()).socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, linger_ms)  # bounded: never waits on a dead peer
        if endpoint is not None:
            self.connect(endpoint)
        self._fd: int = self._sock.getsockopt(zmq.FD)
        self._lock = trio.Lock()  # one waiter per FD

    def connect(self, endpoint: str) -> None:
        """Connect to the peer's inbox (its one endpoint: one edge, one FIFO pipe)."""
        self.endpoint = endpoint
        self._sock.connect(endpoint)  # queues until the peer binds (no ZMQ_IMMEDIATE)

    def _check(self, msg: Any) -> bytes:
        if not isinstance(msg, self.types):
            raise MailboxTypeError(
                f"mailbox {self.name!r} takes {[t.__name__ for t in self.types]}, "
                f"not {type(msg).__name__}"
            )
        data = codec.encode(msg)
        if len(data) > MAX_FRAME_BYTES:
            # The peer's ZeroMQ would drop it and the connection without a word; say so
            # here, where the sender can fail the one message rather than lose it.
            raise FrameTooLarge(f"mailbox {self.name!r}: a {type(msg).__name__} of "
                                f"{len(data)} bytes is over the {MAX_FRAME_BYTES}-byte frame "
                                "limit")
        return data

    async def send(self, msg: T) -> None:
        """Deliver ``msg``, waiting while the peer's queue is full (backpressure)."""
        data = self._check(msg)
        sock = self._sock
        if not self._lock.locked():
            # Fast path: hand the frame to ZeroMQ first and yield after, so the message
            # does not wait a scheduling round (the latency of every hop).
            await trio.lowlevel.checkpoint_if_cancelled()
            if self._try_send(sock, data):
                self.sent += 1
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
        async with self._lock:  # one waiter per FD
            while not self._try_send(sock, data):
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                    await trio.lowlevel.wait_readable(self._fd)  # the FD signals POLLOUT too
        self.sent += 1

    def _try_send(self, sock: zmq.Socket[Any], data: bytes) -> bool:
        try:
            sock.send(data, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if sock.closed or exc.errno == zmq.ENOTSOCK:
                raise trio.ClosedResourceError(self.name) from None
            raise

    def send_nowait(self, msg: T) -> None:
        """Deliver without waiting; raises trio.WouldBlock when the peer is full, and
        trio.ClosedResourceError after :meth:`close` (as :meth:`send` does). While a
        sender waits for room, this one waits too (never overtakes it)."""
        if self._lock.locked() or not self._try_send(self._sock, self._check(msg)):
            raise trio.WouldBlock
        self.sent += 1

    def close(self) -> None:
        _close_socket(self._sock, self._fd, self.linger_ms)

    def __repr__(self) -> str:
        return f"ZmqOutbox({self.name!r} -> {self.endpoint})"


RejectHook = Callable[[bytes, str], None]


class ZmqInbox(Mailbox[T]):
    """A Mailbox that remote peers also reach: a PULL socket bound at ``endpoint``.

    Local actors ``send`` to it as to any Mailbox. Its one receiver reads the socket
    itself: :meth:`receive` returns a message sent from this process if one waits,
    else the next frame in the socket, else parks on the socket's FD inside a cancel
    scope that a local ``send`` cancels. ``depth`` and ``high_water`` count the local
    messages waiting; remote ones wait inside ZeroMQ's queues, which ``hwm`` bounds.
    """

    def __init__(self, name: str, message_type: Any, capacity: int, endpoint: str, *,
                 hwm: int | None = None, on_reject: RejectHook | None = None,
                 ctx: zmq.Context[Any] | None = None) -> None:
        super().__init__(name, message_type, capacity)
        self.endpoint = endpoint
        self.received = 0  # frames delivered from the socket
        self.rejected = 0  # frames dropped: not a message, or not one this inbox takes
        self.on_reject = on_reject
        self._sock = (ctx or context()).socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, hwm or capacity)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = self.bind(endpoint)
        self._fd: int = self._sock.getsockopt(zmq.FD)
        self._parked: trio.CancelScope | None = None  # the receiver, waiting on the FD

    def bind(self, endpoint: str) -> str:
        """Listen at ``endpoint`` too (a PULL socket may listen on several: ``ipc://`` for
        peers on this host, ``tcp://0.0.0.0:0`` for others); returns where it listens,
        with the port a ``:0`` endpoint was given."""
        self._sock.bind(endpoint)
        return str(self._sock.getsockopt(zmq.LAST_ENDPOINT).decode())

    async def send(self, msg: T) -> None:
        """Deliver ``msg`` from this process, waiting while the box is full."""
        await super().send(msg)
        self._wake()

    def send_nowait(self, msg: T) -> None:
        """Deliver from this process without waiting; raises trio.WouldBlock when full."""
        super().send_nowait(msg)
        self._wake()

    def _wake(self) -> None:
        # The receiver may be parked on the socket's FD, which a local message does not
        # touch: stop that wait, and it looks at the mailbox again.
        if self._parked is not None:
            self._parked.cancel()

    async def receive(self) -> T:
        """The next message, local or remote, waiting for one if there is none."""
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            try:
                msg = self.receive_nowait()
                break
            except trio.WouldBlock:
                pass
            sock = self._sock
            if not sock.closed and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                # Frames are there: a batch of garbage filled the last look, or recv's
                # command throttle hid the latest. Let the other tasks run, then read.
                await trio.lowlevel.checkpoint()
            else:
                await self._park()
            waited = True
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()  # receive is a schedule point
        return msg

    def receive_nowait(self) -> T:
        """The next message; raises trio.WouldBlock when there is none yet."""
        # Local messages first, then the socket, one frame at a time: taking more out of
        # the socket than asked for would only move them from one bounded queue to another.
        try:
            return super().receive_nowait()
        except trio.WouldBlock:
            pass
        return self._received(self._read_socket())

    def _read_socket(self) -> T:
        """The next valid message waiting in the socket (reading at most a batch of
        frames); raises trio.WouldBlock if there is none."""
        sock = self._sock
        for _ in range(READ_BATCH):
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError:
                if sock.closed:
                    break
                raise
            msg = self._decode(data)
            if msg is not None:
                if self.hop_hook is not None:
                    self.hop_hook(self.name, "send", msg)
                return msg  # type: ignore[no-any-return]
        raise trio.WouldBlock

    async def _park(self) -> None:
        # Only one task may wait on an FD: trio raises BusyResourceError for a second
        # receiver, as an inbox has one owner.
        with trio.CancelScope() as self._parked:
            try:
                await trio.lowlevel.wait_readable(self._fd)
            except trio.ClosedResourceError:
                pass  # close(): the mailbox is closed too, and says so on the next look
            finally:
                self._parked = None

    def _decode(self, data: bytes) -> Any:
        try:
            msg = codec.decode(data)
        except codec.CodecError as exc:
            self._reject(data, str(exc))
            return None
        if not isinstance(msg, self.types):
            self._reject(data, f"{type(msg).__name__} is not accepted here")
            return None
        self.received += 1
        return msg

    def _reject(self, data: bytes, why: str) -> None:
        self.rejected += 1
        if self.rejected <= _LOG_FIRST_REJECTS or self.rejected % 1000 == 0:
            log.warning("mailbox %s: rejected a %d-byte frame (%s); %d rejected so far",
                        self.name, len(data), why, self.rejected)
        if self.on_reject is not None:
            self.on_reject(data, why)

    def close(self) -> None:
        """Close the socket and the mailbox: the actor drains what is left, then stops."""
        _close_socket(self._sock, self._fd)
        super().close()

    def __repr__(self) -> str:
        return f"ZmqInbox({self.name!r} at {self.endpoint}, depth={self.depth}/{self.capacity})"
