"""A burst of requests at once (issue 28): how many turns of the loop and how many steps
it takes before every request has its first token. Events and counts, never clocks.

Under load every ``await`` that yields waits for all the other tasks of the loop (in the
``engine`` topology the parent's loop renders hundreds of streams), so an actor that
yields once per message delays the last of a burst by the burst's length times a long
turn. An actor now takes every message waiting in one wake-up (``wire/mailbox.batches``)
and sends without yielding while its peer has room (``send_soon``).
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
import trio
import trio.testing

from actorllm.frontend.actor import Frontend
from actorllm.scheduler.actor import Scheduler
from actorllm.server import accept
from actorllm.server.main import LISTEN_BACKLOG, _hypercorn_config, _Options
from actorllm.tokenizer.actor import Tokenizer
from actorllm.wire.mailbox import Mailbox, MailboxClosed, batches, receive_waiting, send_soon
from actorllm.wire.messages import (
    FrontendInput,
    GenerateRequest,
    OutputBatch,
    SampledToken,
    SamplingParams,
    SchedulerInput,
    SequenceRequest,
    StepPlan,
    StepResult,
    TextDelta,
    TokenBatch,
    TokenizerInput,
)

BURST = 64


class Ids:
    """An encoder for prompts given as ids: what the Tokenizer checks, nothing else."""

    def encode(self, req: GenerateRequest) -> SequenceRequest:
        assert req.prompt_token_ids is not None
        return SequenceRequest(req.rid, tuple(req.prompt_token_ids), req.params, 4, (1,))


async def count_turns(turns: list[int]) -> None:
    """A neighbour that takes one turn in every round of the loop, as a stream does."""
    while True:
        turns[0] += 1
        await trio.sleep(0)


def test_the_tokenizer_moves_a_burst_in_one_wake_up() -> None:
    """BURST requests waiting in the Tokenizer's inbox reach the Scheduler's inbox within a
    couple of turns of a busy neighbour (one yield per request made it 2 x BURST)."""
    inbox: Mailbox[Any] = Mailbox("tokenizer", TokenizerInput, BURST)
    sched: Mailbox[Any] = Mailbox("scheduler", SchedulerInput, BURST)
    front: Mailbox[Any] = Mailbox("frontend", FrontendInput, 4)
    for i in range(BURST):
        inbox.send_nowait(GenerateRequest(f"r{i}", SamplingParams(max_tokens=4),
                                          prompt_token_ids=(5, 6, 7)))
    turns = [0]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(count_turns, turns)
            await trio.sleep(0)
            start = turns[0]
            nursery.start_soon(Tokenizer(Ids(), inbox, sched, front).run)  # type: ignore[arg-type]
            while sched.depth < BURST:
                await trio.sleep(0)
            turns[0] -= start
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert sched.depth == BURST and front.depth == 0
    got = [sched.receive_nowait().rid for _ in range(BURST)]
    assert got == [f"r{i}" for i in range(BURST)]  # in arrival order
    assert turns[0] <= 4, f"the burst took {turns[0]} turns of the loop"


def test_the_first_step_takes_the_whole_burst_and_every_request_starts_in_two() -> None:
    """BURST prompts of 16 tokens waiting before the Scheduler runs, with room for 34 of
    them a step: the first step prefills 34 (not the first arrival alone: the budget is
    shared by what waits), and after two steps every request has its first token."""
    inbox: Mailbox[Any] = Mailbox("scheduler", SchedulerInput, 2 * BURST)
    worker: Mailbox[Any] = Mailbox("worker", StepPlan, 2)
    detok: Mailbox[Any] = Mailbox("detokenizer", TokenBatch, 2 * BURST)
    s = Scheduler(inbox, worker, detok, num_blocks=BURST * 8, block_size=16,
                  max_num_seqs=BURST, max_num_batched_tokens=34 * 16)
    for i in range(BURST):
        inbox.send_nowait(SequenceRequest(f"r{i}", tuple(range(10, 26)),
                                          SamplingParams(max_tokens=4), 4, (1,)))
    rows: list[int] = []
    first: set[str] = set()

    async def play_worker() -> None:
        async for plan in worker:
            rows.append(len(plan.rids))
            first.update(plan.sampled_rids())
            await inbox.send(StepResult.of_tokens(plan, (SampledToken(r, 7)
                                                         for r in plan.sampled_rids())))
            if len(first) == BURST:
                return

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.run)
            await play_worker()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert rows[0] == 34
    assert len(rows) == 2, f"steps before every request had a token: {rows}"


def test_receive_waiting_takes_what_waits_up_to_its_limit_and_ends_when_closed() -> None:
    box: Mailbox[Any] = Mailbox("box", int, 8)
    for i in range(5):
        box.send_nowait(i)

    async def main() -> list[list[int]]:
        got = [await receive_waiting(box, limit=3), await receive_waiting(box, limit=3)]
        box.close()
        with pytest.raises(MailboxClosed):
            await receive_waiting(box)
        return got

    assert trio.run(main) == [[0, 1, 2], [3, 4]]

    again: Mailbox[Any] = Mailbox("again", int, 8)
    for i in range(4):
        again.send_nowait(i)
    again.close()

    async def drain() -> list[list[int]]:
        return [msgs async for msgs in batches(again, limit=3)]

    assert trio.run(drain) == [[0, 1, 2], [3]]


def test_send_soon_keeps_order_and_waits_while_the_peer_is_full() -> None:
    box: Mailbox[Any] = Mailbox("box", int, 2)
    got: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def sender() -> None:
                for i in range(6):
                    await send_soon(box, i)

            nursery.start_soon(sender)
            await trio.testing.wait_all_tasks_blocked()
            assert box.depth == 2  # full: the sender waits, it did not drop or reorder
            while len(got) < 6:
                got.append(await box.receive())

    trio.run(main)
    assert got == list(range(6))


def test_the_listen_queue_holds_a_burst_of_connections() -> None:
    """hypercorn's default backlog (100) overflowed when 256 clients connected at once; the
    kernel dropped the rest's SYNs and TCP retried them seconds later."""
    opts = _Options(host="127.0.0.1", port=0, api_key=None, name="m", drain_timeout=1.0,
                    max_request_bytes=1 << 20, max_pending=1 << 20)
    assert _hypercorn_config(opts).backlog == LISTEN_BACKLOG >= 1024


