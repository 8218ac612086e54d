"""ZeroMQ mailboxes: the Mailbox interface across a socket, bounded and typed.

Garbage from a rogue peer is rejected and counted, never fatal; mismatched
peers refuse each other in the handshake with an error that says why.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples

from actorllm.wire import codec, transport
from actorllm.wire.handshake import (
    PROTOCOL_VERSION,
    HandshakeError,
    check_hello,
    frame_version,
    make_hello,
    schema_fingerprint,
)
from actorllm.wire.mailbox import MailboxClosed, MailboxTypeError
from actorllm.wire.messages import (
    AbortRequest,
    Hello,
    SchedulerInput,
    StepResult,
    StopMatched,
    TextDelta,
    TokenizerInput,
)
from actorllm.wire.transport import FrameTooLarge, IpcDir, ZmqInbox, ZmqOutbox


@pytest.fixture
def ipc() -> Iterator[IpcDir]:
    d = IpcDir()
    yield d
    d.remove()


def rogue_push(endpoint: str) -> zmq.Socket[Any]:
    """A plain blocking PUSH socket: a peer that ignores every rule."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    return sock


async def test_messages_cross_in_order(ipc: IpcDir) -> None:
    inbox = ZmqInbox("scheduler", SchedulerInput, 8, ipc.endpoint("s.sock"))
    out = ZmqOutbox(ipc.endpoint("s.sock"), SchedulerInput, name="tokenizer->scheduler")
    msgs: list[Any] = [AbortRequest(str(i)) for i in range(300)] + [StopMatched("r", "\n")]
    async with trio.open_nursery() as nursery:

        async def produce() -> None:
            for m in msgs:
                await out.send(m)

        nursery.start_soon(produce)
        got = [await inbox.receive() for _ in msgs]
        nursery.cancel_scope.cancel()
    assert got == msgs
    assert out.sent == inbox.received == len(msgs) and inbox.rejected == 0
    assert inbox.high_water <= inbox.capacity
    out.close()
    inbox.close()


async def test_local_and_remote_senders_share_one_inbox(ipc: IpcDir) -> None:
    # The Scheduler's inbox in the engine process hears from the Worker (local) and from
    # the Tokenizer (remote): one ZmqInbox is both a Mailbox and a socket.
    inbox = ZmqInbox("scheduler", SchedulerInput, 8, ipc.endpoint("s.sock"))
    out = ZmqOutbox(ipc.endpoint("s.sock"), SchedulerInput, name="remote")
    async with trio.open_nursery() as nursery:
        await inbox.send(StepResult(1))
        await out.send(AbortRequest("a"))
        got = {type(await inbox.receive()) for _ in range(2)}
        nursery.cancel_scope.cancel()
    assert got == {StepResult, AbortRequest}
    out.close()
    inbox.close()


async def test_outbox_checks_types_like_a_mailbox(ipc: IpcDir) -> None:
    out = ZmqOutbox(ipc.endpoint("t.sock"), TokenizerInput, name="frontend->tokenizer")
    with pytest.raises(MailboxTypeError, match="StepResult"):
        await out.send(StepResult(0))  # type: ignore[arg-type]
    out.close()


async def test_full_peer_applies_backpressure_then_everything_arrives(ipc: IpcDir) -> None:
    # Big messages, so the kernel's socket buffers hold only a few of them too.
    inbox = ZmqInbox("frontend", TextDelta, 2, ipc.endpoint("f.sock"), hwm=2)
    out = ZmqOutbox(ipc.endpoint("f.sock"), TextDelta, name="detokenizer->frontend", hwm=2)
    total = 200
    sent = 0

    async def produce() -> None:
        nonlocal sent
        for i in range(total):
            await out.send(TextDelta(str(i), "x" * 100_000, ()))
            sent += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        await trio.sleep(0.5)  # nobody reads: the pipeline fills and the sender stops
        blocked_at = sent
        assert blocked_at < 60, f"sent {blocked_at} messages into a full peer"
        assert inbox.depth == 0  # remote messages wait in ZeroMQ, not in the mailbox
        got = [int((await inbox.receive()).rid) for _ in range(total)]
        nursery.cancel_scope.cancel()
    assert got == list(range(total))
    out.close()
    inbox.close()


async def test_closing_the_inbox_wakes_its_parked_receiver(ipc: IpcDir) -> None:
    inbox = ZmqInbox("a", AbortRequest, 4, ipc.endpoint("a.sock"))
    await inbox.send(AbortRequest("left"))
    got: list[AbortRequest] = []

    async def read_all() -> None:
        got.extend([m async for m in inbox])  # ends at MailboxClosed

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            # The receiver took "left" and now waits on the socket.
            await trio.testing.wait_all_tasks_blocked()
            inbox.close()
    assert got == [AbortRequest("left")]


