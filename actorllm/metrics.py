"""Engine metrics in prometheus-client objects, one registry per engine.

The Frontend updates them as outputs arrive; the Scheduler's numbers come to it in
``SchedulerStats`` messages (nobody reads another actor's state). The HTTP server
renders the registry at ``/metrics`` with the ``actorllm:`` prefix.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0, 120.0)


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "actorllm:"
        self.num_requests_running = Gauge(p + "num_requests_running", "Sequences running",
                                          registry=r)
        self.num_requests_waiting = Gauge(p + "num_requests_waiting", "Sequences waiting",
                                          registry=r)
        self.kv_cache_usage_perc = Gauge(p + "kv_cache_usage_perc",
                                         "Fraction of KV blocks in use (0-1)", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated",
                                         registry=r)
        self.request_success = Counter(p + "request_success", "Finished requests",
                                       ["finished_reason"], registry=r)
        self.aborted_requests = Counter(p + "aborted_requests", "Requests aborted", registry=r)
        self.late_outputs_dropped = Counter(p + "late_outputs_dropped",
                                            "Outputs for unknown or finished rids, dropped",
                                            registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to final output",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds",
                                    "Arrival to first scheduled", buckets=_LATENCY_BUCKETS,
                                    registry=r)
        self.mailbox_depth = Gauge(p + "mailbox_depth", "Messages waiting", ["mailbox"],
                                   registry=r)
        self.mailbox_high_water = Gauge(p + "mailbox_high_water", "Most messages ever waiting",
                                        ["mailbox"], registry=r)
        self.arrivals = 0

    def on_arrival(self) -> None:
        self.arrivals += 1

    def on_finished(self, reason: str, prompt_tokens: int, e2e_s: float) -> None:
        self.request_success.labels(finished_reason=reason).inc()
        if reason == "abort":
            self.aborted_requests.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e.observe(e2e_s)
