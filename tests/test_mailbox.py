"""Mailboxes are typed and bounded, and report depth and high-water mark."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from actorllm.wire.mailbox import Mailbox, MailboxClosed, MailboxTypeError
from actorllm.wire.messages import AbortRequest, SchedulerInput, StepResult, StopMatched


async def test_wrong_type_is_an_error() -> None:
    box = Mailbox[StepResult]("w", StepResult, 4)
    with pytest.raises(MailboxTypeError, match="StepResult"):
        await box.send(AbortRequest("x"))  # type: ignore[arg-type]


async def test_union_mailbox_accepts_each_member() -> None:
    box = Mailbox[SchedulerInput]("s", SchedulerInput, 4)
    await box.send(AbortRequest("a"))
    await box.send(StopMatched("a", "x"))
    assert box.depth == 2
    assert isinstance(await box.receive(), AbortRequest)


async def test_send_blocks_when_full_and_high_water_is_kept() -> None:
    box = Mailbox[AbortRequest]("a", AbortRequest, 2)
    await box.send(AbortRequest("1"))
    await box.send(AbortRequest("2"))
    assert box.depth == 2 and box.high_water == 2
    done = []

    async def third() -> None:
        await box.send(AbortRequest("3"))
        done.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(third)
        await trio.testing.wait_all_tasks_blocked()
        assert not done  # backpressure: the sender waits
        assert (await box.receive()).rid == "1"
        await trio.testing.wait_all_tasks_blocked()
        assert done
    assert box.depth == 2 and box.high_water == 2
    assert [(await box.receive()).rid for _ in range(2)] == ["2", "3"]
    assert box.depth == 0


async def test_close_ends_iteration_after_draining() -> None:
    box = Mailbox[AbortRequest]("a", AbortRequest, 4)
    await box.send(AbortRequest("1"))
    box.close()
    assert [m.rid async for m in box] == ["1"]
    with pytest.raises(MailboxClosed):
        box.receive_nowait()  # drained and closed: the same error as receive
    with pytest.raises(MailboxClosed):
        await box.send(AbortRequest("2"))
