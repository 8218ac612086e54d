"""Reader pacing: how far each reader may fall behind, and what happens when it does.

An object the Frontend owns (:class:`ReaderPacing`). It holds the pacing state: the
streaming collectors with the leaves that fill each, whether each request is paused,
their unread bytes, and the stream-timeout watch. It sends nothing itself: it asks its
owner to send a request's ``FlowControl`` or to abort it, through the two callbacks the
Frontend gives it, so every message still leaves on the Tokenizer's FIFO edge in order.

The ladder, per request (never global): deltas merge in the collector while the reader
is a little behind; over the byte marks (``FlowLimits.behind``) the request's leaves are
paused (the Scheduler keeps their KV, and takes it back if others need it); a read of
what waits resumes them; ``stream_timeout`` seconds in which output waited and the
reader took nothing cancel the request: the reader gets an error after what it had not
read (nothing is dropped), the engine an abort with reason ``stream_timeout``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import trio

from actorllm.clock import now
from actorllm.frontend.collector import OutputCollector
from actorllm.frontend.state import RequestState
from actorllm.metrics import EngineMetrics
from actorllm.wire.outputs import RequestError


@attrs.frozen
class FlowLimits:
    """How far a reader may fall behind (``--max-pending-bytes-per-request``,
    ``--max-pending-bytes``, ``--stream-timeout``); the Frontend's pacing applies them.

    Over its own mark, or over a share of it while the total is over the global mark, a
    request is paused (its leaves leave the batch, keeping their KV) until its reader takes
    what is pending; a request whose reader takes nothing for ``stream_timeout`` seconds
    while the engine still works on it is cancelled with an error. None turns a limit off.
    """

    max_bytes_per_request: int | None = 256 << 10
    max_bytes: int | None = 64 << 20
    stream_timeout: float | None = 30.0

    def __attrs_post_init__(self) -> None:
        for name in ("max_bytes_per_request", "max_bytes"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be at least 1, got {v}")
        if self.stream_timeout is not None and not self.stream_timeout > 0:
            raise ValueError(f"stream_timeout must be positive, got {self.stream_timeout}")

    def behind(self, pending: int, total: int) -> bool:
        """A request with ``pending`` bytes unread (``total`` over all) should pause."""
        own = self.max_bytes_per_request
        if own is not None and pending > own:
            return True
        # Over the global mark, only readers that are behind pause (never everyone): more
        # than an eighth of their own mark, or than 4 KiB without one.
        share = (own // 8) if own is not None else 4096
        return self.max_bytes is not None and total > self.max_bytes and pending > share


UNLIMITED = FlowLimits(None, None, None)

Leaves = Callable[[list[RequestState]], None]


@attrs.define(eq=False)
class Flow:
    """One paced collector: the leaves whose output fills it, and whether they are paused.
    Paused only while output waits (a read of all of it resumes), so an entry is never
    dropped while paused."""

    leaves: list[RequestState] = attrs.Factory(list)
    paused: bool = False


class ReaderPacing:
    """Pause, resume and cancel for lag, per collector.

    ``flow(leaves)``: these leaves' FlowControl may be owed; the owner sends what
    :meth:`paused` says when it sends. ``cancel(leaves)``: abort them (stream timeout).
    """

    def __init__(self, limits: FlowLimits, metrics: EngineMetrics, *, flow: Leaves,
                 cancel: Leaves) -> None:
        self.limits, self.metrics = limits, metrics
        self._flow, self._cancel = flow, cancel
        # Each streaming collector, while it is live or holds unread output.
        self.flows: dict[OutputCollector, Flow] = {}
        self.pending_bytes = 0  # unread, over every collector in flows
        self._stall_wake = trio.Event()
        self._stall_idle = False  # the stall watch sleeps until output waits somewhere

    def track(self, st: RequestState) -> None:
        """Pace ``st``'s (streaming) collector from now on, with ``st`` among its leaves."""
        st.collector.on_read = self.on_read
        self.flows.setdefault(st.collector, Flow()).leaves.append(st)

    def paused(self, col: OutputCollector) -> bool:
        """Whether ``col``'s request should be paused now."""
        flow = self.flows.get(col)
        return flow is not None and flow.paused

    def on_output(self, col: OutputCollector, cost: int, tokens: int, waited: bool) -> None:
        """``col`` took a delta of ``cost`` bytes and ``tokens`` tokens (``waited``: output
        was waiting already): count it, and pause the request if its reader is behind."""
        self.pending_bytes += cost
        if tokens:
            self.metrics.consumer_lag.observe(col.pending_tokens)
        self._now_waits(waited)
        self.pace(col)

    def on_finish(self, col: OutputCollector) -> None:
        """One of ``col``'s choices ended: its end waits for the reader like any output
        (a stream's chunk with its finish_reason), so a reader that takes nothing while
        the other choices run is stalled as well. (The watch, if it sleeps with no
        deadline, is woken even if other output waited: it only looks again.)"""
        if not col.final_only and not col.engine_done.is_set():
            self._now_waits(False)

    def _now_waits(self, waited: bool) -> None:
        """Output waits where nothing did (``waited`` False): wake the stall watch if it
        sleeps with no deadline."""
        if not waited and self._stall_idle:
            self._stall_idle = False
            self._stall_wake.set()

    def pace(self, col: OutputCollector) -> None:
        """Pause ``col``'s request if its reader is too far behind."""
        flow = self.flows.get(col)
        if flow is None or flow.paused or col.engine_done.is_set():
            return
        if self.limits.behind(col.pending_bytes, self.pending_bytes):
            flow.paused = True
            self.metrics.requests_paused.inc()
            self._flow(flow.leaves)

    def on_read(self, col: OutputCollector, cost: int, tokens: int) -> None:
        """The reader took ``cost`` bytes (``tokens`` tokens): resume it if it was paused."""
        self.pending_bytes -= cost
        if tokens:
            self.metrics.tokens_per_output_event.observe(tokens)
        flow = self.flows.get(col)
        if flow is not None and flow.paused and not col.pending_bytes:
            self.resume(col, flow)
        self.untrack_if_idle(col)

    def resume(self, col: OutputCollector, flow: Flow) -> None:
        """``col``'s reader caught up: its leaves may run again."""
        flow.paused = False
        if not col.engine_done.is_set():
            self.metrics.requests_resumed.inc()
            self._flow(flow.leaves)

    def untrack_if_idle(self, col: OutputCollector) -> None:
        """Stop pacing ``col`` once the engine is done with it and nothing waits."""
        if col.engine_done.is_set() and not col.pending_bytes:
            self.flows.pop(col, None)

    async def watch_stalls(self) -> None:
        """Cancel requests whose reader took nothing for ``stream_timeout`` seconds while
        output waited. Sleeps until the earliest such deadline, or until output waits."""
        timeout = self.limits.stream_timeout
        if timeout is None:
            return
        while True:
            t = now()
            deadline = math.inf
            for col, flow in list(self.flows.items()):
                if col.engine_done.is_set() or col.oldest is None:
                    continue  # the engine is done (the HTTP write timeout takes over), or
                    # nothing waits for the reader
                stalled = col.stalled_for(t)
                if stalled >= timeout:
                    self._cancel_stalled(col, flow.leaves, timeout)
                else:
                    deadline = min(deadline, t + timeout - stalled)
            self._stall_idle = deadline == math.inf
            with trio.move_on_at(deadline):
                await self._stall_wake.wait()
            self._stall_wake = trio.Event()

    def _cancel_stalled(self, col: OutputCollector, leaves: list[RequestState],
                        timeout: float) -> None:
        self.metrics.requests_cancelled_for_lag.inc()
        col.put_error(RequestError(
            f"the client read nothing for {timeout:g} s while output waited "
            "(--stream-timeout); the request was cancelled", "stream_timeout"))
        self._cancel(leaves)
