"""Engine metrics in prometheus-client objects, one registry per engine.

The Frontend updates them as outputs arrive; the Scheduler's numbers come to it in
``SchedulerStats`` messages (nobody reads another actor's state). The HTTP server
renders the registry at ``/metrics`` with the ``actorllm:`` prefix.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

# Tokens: a reader's lag, and how many tokens one read (one SSE event) carries.
_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0, 120.0)

#: A step's phases, in the order a token meets them (``actorllm:step_phase_seconds``), and
#: the ``SchedulerStats`` field each is read from; ``route`` (the Frontend's handling of an
#: ``OutputBatch``), ``http_render`` (SSE chunks rendered and encoded) and ``http_write``
#: (the response's sends, as ``socket_blocked_seconds``: a write the socket takes at once
#: never yields, see server/timeouts.py) are counted where they happen.
PHASES: tuple[tuple[str, str | None], ...] = (
    ("plan", "plan_s"), ("pack", "pack_s"), ("forward", "forward_s"), ("sample", "sample_s"),
    ("commit", "commit_s"), ("detokenize", "detokenize_s"), ("route", None),
    ("http_render", None), ("http_write", None))


class StepHistogram:
    """A histogram the Frontend observes many times per step (per request per step), so
    its ``observe`` must cost next to nothing: a bisect and two additions, no lock (one
    trio thread writes it; a scrape reads a copy). Scraped as a plain Prometheus histogram
    of the same name, buckets and samples as ``prometheus_client.Histogram``'s."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = [float(b) for b in buckets]
        if self.bounds[-1] != math.inf:
            self.bounds.append(math.inf)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        """One observation (``value <= bound`` falls in that bound's bucket, as in
        prometheus_client)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self) -> Iterator[Metric]:
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, n in zip(self.bounds, counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets,
                                    sum_value=total)

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation)


class EngineMetrics:
    """The engine's series, in one registry of their own (``registry``)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "actorllm:"
        self._request_series(r, p)
        self._engine_series(r, p)
        self._flow_series(r, p)
        self._replica_series(r, p)
        self._replica_totals: dict[tuple[int, str], float] = {}
        self._totals = {"steps": 0.0, "forward_s": 0.0, "sample_s": 0.0, "plan_wait_s": 0.0,
                        "num_preemptions": 0.0, "prefix_cache_queries": 0.0,
                        "prefix_cache_hits": 0.0, "late_results_dropped": 0.0,
                        "seq_steps": 0.0, "spec_draft_tokens": 0.0,
                        "spec_accepted_tokens": 0.0, "spec_num_drafts": 0.0}
        self._spec_pos_totals: list[float] = []
        self._phase_totals = {field: 0.0 for _, field in PHASES if field}
        self.arrivals = 0

    def _request_series(self, r: CollectorRegistry, p: str) -> None:
        """Requests, tokens, latencies and mailboxes."""
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
        # Labelled by why: client_disconnect, stream_timeout, drain_timeout, sibling_failed,
        # engine_dead, user (each leaf counts once, under the first reason).
        self.aborted_requests = Counter(p + "aborted_requests", "Requests aborted",
                                        ["reason"], registry=r)
        self.late_outputs_dropped = Counter(p + "late_outputs_dropped",
                                            "Outputs for unknown or finished rids, dropped",
                                            registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = StepHistogram(p + "inter_token_latency_seconds", "Time between tokens "
                                 "(a step that brings a request k tokens observes its gap / k "
                                 "once)", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to final output",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds",
                                    "Arrival to first scheduled", buckets=_LATENCY_BUCKETS,
                                    registry=r)
        self.mailbox_depth = Gauge(p + "mailbox_depth", "Messages waiting", ["mailbox"],
                                   registry=r)
        self.mailbox_high_water = Gauge(p + "mailbox_high_water", "Most messages ever waiting",
                                        ["mailbox"], registry=r)

    def _engine_series(self, r: CollectorRegistry, p: str) -> None:
        """The Scheduler's running totals (``SchedulerStats``), as counters: what the engine
        did and how long the Worker was busy doing it (a benchmark's idle-gap figure)."""
        self.engine_steps = Counter(p + "engine_steps", "Steps the Worker ran", registry=r)
        self.worker_forward_seconds = Counter(p + "worker_forward_seconds",
                                              "Worker time in forward passes", registry=r)
        self.worker_sample_seconds = Counter(p + "worker_sample_seconds",
                                             "Worker time in sampling", registry=r)
        # Idle between steps for want of a plan: the engine waiting on the Scheduler's loop.
        self.worker_plan_wait_seconds = Counter(
            p + "worker_plan_wait_seconds",
            "Worker time idle between steps waiting for the next plan", registry=r)
        # Host cost per step (issue 28): each phase's seconds, summed over steps, and the
        # sequence-steps they served, so seconds / sequence-steps is a phase's cost per
        # sequence per step. Every actor times a step once (a perf_counter pair), never
        # per token.
        self.step_phase_seconds = Counter(
            p + "step_phase_seconds", "Time in each phase of a step, summed over steps: "
            "plan, pack, forward, sample, commit (Scheduler and Worker), detokenize, route "
            "(the Frontend's handling of an output batch), http_render (SSE chunks rendered "
            "and encoded), http_write (HTTP sends, with any wait for a slow client)",
            ["phase"], registry=r)
        self.phase = {name: self.step_phase_seconds.labels(phase=name) for name, _ in PHASES}
        self.engine_sequence_steps = Counter(
            p + "engine_sequence_steps", "Sequences in the steps the Worker ran, summed (a "
            "sequence in one step is one sequence-step)", registry=r)
        self.num_preemptions = Counter(p + "num_preemptions", "Sequences preempted",
                                       registry=r)
        # Tokens looked up in the prefix cache at admissions, and found (vLLM's names).
        self.prefix_cache_queries = Counter(p + "prefix_cache_queries",
                                            "Prefix cache lookups, in tokens", registry=r)
        self.prefix_cache_hits = Counter(p + "prefix_cache_hits",
                                         "Prefix cache hits, in tokens", registry=r)
        self.late_results_dropped = Counter(
            p + "late_results_dropped", "Step results the Scheduler dropped (for sequences "
            "that had ended, or stale)", registry=r)
        # Speculative decoding (vLLM's spec_decode_* in spirit): acceptance rate is
        # accepted / draft tokens, mean accepted length per verified row accepted / drafts.
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens",
                                         "Draft tokens proposed", registry=r)
        self.spec_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted", registry=r)
        self.spec_num_drafts = Counter(p + "spec_decode_num_drafts",
                                       "Rows that carried draft tokens (verifications)",
                                       registry=r)
        self.spec_accepted_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
            "position in their row (0: the first draft)", ["position"], registry=r)

    def _flow_series(self, r: CollectorRegistry, p: str) -> None:
        """Slow readers (the Frontend's flow control; docs/architecture.md)."""
        self.consumer_lag = StepHistogram(
            p + "consumer_lag_tokens", "Tokens generated and not yet read by the client, "
            "observed per request at each step that brings it tokens (once per token when "
            "a step brings one)", buckets=_TOKEN_BUCKETS, registry=r)
        self.tokens_per_output_event = StepHistogram(
            p + "tokens_per_output_event", "Tokens merged into one read (one SSE event)",
            buckets=_TOKEN_BUCKETS[1:], registry=r)
        self.pending_output_bytes = Gauge(p + "pending_output_bytes",
                                          "Output bytes waiting for their readers", registry=r)
        self.pending_output_bytes_max = Gauge(
            p + "pending_output_bytes_max", "Most output bytes waiting for one request",
            registry=r)
        self.oldest_undelivered_output = Gauge(
            p + "oldest_undelivered_output_seconds", "Age of the oldest output no reader "
            "has taken", registry=r)
        self.socket_blocked_seconds = Counter(
            p + "socket_blocked_seconds", "Time HTTP responses spent waiting to write to "
            "the socket", registry=r)
        self.requests_paused = Counter(p + "requests_paused", "Requests paused because "
                                       "their reader was behind", registry=r)
        self.requests_resumed = Counter(p + "requests_resumed", "Paused requests resumed "
                                        "because their reader caught up", registry=r)
        self.requests_cancelled_for_lag = Counter(
            p + "requests_cancelled_for_lag", "Requests cancelled after --stream-timeout "
            "without a read", registry=r)
        self.num_requests_paused = Gauge(p + "num_requests_paused", "Sequences paused",
                                         registry=r)

    def _replica_series(self, r: CollectorRegistry, p: str) -> None:
        """Data parallelism: each replica's figures, labelled (the other series are totals)."""
        self.replica_num_requests_running = Gauge(
            p + "replica_num_requests_running", "Sequences running, per replica",
            ["replica"], registry=r)
        self.replica_num_requests_waiting = Gauge(
            p + "replica_num_requests_waiting", "Sequences waiting, per replica",
            ["replica"], registry=r)
        self.replica_kv_cache_usage_perc = Gauge(
            p + "replica_kv_cache_usage_perc", "Fraction of a replica's KV blocks in use",
            ["replica"], registry=r)
        self.replica_outstanding_tokens = Gauge(
            p + "replica_outstanding_tokens", "Tokens the Frontend estimates a replica still "
            "has to process (its routing load)", ["replica"], registry=r)
        self.replica_up = Gauge(p + "replica_up", "1 while a replica serves, 0 once it died",
                                ["replica"], registry=r)
        self.replica_requests_routed = Counter(
            p + "replica_requests_routed", "Requests (leaves) routed to a replica",
            ["replica"], registry=r)
        self.replica_engine_steps = Counter(p + "replica_engine_steps", "Steps a replica's "
                                            "Worker ran", ["replica"], registry=r)
        self.replica_prefix_cache_hits = Counter(
            p + "replica_prefix_cache_hits", "Prefix cache hits, in tokens, per replica",
            ["replica"], registry=r)
        self.replica_deaths = Counter(p + "replica_deaths", "Replicas whose process died "
                                      "while the others served on", registry=r)

    def on_stats(self, stats: Any) -> None:
        """Advance the counters to a ``SchedulerStats``' running totals."""
        for name, counter in (("steps", self.engine_steps),
                              ("forward_s", self.worker_forward_seconds),
                              ("sample_s", self.worker_sample_seconds),
                              ("plan_wait_s", self.worker_plan_wait_seconds),
                              ("num_preemptions", self.num_preemptions),
                              ("prefix_cache_queries", self.prefix_cache_queries),
                              ("prefix_cache_hits", self.prefix_cache_hits),
                              ("late_results_dropped", self.late_results_dropped),
                              ("seq_steps", self.engine_sequence_steps),
                              ("spec_draft_tokens", self.spec_draft_tokens),
                              ("spec_accepted_tokens", self.spec_accepted_tokens),
                              ("spec_num_drafts", self.spec_num_drafts)):
            value = float(getattr(stats, name))
            if value > self._totals[name]:  # totals only grow within one Scheduler
                counter.inc(value - self._totals[name])
                self._totals[name] = value
        for phase, field in PHASES:
            if field is not None:
                value = float(getattr(stats, field))
                if value > self._phase_totals[field]:
                    self.phase[phase].inc(value - self._phase_totals[field])
                    self._phase_totals[field] = value
        self.num_requests_paused.set(getattr(stats, "num_paused", 0))
        self._on_spec_positions(getattr(stats, "spec_accepted_per_pos", ()))

    def _on_spec_positions(self, counts: tuple[int, ...]) -> None:
        totals = self._spec_pos_totals
        totals.extend([0.0] * (len(counts) - len(totals)))
        for pos, value in enumerate(counts):
            if value > totals[pos]:
                self.spec_accepted_per_pos.labels(position=str(pos)).inc(value - totals[pos])
                totals[pos] = float(value)

    def on_replica_stats(self, stats: Any, outstanding: int, routed: int, up: bool) -> None:
        """One replica's ``SchedulerStats`` (and the Router's view of it) into its series."""
        label = str(stats.replica)
        self.replica_num_requests_running.labels(replica=label).set(stats.num_running)
        self.replica_num_requests_waiting.labels(replica=label).set(stats.num_waiting)
        self.replica_kv_cache_usage_perc.labels(replica=label).set(
            stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        self.replica_outstanding_tokens.labels(replica=label).set(outstanding)
        self.replica_up.labels(replica=label).set(1.0 if up else 0.0)
        for name, counter, value in (
                ("steps", self.replica_engine_steps, stats.steps),
                ("hits", self.replica_prefix_cache_hits, stats.prefix_cache_hits),
                ("routed", self.replica_requests_routed, routed)):
            key = (stats.replica, name)
            if value > self._replica_totals.get(key, 0.0):
                counter.labels(replica=label).inc(value - self._replica_totals.get(key, 0.0))
                self._replica_totals[key] = float(value)

    def watch_flows(self, pacing: Any) -> None:
        """Read the Frontend's flow-control figures when scraped (they change per token):
        ``pacing`` is its ReaderPacing, with ``pending_bytes`` and the collectors it paces
        (``flows``)."""
        from actorllm.clock import now

        self.pending_output_bytes.set_function(lambda: pacing.pending_bytes)
        self.pending_output_bytes_max.set_function(
            lambda: max((c.pending_bytes for c in pacing.flows), default=0))
        self.oldest_undelivered_output.set_function(
            lambda: max((c.age(now()) for c in pacing.flows), default=0.0))

    def on_arrival(self) -> None:
        self.arrivals += 1

    def on_finished(self, reason: str, prompt_tokens: int, e2e_s: float) -> None:
        self.request_success.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e.observe(e2e_s)
