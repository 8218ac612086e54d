"""Streamed chunks written past the ASGI layers (``server/chunk_writer.py``), under the
real hypercorn: the stream must take that path with the hypercorn installed here (this
fails if an upgrade moves what it relies on), and what reaches the client must be the
HTTP/1.1 chunked body h11 would have framed, ending so that the connection serves the
next request. An HTTP/1.0 stream (not chunked) must go the ASGI way. The openai SDK
reads the same streams from ``actorllm serve`` in tests/test_server.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import h11
import pytest
import trio
from helpers import app_for, sse_events
from hypercorn.config import Config
from hypercorn.trio import serve

from actorllm.engine.async_engine import AsyncEngine
from actorllm.server import chunk_writer, timeouts


async def _exchange(stream: trio.SocketStream, conn: h11.Connection, body: dict[str, Any],
                    ) -> tuple[h11.Response, bytes]:
    """One POST /v1/completions on a kept-alive connection, read by h11 as a client."""
    data = json.dumps(body).encode()
    await stream.send_all(conn.send(h11.Request(
        method="POST", target="/v1/completions",
        headers=[("host", "t"), ("content-type", "application/json"),
                 ("content-length", str(len(data)))])) + conn.send(h11.Data(data=data))
        + conn.send(h11.EndOfMessage()))
    response: h11.Response | None = None
    got = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(1 << 16))
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            got += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert response is not None
            conn.start_next_cycle()
            return response, bytes(got)


@asynccontextmanager
async def _served(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch,
                  ) -> AsyncIterator[tuple[trio.SocketStream, list[bool]]]:
    """The app under hypercorn, as ``actorllm serve`` runs it, and a connection to it;
    the list says, for each response that sent its headers, whether it got a writer."""
    timeouts.install()  # as the server runs: the direct writes go through its protocol_send
    found: list[bool] = []
    real = chunk_writer.direct_writer

    def spy(scope: Any) -> Any:
        writer = real(scope)
        found.append(writer is not None)
        return writer

    monkeypatch.setattr(chunk_writer, "direct_writer", spy)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, chunk_writer.KeepServerSend(app_for(engine)),
                                            config, shutdown_trigger=stop.wait))
        host, port = binds[0].removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        try:
            yield stream, found
        finally:
            await stream.aclose()
            stop.set()


ASK = {"model": "m", "prompt": "Hello there", "max_tokens": 12, "temperature": 0,
       "ignore_eos": True}


def _text(body: bytes) -> str:
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


async def test_a_stream_under_hypercorn_is_written_directly_and_parses(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    async with _served(engine, monkeypatch) as (stream, found):
        conn = h11.Connection(h11.CLIENT)
        head, body = await _exchange(stream, conn, {**ASK, "stream": True})
        assert head.status_code == 200
        assert (b"transfer-encoding", b"chunked") in head.headers
        text = _text(body)
        # The same connection serves the next request: the stream ended as h11 expects.
        head, whole = await _exchange(stream, conn, ASK)
        assert head.status_code == 200
        assert json.loads(whole)["choices"][0]["text"] == text
    # The stream found the direct path; the whole answer (Content-Length) did not.
    assert found == [True, False]


async def test_an_http_1_0_stream_is_not_chunked_and_goes_the_asgi_way(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    async with _served(engine, monkeypatch) as (stream, found):
        # An HTTP/1.0 request: the body comes delimited by the connection's close.
        data = json.dumps({**ASK, "stream": True}).encode()
        request = (b"POST /v1/completions HTTP/1.0\r\nhost: t\r\n"
                   b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                   % (len(data), data))
        await stream.send_all(request)
        got = bytearray()
        while chunk := await stream.receive_some(1 << 16):
            got += chunk
        head, _, body = bytes(got).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
        assert _text(body)
    assert found == [False]


def test_no_writer_without_hypercorns_stream_below() -> None:
    assert chunk_writer.direct_writer({}) is None

    async def send(message: Any) -> None:
        pass

    assert chunk_writer.direct_writer({chunk_writer.SCOPE_KEY: send}) is None
