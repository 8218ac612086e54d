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

Slow clients. A job's admission reservation is given back as soon as the engine is done
with it (``OutputCollector.engine_done``), not when its client has read everything: what
the client has not read counts against ``--max-pending-bytes`` instead. A send that the
client does not take for ``--stream-timeout`` seconds closes the connection (hypercorn's
write is made to time out by ``server/timeouts.py``); the engine requests are then
aborted with reason ``stream_timeout``. The time each send waits is counted in
``actorllm:socket_blocked_seconds``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from actorllm.engine.admission import Refused
from actorllm.frontend.collector import OutputCollector
from actorllm.server import sse
from actorllm.server.errors import APIError, from_request_error, invalid
from actorllm.server.render import Renderer, usage
from actorllm.wire.messages import GenerateRequest, InvalidRequest
from actorllm.wire.outputs import CompletionOutput, EndOfOutput, RequestError

if TYPE_CHECKING:
    from actorllm.server.app import ServerState

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class Job:
    """One engine request of an HTTP request: its choices are ``index_base + i``."""

    request: GenerateRequest
    index_base: int = 0
    echo: str = ""  # completions with echo: text put before each choice's output
    collector: OutputCollector | None = None
    # The echo is a text prompt as given (its special tokens, like <|bos|>, not shown),
    # or the decoding of token ids with them: text_offset must know which.
    echo_skips_special: bool = True
    released: bool = False  # its admission reservation was given back

    @property
    def cost(self) -> int:
        """Engine sequences it occupies (what the overload cap counts)."""
        return self.request.params.n


class _ClientGone(Exception):
    """The client disconnected; stop quietly."""


def drain_cut_error() -> APIError:
    """What a request still running when --drain-timeout runs out is told."""
    return APIError(503, "the server shut down before this request finished "
                    "(--drain-timeout ran out)", code="shutting_down")


