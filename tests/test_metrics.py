"""EngineMetrics: the Scheduler's running totals become Prometheus counters."""

from __future__ import annotations

from actorllm.messages import SchedulerStats
from actorllm.metrics import EngineMetrics


def value(m: EngineMetrics, name: str) -> float:
    got = m.registry.get_sample_value(f"actorllm:{name}_total")
    assert got is not None, name
    return got


def test_scheduler_totals_become_counters():
    m = EngineMetrics()
    m.on_stats(SchedulerStats(steps=3, forward_s=0.5, sample_s=0.25, num_preemptions=1))
    m.on_stats(SchedulerStats(steps=7, forward_s=1.5, sample_s=0.25, num_preemptions=2))
    assert value(m, "engine_steps") == 7
    assert value(m, "worker_forward_seconds") == 1.5
    assert value(m, "worker_sample_seconds") == 0.25
    assert value(m, "num_preemptions") == 2
    # A stale (smaller) total never takes a counter back.
    m.on_stats(SchedulerStats(steps=5))
    assert value(m, "engine_steps") == 7