def test_the_listener_accepts_a_burst_of_connections_in_one_turn() -> None:
    """BURST clients whose connections the kernel has queued are all accepted (their
    handlers started) within a couple of turns of a busy neighbour: trio's accept yields
    once per connection, 2 x BURST turns (server/accept.py)."""
    assert accept.install()
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(LISTEN_BACKLOG)
    clients = [socket.create_connection(listening.getsockname()) for _ in range(BURST)]
    turns = [0]
    streams: list[trio.SocketStream] = []

    async def main() -> None:
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(listening))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(count_turns, turns)
            await trio.sleep(0)
            start = turns[0]
            while len(streams) < BURST:
                streams.append(await listener.accept())
            turns[0] -= start
            took = turns[0]
            for stream in streams:
                await stream.aclose()
            await listener.aclose()
            turns[0] = took
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        for c in clients:
            c.close()
    assert len(streams) == BURST
    assert turns[0] <= 4, f"{BURST} queued connections took {turns[0]} turns to accept"


def test_a_frontend_behind_by_several_steps_wakes_a_reader_once_for_all_of_them() -> None:
    """Three steps' OutputBatches waiting in the Frontend's inbox: the streaming reader's
    first take holds all three tokens (one wake-up, one HTTP write), not the first alone."""
    tok: Mailbox[Any] = Mailbox("tokenizer", TokenizerInput, 4)
    inbox: Mailbox[Any] = Mailbox("frontend", FrontendInput, 8)
    front = Frontend(inbox, tok)
    takes: list[tuple[int, ...]] = []

    async def main() -> None:
        collector = await front.submit(GenerateRequest("a", SamplingParams(max_tokens=8),
                                                       prompt_token_ids=(5,)))
        for t, text in enumerate("xyz"):
            inbox.send_nowait(OutputBatch.of((TextDelta("a", text, (t,)),)))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(front.run)
            out = await collector.get()
            takes.append(out.outputs[0].token_ids)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert takes == [(0, 1, 2)]


def test_closing_the_listener_closes_connections_accepted_ahead() -> None:
    """A burst accepted ahead but never handed out (the server stopped between two
    accepts) is closed with the listener: the clients see EOF, no descriptor is left."""
    assert accept.install()
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(16)
    clients = [socket.create_connection(listening.getsockname()) for _ in range(4)]

    async def main() -> None:
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(listening))
        first = await listener.accept()  # takes the other three ahead
        await first.aclose()
        await listener.aclose()
        # Still inside the run, the listener still referenced: nothing is closed by
        # garbage collection. The wait is a guard against hanging only.
        for c in clients:
            c.settimeout(30)
            assert c.recv(1) == b"", "a connection accepted ahead was left open"

    try:
        trio.run(main)
    finally:
        for c in clients:
            c.close()
