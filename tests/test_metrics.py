"""EngineMetrics: the Scheduler's running totals become Prometheus counters; the
Frontend's flow-control figures become gauges."""

from __future__ import annotations

from typing import Any

from actorllm.frontend.actor import Frontend
from actorllm.metrics import EngineMetrics
from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import (
    FrontendInput,
    GenerateRequest,
    OutputBatch,
    SamplingParams,
    SchedulerStats,
    TextDelta,
    TokenizerInput,
)


def value(m: EngineMetrics, name: str) -> float:
    got = m.registry.get_sample_value(f"actorllm:{name}_total")
    assert got is not None, name
    return got


def test_scheduler_totals_become_counters():
    m = EngineMetrics()
    m.on_stats(SchedulerStats(steps=3, forward_s=0.5, sample_s=0.25, num_preemptions=1,
                              late_results_dropped=1))
    m.on_stats(SchedulerStats(steps=7, forward_s=1.5, sample_s=0.25, num_preemptions=2,
                              late_results_dropped=3, num_paused=2, plan_wait_s=0.75))
    assert value(m, "engine_steps") == 7
    assert value(m, "worker_forward_seconds") == 1.5
    assert value(m, "worker_sample_seconds") == 0.25
    assert value(m, "worker_plan_wait_seconds") == 0.75
    assert value(m, "num_preemptions") == 2
    assert value(m, "late_results_dropped") == 3
    assert m.registry.get_sample_value("actorllm:num_requests_paused") == 2
    # A stale (smaller) total never takes a counter back.
    m.on_stats(SchedulerStats(steps=5))
    assert value(m, "engine_steps") == 7


async def test_flow_gauges_are_the_frontends_pending_output(mock_clock: Any) -> None:
    """pending_output_bytes (all requests), pending_output_bytes_max (the most behind one)
    and oldest_undelivered_output_seconds, read when scraped, by value."""
    m = EngineMetrics()
    front = Frontend(Mailbox("frontend", FrontendInput, 8),
                     Mailbox("tokenizer", TokenizerInput, 8), metrics=m)
    a = await front.submit(GenerateRequest("a", SamplingParams(), prompt="x"))
    b = await front.submit(GenerateRequest("b", SamplingParams(), prompt="x"))
    front.handle(OutputBatch.of(deltas=(TextDelta("a", "hello", (1, 2)),)))  # 5 + 2 x 4 bytes
    mock_clock.jump(2.0)
    front.handle(OutputBatch.of(deltas=(TextDelta("b", "hé", (3,)),)))  # 3 + 4 bytes
    mock_clock.jump(1.0)
    front.handle(OutputBatch.of(deltas=(TextDelta("a", "!", (4,)),)))  # 1 + 4: a's oldest stays
    assert (a.pending_bytes, b.pending_bytes) == (18, 7)
    assert gauge(m, "pending_output_bytes") == 25
    assert gauge(m, "pending_output_bytes_max") == 18
    assert gauge(m, "oldest_undelivered_output_seconds") == 3.0
    await a.get()  # a's reader takes everything: b's output is now the oldest and the most
    assert gauge(m, "pending_output_bytes") == 7
    assert gauge(m, "pending_output_bytes_max") == 7
    assert gauge(m, "oldest_undelivered_output_seconds") == 1.0
    await b.get()
    assert [gauge(m, g) for g in ("pending_output_bytes", "pending_output_bytes_max",
                                  "oldest_undelivered_output_seconds")] == [0, 0, 0]


def gauge(m: EngineMetrics, name: str) -> float:
    got = m.registry.get_sample_value(f"actorllm:{name}")
    assert got is not None, name
    return got
