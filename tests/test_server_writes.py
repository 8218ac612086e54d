"""hypercorn's writes as ``server/timeouts.py`` replaces them: a chunk the socket takes
at once goes out without a trip through trio's scheduler, and nothing ever reorders or
loses bytes (a partial write, a write while another holds the connection's lock)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import trio
from hypercorn.config import Config
from hypercorn.events import RawData
from hypercorn.trio.tcp_server import TCPServer

from actorllm.server import timeouts


def _server(sock: trio.socket.SocketType, timeout: float | None) -> Any:
    """A hypercorn TCPServer over ``sock`` with only what ``protocol_send`` uses."""
    assert timeouts.install()
    srv = TCPServer.__new__(TCPServer)
    srv.config = Config()
    timeouts.set_write_timeout(srv.config, timeout)
    srv.send_lock = trio.Lock()
    srv.stream = trio.SocketStream(sock)
    return srv


async def _read_all(sock: trio.socket.SocketType, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        data = await sock.recv(1 << 16)
        assert data, "the writer closed early"
        got += data
    return bytes(got)


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_a_chunk_the_socket_takes_is_written_without_yielding(timeout: float | None):
    async def main() -> None:
        a, b = trio.socket.socketpair()
        srv = _server(a, timeout)
        ran = False

        async def other() -> None:
            nonlocal ran
            ran = True

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await srv.protocol_send(RawData(data=b"data: {}\n\n"))
            assert not ran  # no checkpoint on the way: the other task never got a turn
        assert await _read_all(b, 10) == b"data: {}\n\n"
        a.close()
        b.close()

    trio.run(main)


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_a_write_bigger_than_the_socket_buffer_arrives_whole_and_in_order(
        timeout: float | None):
    async def main() -> None:
        a, b = trio.socket.socketpair()
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        srv = _server(a, timeout)
        big = bytes(range(256)) * 4096  # 1 MiB: most of it after a partial write
        got: list[bytes] = []
        async with trio.open_nursery() as nursery:
            async def reader() -> None:
                got.append(await _read_all(b, len(big) + 5))
            nursery.start_soon(reader)
            await srv.protocol_send(RawData(data=big))
            await srv.protocol_send(RawData(data=b"after"))
        assert got[0] == big + b"after"
        a.close()
        b.close()

    trio.run(main)


def test_a_chunk_waits_while_another_write_holds_the_connection():
    """The fast path must not jump ahead of a write that is still going out."""
    async def main() -> None:
        a, b = trio.socket.socketpair()
        srv = _server(a, 5.0)
        order: list[str] = []
        async with trio.open_nursery() as nursery:
            await srv.send_lock.acquire()  # an awaited write in progress

            async def second() -> None:
                await srv.protocol_send(RawData(data=b"second"))
                order.append("second")

            nursery.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            assert order == []  # it waits for the lock rather than writing now
            await srv.stream.send_all(b"first-")
            srv.send_lock.release()
        assert order == ["second"]
        assert await _read_all(b, 12) == b"first-second"
        a.close()
        b.close()

    trio.run(main)
