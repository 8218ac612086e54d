"""The Frontend's side of flow control: how far each reader may fall behind.

A mixin of :class:`actorllm.frontend.actor.Frontend`, kept apart so the Frontend stays one
readable module; it reads and writes only the Frontend's own state (the collectors it
fills, its registry) and speaks to the Scheduler only through ``FlowControl`` and
``AbortRequest`` messages on the Tokenizer's FIFO edge.

The ladder, per request (never global): deltas merge in the collector while the reader
is a little behind; over the byte marks (``FlowLimits.behind``) the request's leaves are
paused (the Scheduler keeps their KV, and takes it back if others need it); a read of
what waits resumes them; ``stream_timeout`` seconds in which output waited and the
reader took nothing cancel the request: the reader gets an error after what it had not
read (nothing is dropped), the engine an abort with reason ``stream_timeout``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio

from actorllm.clock import now
from actorllm.frontend.outputs import FlowLimits, OutputCollector, RequestError
from actorllm.wire.messages import FlowControl

if TYPE_CHECKING:
    from actorllm.frontend.actor import RequestState
    from actorllm.metrics import EngineMetrics
    from actorllm.wire.mailbox import Outbox
    from actorllm.wire.messages import TokenizerInput


class ReaderPacing:
    """Pause, resume and cancel for lag; the Frontend supplies the state below."""

    limits: FlowLimits
    metrics: EngineMetrics
    registry: dict[str, RequestState]
    tokenizer: Outbox[TokenizerInput]
    flows: dict[OutputCollector, list[RequestState]]
    pending_bytes: int
    _flow_next: list[RequestState]
    _abort_next: list[tuple[RequestState, str]]
    _abort_wake: trio.Event
    _stall_wake: trio.Event
    _stall_idle: bool

    def _queue_flow(self, leaves: list[RequestState]) -> None:
        self._flow_next.extend(leaves)
        self._abort_wake.set()

    async def _send_flow(self, st: RequestState) -> None:
        """Tell the Scheduler what the collector's ``paused`` says now, if that is news."""
        want = st.collector.paused
        if (self.registry.get(st.rid) is not st or st.responded or st.abort_sent
                or not st.dispatched or st.paused_sent == want):
            return
        st.paused_sent = want
        await self.tokenizer.send(FlowControl(st.rid, want, st.replica))

    def _pace(self, col: OutputCollector) -> None:
        """After a delta: pause the request if its reader is too far behind."""
        if col.paused or col.engine_done.is_set() or col not in self.flows:
            return
        if self.limits.behind(col.pending_bytes, self.pending_bytes):
            col.paused = True
            self.metrics.requests_paused.inc()
            self._queue_flow(self.flows[col])

    def _on_read(self, col: OutputCollector, cost: int, tokens: int) -> None:
        """The reader took ``cost`` bytes (``tokens`` tokens): resume it if it was paused."""
        self.pending_bytes -= cost
        if tokens:
            self.metrics.tokens_per_output_event.observe(tokens)
        if col.paused and not col.pending_bytes:
            col.paused = False
            if not col.engine_done.is_set():
                self.metrics.requests_resumed.inc()
                self._queue_flow(self.flows.get(col, []))
        self._untrack_if_idle(col)

    def _untrack_if_idle(self, col: OutputCollector) -> None:
        if col.engine_done.is_set() and not col.pending_bytes:
            self.flows.pop(col, None)

    async def _stall_watch(self) -> None:
        """Cancel requests whose reader took nothing for ``stream_timeout`` seconds while
        output waited. Sleeps until the earliest such deadline, or until output waits."""
        timeout = self.limits.stream_timeout
        if timeout is None:
            return
        while True:
            t = now()
            deadline = math.inf
            for col, leaves in list(self.flows.items()):
                if col.engine_done.is_set() or col.oldest is None:
                    continue  # the engine is done (the HTTP write timeout takes over), or
                    # nothing waits for the reader
                stalled = col.stalled_for(t)
                if stalled >= timeout:
                    self._cancel_stalled(col, leaves, timeout)
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
        self._abort_next.extend((st, "stream_timeout") for st in leaves)
        self._abort_wake.set()