async def test_a_local_send_wakes_a_receiver_parked_on_the_socket(ipc: IpcDir) -> None:
    # The Scheduler in the engine process waits for a remote request or the Worker's
    # local StepResult, whichever comes first.
    inbox = ZmqInbox("scheduler", SchedulerInput, 8, ipc.endpoint("s.sock"))
    out = ZmqOutbox(ipc.endpoint("s.sock"), SchedulerInput, name="remote")
    got: list[Any] = []

    async def receive_two() -> None:
        got.append(await inbox.receive())
        got.append(await inbox.receive())

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive_two)
            # (Wait for every task to block, not for a while: after a sleep, a loaded
            # machine can wake this task in the same batch as the receiver, either first.)
            await trio.testing.wait_all_tasks_blocked()  # parked on the FD: nothing yet
            inbox.send_nowait(StepResult(1))
            await trio.testing.wait_all_tasks_blocked()
            assert got == [StepResult(1)]  # woken by the local send, parked again
            await out.send(AbortRequest("a"))  # the socket still wakes it afterwards
    assert got == [StepResult(1), AbortRequest("a")]
    out.close()
    inbox.close()


async def test_a_cancelled_receive_leaves_the_inbox_usable(ipc: IpcDir) -> None:
    inbox = ZmqInbox("a", AbortRequest, 4, ipc.endpoint("a.sock"))
    out = ZmqOutbox(ipc.endpoint("a.sock"), AbortRequest, name="remote")
    with trio.move_on_after(0.05) as scope:
        await inbox.receive()
    assert scope.cancelled_caught
    await out.send(AbortRequest("after"))
    await inbox.send(AbortRequest("local"))
    with trio.fail_after(5):
        got = {(await inbox.receive()).rid for _ in range(2)}
    assert got == {"after", "local"}
    assert inbox.received == 1 and inbox.depth == 0
    out.close()
    inbox.close()


def _push_and_record(frames: list[bytes]) -> tuple[list[Any], list[str], int, int]:
    """Send ``frames`` then one valid message from a rogue peer; returns the messages the
    inbox took (less the sentinel), the reason it gave for each frame it rejected, and
    its ``received`` and ``rejected`` counters."""
    ipc = IpcDir()
    took: list[Any] = []
    reasons: list[str] = []

    async def run() -> tuple[int, int]:
        inbox = ZmqInbox("tokenizer", TokenizerInput, 4, ipc.endpoint("t.sock"),
                         on_reject=lambda _data, why: reasons.append(why))
        sock = rogue_push(ipc.endpoint("t.sock"))
        try:
            async with trio.open_nursery() as nursery:
                for frame in frames:
                    sock.send(frame)
                sock.send(codec.encode(AbortRequest("sentinel")))
                with trio.fail_after(10):
                    while True:
                        msg = await inbox.receive()
                        if msg == AbortRequest("sentinel"):
                            break
                        took.append(msg)
                nursery.cancel_scope.cancel()
        finally:
            sock.close()
            inbox.close()
        return inbox.received, inbox.rejected

    try:
        received, rejected = trio.run(run)
    finally:
        ipc.remove()
    return took, reasons, received, rejected


def _push_garbage(frames: list[bytes]) -> tuple[int, int]:
    """Send ``frames`` then one valid message from a rogue peer; returns (received, rejected)."""
    _, _, received, rejected = _push_and_record(frames)
    return received, rejected


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=30))
def test_garbage_frames_are_rejected_and_counted(frames: list[bytes]) -> None:
    received, rejected = _push_garbage(frames)
    # Every frame is accounted for: a message this inbox takes, or a counted rejection.
    assert received + rejected == len(frames) + 1
    assert rejected >= sum(1 for f in frames if frame_version(f) != codec.VERSION)


@settings(max_examples=examples(40), deadline=None)
# Integers msgpack can carry (a bigger one cannot be sent at all, by anyone).
@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4), max_leaves=12),
       st.sampled_from(["AbortRequest", "GenerateRequest", "StepResult", "Hello", "Nope"]))
def test_structured_garbage_is_rejected(fields: Any, name: str) -> None:
    frame = msgpack.packb([codec.VERSION, [name, fields]])
    took, reasons, received, rejected = _push_and_record([frame, frame])
    # What the codec makes of the frame on its own (tests/test_codec.py holds it to the
    # schema); the inbox must add exactly its type check, and say why it dropped each.
    try:
        decoded: Any = codec.decode(frame)
    except codec.CodecError as exc:
        expected_took, expected_reasons = [], [str(exc)] * 2
    else:
        if name in ("AbortRequest", "GenerateRequest"):  # what a Tokenizer takes
            expected_took, expected_reasons = [decoded] * 2, []
        else:  # a well-formed StepResult or Hello: a message, but not for this inbox
            expected_took, expected_reasons = [], [f"{name} is not accepted here"] * 2
    assert took == expected_took
    assert reasons == expected_reasons
    assert (received, rejected) == (len(expected_took) + 1, len(expected_reasons))
    if name not in ("AbortRequest", "GenerateRequest"):
        assert took == []  # never a StepResult, Hello or unknown type, whatever its fields


