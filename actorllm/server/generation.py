"""Running engine requests for one HTTP request, and rendering them OpenAI's way.

:class:`GenerationResponse` is the ASGI response of both generation endpoints. It owns
its engine requests from submission to release, in one place, so that every way out
(the answer sent, an error, the client gone, the server shutting down) ends with the
same ``finally``: whatever has not finished is aborted through the Frontend.

Status codes are decided before the first byte goes out: a streaming response waits
for every engine request's first output, so a prompt that does not fit is a 400 and
not an error inside the stream. Errors after that are sent as an SSE ``error`` event,
followed by ``[DONE]``.

When ``--drain-timeout`` runs out (``ServerState.drain_expired``), a request still
running ends the same way: a stream with an ``error`` event (code ``shutting_down``)
and ``[DONE]``, a whole response with a 503. The cut only ever cancels a wait, never a send
half-way (that would corrupt the chunked body).

A response's life is two enums: :class:`Phase` (it only moves forward: NEW -> ADMITTED
-> SENT, the status line out) and :class:`Ending` (why it stops before its engine
requests finish; the first by precedence wins, and is the abort reason the engine gets).

Slow clients. A job's admission reservation is given back as soon as the engine is done
with it (``OutputCollector.engine_done``), not when its client has read everything: what
the client has not read counts against ``--max-pending-bytes`` instead. A client that
takes nothing for ``--stream-timeout`` s while a send waits is cut (``server/timeouts.py``
says so through a ``WriteWatch``; the engine requests are aborted with ``stream_timeout``);
one that reads, however slowly, is not, and its reads count for the Frontend's stall rule
too (``Job.client_took``). A gone client, however it surfaces, is one log line.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from actorllm.clock import now
from actorllm.server import sse, timeouts
from actorllm.server.errors import APIError, from_request_error, invalid
from actorllm.server.job import PRECEDENCE, ClientGone, Ending, Job, Phase, client_gone
from actorllm.server.outgoing import Outgoing
from actorllm.server.render import Renderer, usage
from actorllm.server.state import ServerState
from actorllm.wire.messages import InvalidRequest
from actorllm.wire.outputs import CompletionOutput, RequestError, RequestOutput

log = logging.getLogger(__name__)


def drain_cut_error() -> APIError:
    """What a request still running when --drain-timeout runs out is told."""
    return APIError(503, "the server shut down before this request finished "
                    "(--drain-timeout ran out)", code="shutting_down")


class GenerationResponse(Response):
    """Submit ``jobs`` to the engine, answer (whole or as SSE), and always clean up."""

    def __init__(self, state: ServerState, jobs: Sequence[Job], renderer: Renderer, *,
                 stream: bool, include_usage: bool, request_id: str,
                 param_names: dict[str, str] | None = None) -> None:
        super().__init__(status_code=200)
        # The engine names SamplingParams fields; the client should see its own names.
        self.param_names = param_names or {}
        self.state, self.jobs, self.renderer = state, list(jobs), renderer
        self.stream, self.include_usage = stream, include_usage
        self.out = Outgoing(state, [(b"x-request-id", request_id.encode())],
                            on_stalled=lambda: self._end(Ending.STREAM_TIMEOUT))
        self.phase = Phase.NEW
        self.ending: Ending | None = None
        self._error: RequestError | None = None  # with Ending.FAILED: the first failure
        self._held: list[Job] = []  # jobs whose admission reservation is still held
        self._nursery: trio.Nursery | None = None

    def _end(self, why: Ending) -> None:
        if self.ending is None or PRECEDENCE[why] < PRECEDENCE[self.ending]:
            self.ending = why

    def _fail(self, exc: RequestError) -> None:
        self._error = self._error or exc
        self._end(Ending.FAILED)

    @property
    def _cut(self) -> bool:
        return self.ending is Ending.DRAIN_CUT

    def _api_error(self, exc: RequestError) -> APIError:
        err = from_request_error(exc)
        if err.param is not None:
            err.param = self.param_names.get(err.param, err.param)
        return err

    def _ending_error(self) -> APIError:
        """What the client is told when the response ends early (drain cut or failure)."""
        if self._cut or self._error is None:
            return drain_cut_error()
        return self._api_error(self._error)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.out.send, self.out.scope = send, scope
        self.state.responding += 1
        try:
            with timeouts.watch_writes(scope.get("client"), self._client_took) as watch:
                self.out.watch = watch
                await self._run(receive)
        except* ClientGone:
            # Every way a gone client surfaces (a task group may hold several): one line.
            log.info("client gone (%s): %s", (self.ending or Ending.CLIENT_GONE).value,
                     [j.request.rid for j in self.jobs])
        finally:
            self.state.responding -= 1

    def _client_took(self) -> None:
        for job in self.jobs:
            job.client_took(now())

    async def _run(self, receive: Receive) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                # Leaving the connection cancels everything below, and the finally aborts.
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
                try:
                    await self._respond()
                except Exception as exc:  # a bug must not leak the request; finally aborts
                    if not client_gone(exc):
                        log.exception("generation request failed")
                        if self.phase is not Phase.SENT:
                            await self._send_error(APIError(500, "internal error",
                                                            code="internal_error"))
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._release()

    # --- plumbing ---------------------------------------------------------------------

    async def _watch_disconnect(self, receive: Receive, scope: trio.CancelScope) -> None:
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    log.debug("client disconnected: aborting %s",
                              [j.request.rid for j in self.jobs])
                    break
        except Exception:  # a broken receive means the client is gone too
            pass
        self._end(Ending.CLIENT_GONE)
        scope.cancel()

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.phase = Phase.SENT
        await self.out.start(status, headers)

    async def _send_error(self, err: APIError) -> None:
        self.phase = Phase.SENT
        await self.out.error(err)

    def _release_job(self, job: Job) -> None:
        if job in self._held:
            self._held.remove(job)
            self.state.release(job.cost)

    async def _release_when_done(self, job: Job) -> None:
        """Give the job's sequences back once the engine is done with it, read or not."""
        assert job.collector is not None
        await job.collector.engine_done.wait()
        self._release_job(job)

    async def _release(self) -> None:
        """Abort what has not finished and give back the overload reservation."""
        for job in list(self._held):
            self._release_job(job)
        reason = (self.ending or Ending.CLIENT_GONE).value
        for job in self.jobs:
            if job.collector is None:
                continue
            job.collector.discard()  # nobody will read the rest: it stops counting
            if not job.collector.finished:
                try:
                    await self.state.engine.abort(job.request.rid, reason)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    log.debug("engine stopped before %s could be aborted", job.request.rid)

    async def _submit(self) -> None:
        """Reserve the jobs' sequences (the one admission check) and submit them."""
        self.state.reserve(sum(j.cost for j in self.jobs))
        self._held = list(self.jobs)
        self.phase = Phase.ADMITTED
        for job in self.jobs:
            try:
                job.collector = await self.state.engine.submit(
                    job.request, reserved=True, final_only=not self.stream)
            except InvalidRequest as exc:  # a live duplicate request id
                raise invalid(exc) from None
            if self._nursery is not None:
                self._nursery.start_soon(self._release_when_done, job)

    def _usage(self) -> dict[str, Any]:
        prompt = sum(j.collector.num_prompt_tokens for j in self.jobs if j.collector)
        cached = [j.collector.num_cached_tokens for j in self.jobs if j.collector]
        return usage(prompt, self.renderer.completion_tokens(),
                     sum(c or 0 for c in cached) if any(c is not None for c in cached) else None)

    async def _each_job(self, work: Callable[[Job, trio.CancelScope], Awaitable[None]]) -> None:
        """Run ``work(job, cancel_all)`` for every job at once, until all return, one
        cancels them all, or the drain timeout cuts them (nothing here sends)."""

        async def cut_on_drain(scope: trio.CancelScope) -> None:
            await self.state.drain_expired.wait()
            self._end(Ending.DRAIN_CUT)
            scope.cancel()

        async with trio.open_nursery() as outer:
            outer.start_soon(cut_on_drain, outer.cancel_scope)
            async with trio.open_nursery() as nursery:
                for job in self.jobs:
                    nursery.start_soon(work, job, nursery.cancel_scope)
            outer.cancel_scope.cancel()  # done: stop watching for the cut

    # --- the two ways to answer ----------------------------------------------------------

    async def _respond(self) -> None:
        try:
            await self._submit()
        except APIError as err:
            await self._send_error(err)
            return
        if self.stream:
            await self._respond_stream()
        else:
            await self._respond_whole()

    async def _respond_whole(self) -> None:
        async def drain(job: Job, cancel: trio.CancelScope) -> None:
            while (item := await job.next()) is not None:
                if isinstance(item, RequestError):
                    self._fail(item)
                    cancel.cancel()
                    return
                for o in item.outputs:
                    self.renderer.add(job, o)

        await self._each_job(drain)
        if self.ending in (Ending.DRAIN_CUT, Ending.FAILED):
            await self._send_error(self._ending_error())
            return
        payload = json.dumps(self.renderer.final(self._usage()), ensure_ascii=False).encode()
        await self._start(200, [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())])
        await self.out.body(payload, more=False)

    async def _first_outputs(self) -> list[RequestOutput | None] | None:
        """Each job's first output; None if one failed or the drain cut them."""
        firsts: dict[Job, RequestOutput | None] = {}

        async def first(job: Job, cancel: trio.CancelScope) -> None:
            item = await job.next()
            if isinstance(item, RequestError):
                self._fail(item)
                cancel.cancel()
            else:
                firsts[job] = item

        await self._each_job(first)
        if self.ending in (Ending.DRAIN_CUT, Ending.FAILED):
            return None
        return [firsts.get(job) for job in self.jobs]

    async def _respond_stream(self) -> None:
        """SSE: the status line once every job has its first output, then the events."""
        firsts = await self._first_outputs()
        if firsts is None:
            await self._send_error(self._ending_error())
            return
        await self._start(200, list(sse.HEADERS))
        # One write per step: the prelude with every job's first output, then (in
        # _stream_rest) what each wake-up brought, then the end with [DONE].
        events = [sse.event(chunk) for chunk in self.renderer.prelude(firsts)]
        for job, out in zip(self.jobs, firsts, strict=True):
            if out is not None:
                events += self._render(job, out.outputs)
        if events:
            await self.out.body(b"".join(events))
        failed = await self._stream_rest()
        tail = []
        if self._cut and not failed:
            tail.append(sse.event(drain_cut_error().body()))
            failed = True
        if self.include_usage and not failed:
            tail.append(sse.events(self.renderer.usage_chunk(self._usage())))
        tail.append(sse.DONE)
        await self.out.body(b"".join(tail), more=False)

    async def _stream_rest(self) -> bool:
        """Send every job's outputs as they come, until all end, one fails (its error is
        sent as an event: True) or the drain cut comes (only ever during a wait)."""
        send_ch, recv_ch = trio.open_memory_channel[tuple[Job, Any]](0)

        async def pump(job: Job, ch: trio.MemorySendChannel[tuple[Job, Any]]) -> None:
            async with ch:
                while (item := await job.next()) is not None:
                    await ch.send((job, item))
                    if isinstance(item, RequestError):
                        return

        async def next_of_one(job: Job) -> tuple[Job, Any]:
            # One job (the common case: one prompt, n = 1) needs no pump task and no
            # channel hop between collector and socket: two task switches less a token.
            item = await job.next()
            if item is None:
                raise trio.EndOfChannel
            return job, item

        # One scope for the whole loop (a scope a token cost ~4 us of the loop), cancelled
        # only while the loop waits; a cancel that comes after the wait returned, before
        # the loop ran on, is seen before anything is sent.
        receiving = trio.CancelScope()
        waiting = False

        async def watch_cut() -> None:
            await self.state.drain_expired.wait()
            self._end(Ending.DRAIN_CUT)
            if waiting:  # else the loop is sending and sees the flag next
                receiving.cancel()

        single = self.jobs[0] if len(self.jobs) == 1 else None
        pacer = self.state.pacer
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_cut)
            async with send_ch:
                if single is None:
                    for job in self.jobs:
                        nursery.start_soon(pump, job, send_ch.clone())
            async with recv_ch:
                try:
                    with receiving:
                        while not self._cut:
                            # Only the wait is cancellable by the cut, never a send.
                            waiting = True
                            try:
                                # Writing waits for its share of the loop (pacing.py).
                                await pacer.turn()
                                got = await (next_of_one(single) if single is not None
                                             else recv_ch.receive())
                            except trio.EndOfChannel:
                                break
                            finally:
                                waiting = False
                            if self._cut or receiving.cancel_called:
                                break
                            t0 = trio.current_time()
                            # Whatever else the same step brought (other jobs' pumps are
                            # waiting to hand it over) goes in the same write.
                            items = [got]
                            while single is None:
                                try:
                                    items.append(recv_ch.receive_nowait())
                                except (trio.WouldBlock, trio.EndOfChannel):
                                    break
                            if await self._send_items(items):
                                return True
                            pacer.charge(trio.current_time() - t0)
                finally:
                    # Cancel the pumps while the channel is still open: one that sends
                    # into a closed channel would raise BrokenResourceError, not stop.
                    nursery.cancel_scope.cancel()
        return False

    async def _send_items(self, items: list[tuple[Job, Any]]) -> bool:
        """One write of what the jobs' collectors gave; True if one failed (its error is
        sent as an event: the headers are gone)."""
        events: list[bytes] = []
        for job, item in items:
            if isinstance(item, RequestError):
                events.append(sse.event(self._api_error(item).body()))
                await self.out.body(b"".join(events))
                return True
            events += self._render(job, item.outputs)
        if events:
            await self.out.body(b"".join(events))
        return False

    def _render(self, job: Job, outputs: Sequence[CompletionOutput]) -> list[bytes]:
        """The SSE events of ``outputs`` (one take of ``job``'s collector). Its time is the
        step's ``http_render`` phase."""
        t0 = time.perf_counter()
        add = self.renderer.add_event
        events = [e for o in outputs if (e := add(job, o)) is not None]
        self.state.engine.metrics.phase["http_render"].inc(time.perf_counter() - t0)
        return events
