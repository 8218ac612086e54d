"""``actorllm:aborted_requests`` is labelled by why a request was stopped (issue 13):
each reason counted by value, with no other reason moving. ``client_disconnect`` is
counted in tests/test_server_app.py, ``stream_timeout`` in tests/test_slow_readers.py and
tests/test_slow_clients.py."""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing
from helpers import CONTEXT, Call, app_for

from actorllm.engine.async_engine import AsyncEngine
from actorllm.frontend.actor import Frontend
from actorllm.metrics import EngineMetrics
from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import (
    AbortRequest,
    FrontendInput,
    GenerateRequest,
    OutputBatch,
    RequestFinished,
    SamplingParams,
    TokenizerInput,
)
from actorllm.wire.outputs import RequestError

REASONS = ("client_disconnect", "stream_timeout", "drain_timeout", "sibling_failed",
           "engine_dead", "user")
LONG = SamplingParams(max_tokens=CONTEXT - 20, ignore_eos=True)


def counts(metrics: EngineMetrics) -> dict[str, float]:
    """Every reason's count (0 where it never moved)."""
    get = metrics.registry.get_sample_value
    return {r: get("actorllm:aborted_requests_total", {"reason": r}) or 0.0 for r in REASONS}


def only(reason: str, n: int) -> dict[str, float]:
    return {r: float(n) if r == reason else 0.0 for r in REASONS}


async def _until(cond: object, timeout: float = 30.0) -> None:
    with trio.fail_after(timeout):
        while not cond():  # type: ignore[operator]
            await trio.sleep(0.001)


async def test_an_api_abort_counts_as_user(engine: AsyncEngine) -> None:
    col = await engine.submit(GenerateRequest("u", LONG, prompt="Hello"))
    await _until(lambda: engine.frontend.stats.num_running == 1)
    await engine.abort("u")
    await engine.abort("u")  # idempotent: counted once
    outs = [o async for o in col]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert counts(engine.metrics) == only("user", 1)


async def test_a_drain_cut_counts_each_leaf_as_drain_timeout(engine: AsyncEngine) -> None:
    app = app_for(engine)
    call = Call("/v1/completions", {"prompt": "Hi", "n": 2, "max_tokens": CONTEXT - 20,
                                    "ignore_eos": True, "stream": True})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call.run, app)
        await _until(lambda: len(call.chunks) >= 4)
        app.state.server.drain_expired.set()
    assert json.loads(call.events()[-2])["error"]["code"] == "shutting_down"
    assert await engine.wait_drained(30.0) == []
    assert counts(engine.metrics) == only("drain_timeout", 2)


async def test_a_failed_prompt_aborts_the_other_prompts_as_sibling_failed(
        engine: AsyncEngine) -> None:
    # Two prompts, one request: the second is too long for the model and the Tokenizer
    # rejects it, while the first runs. The client gets the error; the first is aborted.
    app = app_for(engine)
    call = await Call("/v1/completions", {"prompt": ["Hello", "word " * (2 * CONTEXT)],
                                          "max_tokens": CONTEXT - 20, "ignore_eos": True,
                                          "stream": True}).run(app)
    # (The rejection comes before the first token, so the error is a 400, not an event.)
    assert call.status == 400 and call.json()["error"]["param"] == "prompt", call.chunks
    assert await engine.wait_drained(30.0) == []
    assert counts(engine.metrics) == only("sibling_failed", 1)


def frontend() -> tuple[Frontend, Mailbox[TokenizerInput], Mailbox[FrontendInput]]:
    inbox: Mailbox[FrontendInput] = Mailbox("frontend", FrontendInput, 8)
    tok: Mailbox[TokenizerInput] = Mailbox("tokenizer", TokenizerInput, 8)
    return Frontend(inbox, tok, metrics=EngineMetrics()), tok, inbox


async def test_a_failed_child_aborts_its_siblings_as_sibling_failed() -> None:
    front, tok, inbox = frontend()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(front.run)
        col = await front.submit(GenerateRequest("p", SamplingParams(n=3), prompt="x"))
        sent = [tok.receive_nowait() for _ in range(3)]
        assert [m.rid for m in sent] == ["p-0", "p-1", "p-2"]
        await inbox.send(OutputBatch.of(finished=(RequestFinished("p-1", "error",
                                                                error="step failed"),)))
        await trio.testing.wait_all_tasks_blocked()
        aborts = [tok.receive_nowait() for _ in range(tok.depth)]
        assert aborts == [AbortRequest("p-0"), AbortRequest("p-2")]
        with pytest.raises(RequestError):
            await col.get()
        nursery.cancel_scope.cancel()
    assert counts(front.metrics) == only("sibling_failed", 2)


async def test_a_lost_engine_counts_each_live_leaf_as_engine_dead() -> None:
    front, _, _ = frontend()
    await front.submit(GenerateRequest("p", SamplingParams(n=2), prompt="x"))
    await front.submit(GenerateRequest("q", SamplingParams(), prompt="x"))
    front.handle(OutputBatch.of(finished=(RequestFinished("q", "length"),)))  # answered: not lost
    assert front.lose_all("the engine process died") == 3
    assert counts(front.metrics) == only("engine_dead", 2)


async def test_a_request_aborted_before_the_engine_died_counts_once() -> None:
    # Its abort counted it as "user"; the death that then answers it is not a second abort.
    front, _, _ = frontend()
    await front.submit(GenerateRequest("u", SamplingParams(), prompt="x"))
    await front.submit(GenerateRequest("v", SamplingParams(), prompt="x"))
    await front.abort("u")
    assert front.lose_all("the engine process died") == 2
    assert counts(front.metrics) == {**only("user", 1), "engine_dead": 1.0}
