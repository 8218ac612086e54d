"""The Frontend alone: registration order, fan-out, aborts, the coalescing collector."""

from __future__ import annotations

import trio
import trio.testing

from actorllm.frontend.actor import Frontend
from actorllm.frontend.collector import OutputCollector
from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import (
    AbortRequest,
    FrontendInput,
    GenerateRequest,
    SamplingParams,
    TokenizerInput,
    TokenLogprob,
)


def make() -> tuple[Frontend, Mailbox[TokenizerInput]]:
    tok: Mailbox[TokenizerInput] = Mailbox("tokenizer", TokenizerInput, 1)
    return Frontend(Mailbox("frontend", FrontendInput, 8), tok), tok


async def test_every_child_is_registered_before_the_first_leaves() -> None:
    front, tok = make()
    req = GenerateRequest("p", SamplingParams(n=3), prompt="x")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(front.submit, req)
        await trio.testing.wait_all_tasks_blocked()
        # The mailbox holds one message: submit is blocked sending the second child,
        # and yet every child already exists (else child 0 could end the parent early).
        assert tok.depth == 1
        assert {"p", "p-0", "p-1", "p-2"} <= set(front.registry)
        sent = [await tok.receive() for _ in range(3)]
    assert [m.rid for m in sent] == ["p-0", "p-1", "p-2"]
    assert [m.params.seed for m in sent] == [None, None, None]


async def test_abort_during_submit_follows_the_request_it_cancels() -> None:
    front, tok = make()
    req = GenerateRequest("p", SamplingParams(n=2, seed=5), prompt="x")
    got: list[object] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(front.submit, req)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(front.abort, "p")  # p-1 is registered but not sent yet
        await trio.testing.wait_all_tasks_blocked()
        while len(got) < 4:
            got.append(await tok.receive())
            await trio.testing.wait_all_tasks_blocked()
    kinds = [(type(m).__name__, m.rid) for m in got]
    assert kinds.index(("GenerateRequest", "p-1")) < kinds.index(("AbortRequest", "p-1"))
    assert sorted(kinds) == sorted([("GenerateRequest", "p-0"), ("GenerateRequest", "p-1"),
                                    ("AbortRequest", "p-0"), ("AbortRequest", "p-1")])
    assert [m.params.seed for m in got if isinstance(m, GenerateRequest)] == [5, 6]
    await front.abort("p")  # idempotent: nothing more is sent
    assert tok.depth == 0
    assert not any(isinstance(m, AbortRequest) and m.rid == "p" for m in got)


async def test_collector_merges_for_a_slow_reader_and_keeps_the_finish() -> None:
    col = OutputCollector("r", 2)
    lp = TokenLogprob(1, -0.5)
    for i in range(100):
        col.put_delta(i % 2, f"{i},", (i,), (lp,))
    col.put_finish(0, "stop", "x")
    assert col.pending_items() == 2  # O(1) per choice, whatever the reader's delay
    out = await col.get()
    by_index = {o.index: o for o in out.outputs}
    assert by_index[0].text == "".join(f"{i}," for i in range(0, 100, 2))
    assert by_index[1].token_ids == tuple(range(1, 100, 2))
    assert (by_index[0].finish_reason, by_index[0].stop_reason) == ("stop", "x")
    assert not out.finished
    col.put_finish(1, "length", None)
    last = await col.get()
    assert last.finished and last.outputs[0].finish_reason == "length"
