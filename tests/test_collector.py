"""The output collector's life (its phase table) and the Frontend's reader pacing, each
alone: what the collector lets its writer do in each phase, and what the pacing makes
the Frontend send when a reader falls behind, catches up or stalls."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from actorllm.frontend.actor import Frontend
from actorllm.frontend.collector import (
    ENGINE_DONE,
    MOVES,
    IllegalMove,
    OutputCollector,
    Phase,
)
from actorllm.frontend.readers import FlowLimits
from actorllm.metrics import EngineMetrics
from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import (
    AbortRequest,
    FlowControl,
    FrontendInput,
    GenerateRequest,
    OutputBatch,
    RequestFinished,
    SamplingParams,
    TextDelta,
    TokenizerInput,
)
from actorllm.wire.outputs import EndOfOutput, RequestError

# --- the collector's phases ----------------------------------------------------------------


async def test_a_finished_request_ends_then_closes_when_read() -> None:
    col = OutputCollector("r", 2)
    col.put_delta(0, "a", (1,), ())
    col.put_finish(0, "stop", None)
    assert col.phase is Phase.OPEN and not col.finished  # one choice of two
    col.put_finish(1, "length", None)
    assert col.phase is Phase.ENDED and col.finished and col.engine_done.is_set()
    out = await col.get()
    assert out.finished and [o.finish_reason for o in out.outputs] == ["stop", "length"]
    assert col.phase is Phase.CLOSED
    with pytest.raises(EndOfOutput):
        await col.get()


async def test_an_error_is_raised_after_what_came_before_it_then_closes() -> None:
    col = OutputCollector("r", 1)
    col.put_delta(0, "kept", (1,), ())
    col.put_error(RequestError("first", "internal"))
    col.put_error(RequestError("second", "internal"))  # the first error is the one kept
    assert col.phase is Phase.FAILED and col.failed and col.engine_done.is_set()
    out = await col.get()
    assert out.outputs[0].text == "kept" and not out.finished
    with pytest.raises(RequestError, match="first"):
        await col.get()
    assert col.phase is Phase.CLOSED
    col.put_error(RequestError("late", "engine_dead"))  # (the engine died after): no change
    with pytest.raises(EndOfOutput):
        await col.get()


async def test_a_reader_that_left_keeps_nothing_but_still_hears_the_engine_end() -> None:
    col = OutputCollector("r", 2)
    col.put_delta(0, "unread", (1,), ())
    col.discard()
    assert col.phase is Phase.LEFT and not col.finished and col.pending_items() == 0
    col.put_delta(1, "dropped", (2,), ())
    col.put_finish(0, "stop", None)
    assert col.pending_items() == 0 and col.pending_bytes == 0 and not col.finished
    col.put_finish(1, "stop", None)
    assert col.phase is Phase.CLOSED and col.finished and col.engine_done.is_set()
    assert col.take() is None
    with pytest.raises(EndOfOutput):
        await col.get()


@pytest.mark.parametrize(("setup", "put"), [
    ("finish", "delta"), ("finish", "finish"), ("finish", "error"),
    ("error", "delta"), ("error", "finish"),
])
def test_a_writer_bug_is_an_illegal_move(setup: str, put: str) -> None:
    col = OutputCollector("r", 1)
    if setup == "finish":
        col.put_finish(0, "stop", None)
    else:
        col.put_error(RequestError("x"))
    before = col.phase
    with pytest.raises(IllegalMove) as err:
        if put == "delta":
            col.put_delta(0, "late", (9,), ())
        elif put == "finish":
            col.put_finish(0, "stop", None)
        else:
            col.put_error(RequestError("late"))
    assert err.value.phase is before and before.name in str(err.value)
    assert col.phase is before


def test_the_phase_table_only_ever_moves_towards_closed() -> None:
    """Every phase reaches CLOSED; once the engine is done it stays done; CLOSED is last."""
    assert set(MOVES) == set(Phase)
    reach: dict[Phase, set[Phase]] = {p: set(MOVES[p].values()) for p in Phase}
    for _ in Phase:
        for p in Phase:
            reach[p] |= {r for q in reach[p] for r in MOVES[q].values()}
    assert all(Phase.CLOSED in reach[p] for p in Phase)
    assert reach[Phase.OPEN] == set(Phase)
    for p in ENGINE_DONE:
        assert reach[p] <= ENGINE_DONE
    assert set(MOVES[Phase.CLOSED].values()) == {Phase.CLOSED}


# --- the reader pacing, owned by the Frontend ------------------------------------------------


def _frontend(limits: FlowLimits) -> tuple[Frontend, Mailbox[TokenizerInput], EngineMetrics]:
    tok: Mailbox[TokenizerInput] = Mailbox("tokenizer", TokenizerInput, 8)
    metrics = EngineMetrics()
    return Frontend(Mailbox("frontend", FrontendInput, 8), tok, metrics=metrics,
                    limits=limits), tok, metrics


def _drain(tok: Mailbox[TokenizerInput]) -> list[Any]:
    got = []
    while tok.depth:
        got.append(tok.receive_nowait())
    return got


async def test_a_reader_behind_is_paused_then_resumed_when_it_reads() -> None:
    front, tok, metrics = _frontend(FlowLimits(max_bytes_per_request=8, max_bytes=None,
                                               stream_timeout=None))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(front.run)
        col = await front.submit(GenerateRequest("a", SamplingParams(), prompt="x"))
        assert [type(m) for m in _drain(tok)] == [GenerateRequest]
        front.handle(OutputBatch.of(deltas=(TextDelta("a", "1234", (1,)),)))  # 8 bytes: not over
        await trio.testing.wait_all_tasks_blocked()
        assert not front.pacing.paused(col) and _drain(tok) == []
        front.handle(OutputBatch.of(deltas=(TextDelta("a", "5", (2,)),)))  # 13 bytes: over
        await trio.testing.wait_all_tasks_blocked()
        assert front.pacing.paused(col) and front.pending_bytes == 13
        assert _drain(tok) == [FlowControl("a", True, 0)]
        out = await col.get()
        assert out.outputs[0].text == "12345"
        await trio.testing.wait_all_tasks_blocked()
        assert not front.pacing.paused(col) and front.pending_bytes == 0
        assert _drain(tok) == [FlowControl("a", False, 0)]
        front.handle(OutputBatch.of(finished=(RequestFinished("a", "stop", 1),)))
        await col.get()
        assert col not in front.pacing.flows  # the engine is done and nothing waits
        nursery.cancel_scope.cancel()
    assert metrics.registry.get_sample_value("actorllm:requests_paused_total") == 1
    assert metrics.registry.get_sample_value("actorllm:requests_resumed_total") == 1


async def test_a_stalled_reader_is_cancelled_after_the_stream_timeout(mock_clock: Any) -> None:
    front, tok, metrics = _frontend(FlowLimits(None, None, stream_timeout=5.0))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(front.run)
        col = await front.submit(GenerateRequest("a", SamplingParams(), prompt="x"))
        _drain(tok)
        mock_clock.jump(60.0)  # a reader waiting for the engine is not behind
        await trio.testing.wait_all_tasks_blocked()
        assert not col.failed
        front.handle(OutputBatch.of(deltas=(TextDelta("a", "hi", (1,)),)))
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(4.9)
        await trio.testing.wait_all_tasks_blocked()
        assert not col.failed and _drain(tok) == []
        mock_clock.jump(0.2)
        await trio.testing.wait_all_tasks_blocked()
        assert col.failed and col.phase is Phase.FAILED
        assert _drain(tok) == [AbortRequest("a", 0)]
        assert (await col.get()).outputs[0].text == "hi"  # what waited is not dropped
        with pytest.raises(RequestError) as err:
            await col.get()
        assert err.value.code == "stream_timeout"
        nursery.cancel_scope.cancel()
    assert metrics.registry.get_sample_value(
        "actorllm:aborted_requests_total", {"reason": "stream_timeout"}) == 1