def _client_gone(exc: BaseException) -> bool:
    """``exc`` is _ClientGone, or a group made only of them (trio groups task errors)."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(_ClientGone)[1] is None
    return isinstance(exc, _ClientGone)


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
        self.extra_headers = [(b"x-request-id", request_id.encode())]
        self._send: Send | None = None
        self._started = False
        self._reserved = 0
        self._error: RequestError | None = None
        self._cut = False  # the drain timeout ran out before this request finished
        self._abort_reason: str | None = None  # why unfinished engine requests are aborted
        self._nursery: trio.Nursery | None = None

    def _api_error(self, exc: RequestError) -> APIError:
        err = from_request_error(exc)
        if err.param is not None:
            err.param = self.param_names.get(err.param, err.param)
        return err

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send = send
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                # Leaving the connection cancels everything below, and the finally aborts.
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
                try:
                    await self._respond()
                except Exception as exc:  # a bug must not leak the request; finally aborts
                    if not _client_gone(exc):
                        log.exception("generation request failed")
                        if not self._started:
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
                    self._abort_reason = self._abort_reason or "client_disconnect"
                    scope.cancel()
                    return
        except Exception:  # a broken receive means the client is gone too
            self._abort_reason = self._abort_reason or "client_disconnect"
            scope.cancel()

    async def _raw_send(self, message: dict[str, Any]) -> None:
        assert self._send is not None
        start = time.monotonic()
        try:
            await self._send(message)
        except OSError as exc:
            raise _ClientGone() from exc
        finally:
            waited = time.monotonic() - start
            self.state.engine.metrics.socket_blocked_seconds.inc(waited)
        timeout = self.state.engine.config.stream_timeout
        if timeout is not None and waited >= timeout:
            # hypercorn gave up on this write (server/timeouts.py) and closed the connection
            self._abort_reason = "stream_timeout"
            raise _ClientGone()

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._started = True
        await self._raw_send({"type": "http.response.start", "status": status,
                              "headers": headers + self.extra_headers})

    async def _body(self, data: bytes, more: bool = True) -> None:
        await self._raw_send({"type": "http.response.body", "body": data, "more_body": more})

    async def _send_error(self, err: APIError) -> None:
        self._started = True
        assert self._send is not None
        await err.send(self._send, self.extra_headers)

    def _release_job(self, job: Job) -> None:
        if not job.released:
            job.released = True
            self.state.admission.release(job.cost)
            self._reserved -= job.cost

    async def _release_when_done(self, job: Job) -> None:
        """Give the job's sequences back once the engine is done with it, read or not."""
        assert job.collector is not None
        await job.collector.engine_done.wait()
        self._release_job(job)

    async def _release(self) -> None:
        """Abort what has not finished and give back the overload reservation."""
        if self._reserved:  # the reservation was made: give back what is still held
            for job in self.jobs:
                self._release_job(job)
        if self._cut:
            reason = "drain_timeout"
        elif self._error is not None:
            reason = "sibling_failed"
        else:
            reason = self._abort_reason or "client_disconnect"
        for job in self.jobs:
            if job.collector is None:
                continue
            job.collector.discard()  # nobody will read the rest: it stops counting
            if not job.collector.finished:
                try:
                    await self.state.engine.abort(job.request.rid, reason)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    log.debug("engine stopped before %s could be aborted", job.request.rid)

    async def _cut_on_drain(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` (which must not hold a send) once the drain timeout runs out."""
        await self.state.drain_expired.wait()
        self._cut = True
        scope.cancel()

    async def _submit(self) -> None:
        state = self.state
        refusal = state.refusal()
        if refusal is not None:
            raise refusal
        cost = sum(j.cost for j in self.jobs)
        try:
            state.admission.reserve(cost)
        except Refused as refused:
            if refused.code == "too_large":  # could never run: retrying would not help
                raise APIError(400, str(refused), param="n", code="invalid_request") from None
            if refused.code == "overloaded":
                raise APIError(503, str(refused), code="overloaded") from None
            raise state.refusal() or APIError(503, str(refused), code=refused.code) from None
        self._reserved = cost
        for job in self.jobs:
            try:
                job.collector = await state.engine.submit(job.request, reserved=True,
                                                          final_only=not self.stream)
            except InvalidRequest as exc:  # a live duplicate request id
                raise invalid(exc) from None
            if self._nursery is not None:
                self._nursery.start_soon(self._release_when_done, job)

    def _usage(self) -> dict[str, Any]:
        prompt = sum(j.collector.num_prompt_tokens for j in self.jobs if j.collector)
        cached = [j.collector.num_cached_tokens for j in self.jobs if j.collector]
        return usage(prompt, self.renderer.completion_tokens(),
                     sum(c or 0 for c in cached) if any(c is not None for c in cached) else None)

    async def _first_outputs(self) -> list[Any] | None:
        """Each job's first output (an error cancels the rest and is kept in _error)."""
        firsts: list[Any] = [None] * len(self.jobs)

        async def first(i: int, col: OutputCollector, cancel: trio.CancelScope) -> None:
            try:
                firsts[i] = await col.get()
            except RequestError as exc:
                self._error = self._error or exc
                cancel.cancel()
            except EndOfOutput:
                pass

        async with trio.open_nursery() as outer:
            outer.start_soon(self._cut_on_drain, outer.cancel_scope)
            async with trio.open_nursery() as nursery:
                for i, job in enumerate(self.jobs):
                    assert job.collector is not None
                    nursery.start_soon(first, i, job.collector, nursery.cancel_scope)
            outer.cancel_scope.cancel()  # done: stop watching for the cut
        return None if self._error is not None or self._cut else firsts

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
            assert job.collector is not None
            while True:
                try:
                    out = await job.collector.get()
                except EndOfOutput:
                    return
                except RequestError as exc:
                    self._error = self._error or exc
                    cancel.cancel()
                    return
                for o in out.outputs:
                    self.renderer.add(job, o)

        async with trio.open_nursery() as outer:
            outer.start_soon(self._cut_on_drain, outer.cancel_scope)
            async with trio.open_nursery() as nursery:
                for job in self.jobs:
                    nursery.start_soon(drain, job, nursery.cancel_scope)
            outer.cancel_scope.cancel()  # done: stop watching for the cut
        if self._cut:
            await self._send_error(drain_cut_error())
            return
        if self._error is not None:
            await self._send_error(self._api_error(self._error))
            return
        payload = json.dumps(self.renderer.final(self._usage()), ensure_ascii=False).encode()
        await self._start(200, [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())])
        await self._body(payload, more=False)

    async def _respond_stream(self) -> None:
        firsts = await self._first_outputs()
        if firsts is None:
            err = drain_cut_error() if self._cut else None
            if err is None:
                assert self._error is not None
                err = self._api_error(self._error)
            await self._send_error(err)
            return
        await self._start(200, list(sse.HEADERS))
        for chunk in self.renderer.prelude():
            await self._body(sse.event(chunk))
        for job, out in zip(self.jobs, firsts, strict=True):
            if out is not None:
                await self._emit(job, out.outputs)

        send_ch, recv_ch = trio.open_memory_channel[tuple[Job, Any]](0)

        async def pump(job: Job, ch: trio.MemorySendChannel[tuple[Job, Any]]) -> None:
            assert job.collector is not None
            async with ch:
                while True:
                    try:
                        out = await job.collector.get()
                    except EndOfOutput:
                        return
                    except RequestError as exc:
                        await ch.send((job, exc))
                        return
                    await ch.send((job, out))

        receiving: trio.CancelScope | None = None

        async def watch_cut() -> None:
            await self.state.drain_expired.wait()
            self._cut = True
            if receiving is not None:  # else the loop is sending and sees the flag next
                receiving.cancel()

        async def next_of_one(job: Job) -> tuple[Job, Any]:
            # One job (the common case: one prompt, n = 1) needs no pump task and no
            # channel hop between collector and socket: two task switches less a token.
            assert job.collector is not None
            try:
                return job, await job.collector.get()
            except EndOfOutput:
                raise trio.EndOfChannel from None
            except RequestError as exc:
                return job, exc

        failed = False
        single = self.jobs[0] if len(self.jobs) == 1 else None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_cut)
            async with send_ch:
                if single is None:
                    for job in self.jobs:
                        nursery.start_soon(pump, job, send_ch.clone())
            async with recv_ch:
                while not self._cut:
                    # Only the wait is cancellable by the cut, never a send.
                    with trio.CancelScope() as receiving:
                        try:
                            job, item = await (next_of_one(single) if single is not None
                                               else recv_ch.receive())
                        except trio.EndOfChannel:
                            break
                    receiving = None
                    if self._cut:
                        break
                    if isinstance(item, RequestError):
                        # Headers are gone: the error travels as an event, then [DONE].
                        await self._body(sse.event(self._api_error(item).body()))
                        failed = True
                        break
                    await self._emit(job, item.outputs)
                # Cancel the pumps while the channel is still open: one that sends into
                # a closed channel would raise BrokenResourceError instead of stopping.
                nursery.cancel_scope.cancel()
        if self._cut and not failed:
            await self._body(sse.event(drain_cut_error().body()))
            failed = True
        if self.include_usage and not failed:
            await self._body(sse.event(self.renderer.usage_chunk(self._usage())))
        await self._body(sse.DONE)
        await self._body(b"", more=False)

    async def _emit(self, job: Job, outputs: Sequence[CompletionOutput]) -> None:
        for o in outputs:
            chunk = self.renderer.add(job, o)
            if chunk is not None:
                await self._body(sse.event(chunk))