def test_a_well_formed_message_of_another_type_is_rejected_by_name() -> None:
    frames = [codec.encode(StepResult(3)), codec.encode(make_hello("engine"))]
    took, reasons, received, rejected = _push_and_record(frames)
    assert took == [] and (received, rejected) == (1, 2)
    assert reasons == ["StepResult is not accepted here", "Hello is not accepted here"]


def test_wrong_type_and_foreign_version_frames_are_rejected() -> None:
    frames = [
        codec.encode(StepResult(3)),  # a valid message, but not for the Tokenizer
        msgpack.packb([codec.VERSION + 1, ["AbortRequest", ["x"]]]),  # a newer peer
        b"",
    ]
    assert _push_garbage(frames) == (1, 3)


def test_handshake_accepts_a_twin_and_refuses_the_rest() -> None:
    me = make_hello("engine")
    check_hello(me)
    check_hello(me, expect_role="engine")
    cases = [
        (Hello(PROTOCOL_VERSION + 1, codec.VERSION, schema_fingerprint(), "engine", 7),
         "transport protocol"),
        (Hello(PROTOCOL_VERSION, codec.VERSION + 1, schema_fingerprint(), "engine", 7),
         "codec version"),
        (Hello(PROTOCOL_VERSION, codec.VERSION, "0123456789abcdef", "engine", 7),
         "message schema"),
    ]
    for hello, what in cases:
        with pytest.raises(HandshakeError, match=f"engine process \\(pid 7\\) .*{what}"):
            check_hello(hello)
    with pytest.raises(HandshakeError, match="expected the detokenizer process"):
        check_hello(me, expect_role="detokenizer")


def test_frame_version_peeks_without_decoding() -> None:
    assert frame_version(codec.encode(AbortRequest("a"))) == codec.VERSION
    assert frame_version(msgpack.packb([9, "anything"])) == 9
    assert frame_version(b"\xc1") is None
    assert frame_version(msgpack.packb({"a": 1})) is None


def test_ipc_dir_is_private_and_removed() -> None:
    d = IpcDir()
    assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
    assert len(d.endpoint("scheduler.sock")) < 100  # fits in sun_path
    open(d.file("x"), "w").close()
    d.remove()
    assert not os.path.exists(d.path)
    d.remove()  # idempotent


async def test_an_outbox_refuses_sends_after_close(ipc: IpcDir) -> None:
    inbox = ZmqInbox("scheduler", SchedulerInput, 8, ipc.endpoint("s.sock"))
    out = ZmqOutbox(ipc.endpoint("s.sock"), SchedulerInput, name="tokenizer->scheduler")
    await out.send(AbortRequest("before"))
    # Received before the close: with the outbox's default linger (0) a frame still
    # queued in ZeroMQ at close is dropped, and on a loaded box "before" often was.
    with trio.fail_after(30):
        assert await inbox.receive() == AbortRequest("before")
    out.close()
    with pytest.raises(trio.ClosedResourceError, match="tokenizer->scheduler"):
        await out.send(AbortRequest("after"))
    with pytest.raises(trio.ClosedResourceError, match="tokenizer->scheduler"):
        out.send_nowait(AbortRequest("after"))
    assert out.sent == 1
    inbox.close()
    with pytest.raises(MailboxClosed):
        await inbox.send(AbortRequest("local, after close"))


async def test_a_frame_over_the_limit_is_refused_by_the_sender_and_dropped_by_the_inbox(
        ipc: IpcDir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "MAX_FRAME_BYTES", 4096)
    inbox = ZmqInbox("scheduler", SchedulerInput, 8, ipc.endpoint("s.sock"))
    out = ZmqOutbox(ipc.endpoint("s.sock"), SchedulerInput, name="tokenizer->scheduler")
    big = StopMatched("r", "x" * 8192)
    # The sender says so, naming the mailbox and the size, and sends nothing.
    with pytest.raises(FrameTooLarge, match=r"'tokenizer->scheduler': a StopMatched of \d+ "
                                            r"bytes is over the 4096-byte frame limit"):
        await out.send(big)
    with pytest.raises(FrameTooLarge):
        out.send_nowait(big)
    assert out.sent == 0
    # A rogue peer that sends one anyway: ZeroMQ drops it (and that connection) before
    # it is decoded; the inbox serves on, and a well-behaved sender gets through.
    assert inbox._sock.getsockopt(zmq.MAXMSGSIZE) == 4096
    rogue = rogue_push(ipc.endpoint("s.sock"))
    try:
        rogue.send(codec.encode(big))
        await out.send(AbortRequest("fine"))
        with trio.fail_after(30):
            assert await inbox.receive() == AbortRequest("fine")
        with pytest.raises(trio.WouldBlock):
            inbox.receive_nowait()
        assert inbox.received == 1 and inbox.rejected == 0
    finally:
        rogue.close()
        out.close()
        inbox.close()
