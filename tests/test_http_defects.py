"""The HTTP defects an attack on ``actorllm serve`` found (issue 33), each over raw
loopback sockets against a real server process: HTTP/2 (prior knowledge, ``Upgrade: h2c``,
rapid reset) is refused; the keep-alive timeout still applies after a generation
response, and an HTTP/1.0 stream ends with a close; a slow but steady reader is not cut;
a frozen engine shows in ``/health``; stalled readers do not hold a shutdown past
``--drain-timeout``.

Every assertion is on an event (the connection closed, ``[DONE]`` arrived, the status
changed, the process exited); the timeouts only guard against a hang.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import build_tiny_model, sse_events
from test_server import ServerProcess, http, metrics

from actorllm.topology.supervisor import LATE_AFTER, Supervisor

CONTEXT = 1024
GUARD = 60.0  # seconds: only ever a guard against a hang


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("defects-llama"), "llama",
                            tokenizer_dir=tokenizer_dir, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    srv = ServerProcess(model_dir, "--topology", "single", "--keep-alive-timeout", "1",
                        "--stream-timeout", "2", log_dir=tmp_path_factory.mktemp("defects"))
    yield from srv.serve_module()


def _addr(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _connect(base: str, **opts: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    for name, value in opts.items():
        level = socket.IPPROTO_TCP if name.startswith("TCP_") else socket.SOL_SOCKET
        sock.setsockopt(level, getattr(socket, name), value)
    sock.settimeout(GUARD)
    sock.connect(_addr(base))
    return sock


def _post(path: str, body: dict[str, Any], version: str = "1.1") -> bytes:
    payload = json.dumps(body).encode()
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


def _until_closed(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True), or until the guard (False)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return data, False
    except ConnectionResetError:
        pass
    return data, True


def _generated(base: str) -> float:
    m = metrics(base)
    return (m.get("actorllm:generation_tokens_total", 0.0)
            + m.get("actorllm:prompt_tokens_total", 0.0))


# --- 1. HTTP/2 is not served ----------------------------------------------------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# An empty SETTINGS frame: what a prior-knowledge client sends right after the preface.
SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def test_a_prior_knowledge_http2_preface_gets_an_http11_400_and_a_close(server: Any) -> None:
    before = _generated(server.url)
    with _connect(server.url) as sock:
        sock.sendall(PREFACE + SETTINGS)
        data, closed = _until_closed(sock)
    assert closed, data[:200]
    # An HTTP/2 server would answer with its own SETTINGS frame, not a status line.
    assert data.startswith(b"HTTP/1.1 400 "), data[:200]
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert "HTTP/2" in body["error"]["message"]
    assert _generated(server.url) == before


def test_an_h2c_upgrade_is_answered_in_http11(server: Any) -> None:
    with _connect(server.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                     b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]  # not 101 Switching Protocols


def test_rapid_reset_generates_nothing(server: Any) -> None:
    h2 = pytest.importorskip("h2.connection")
    conn = h2.H2Connection()
    conn.initiate_connection()
    body = json.dumps({"prompt": "reset", "max_tokens": 64, "stream": True}).encode()
    for _ in range(1000):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/completions"),
                                (":scheme", "http"), (":authority", "x"),
                                ("content-type", "application/json")])
        conn.send_data(sid, body, end_stream=True)
        conn.reset_stream(sid)
    frames = conn.data_to_send()
    before = _generated(server.url)
    with _connect(server.url) as sock:
        try:
            sock.sendall(frames)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it was all sent
        data, closed = _until_closed(sock)
    assert closed
    assert data.startswith(b"HTTP/1.1 400 "), data[:200]
    after = metrics(server.url)
    assert _generated(server.url) == before
    assert after["actorllm:num_requests_running"] == 0


# --- 2. keep-alive after a generation response, HTTP/1.0 ------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_the_keep_alive_timeout_closes_a_connection_after_a_generation(server: Any,
                                                                       stream: bool) -> None:
    with _connect(server.url) as sock:
        sock.sendall(_post("/v1/completions", {"prompt": "x", "max_tokens": 2,
                                               "stream": stream}))
        # The response arrives, then the client says nothing: --keep-alive-timeout (1 s)
        # must close the connection.
        data, closed = _until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200 "), data[:300]
    assert closed, "the idle connection was still open after the guard"


def test_an_http10_stream_ends_with_a_close(server: Any) -> None:
    with _connect(server.url) as sock:
        sock.sendall(_post("/v1/completions", {"prompt": "x", "max_tokens": 4, "stream": True},
                           version="1.0"))
        data, closed = _until_closed(sock)
    assert b"data: [DONE]" in data, data[-300:]
    assert closed, "an HTTP/1.0 body is delimited by the close, which never came"


# --- 3. a slow but steady reader --------------------------------------------------------


def test_a_slow_but_steady_reader_is_not_cut(server: Any) -> None:
    # A small MSS and receive buffer keep the server's kernel send buffer small (as on a
    # real network), so its writes wait on this reader: at a few KB/s, a write waits
    # longer than --stream-timeout (2 s) for room, though the reader never stops. (The
    # server sees reads as the acknowledgements they release, a window at a time: the
    # pace must open a window well within the timeout.)
    with _connect(server.url, SO_RCVBUF=2048, TCP_MAXSEG=536) as sock:
        sock.sendall(_post("/v1/completions", {
            "prompt": "steady", "max_tokens": 256, "n": 4, "logprobs": 5,
            "ignore_eos": True, "stream": True}))
        data = b""
        steady_until = time.monotonic() + 10.0  # five stream timeouts
        while time.monotonic() < steady_until:
            chunk = sock.recv(512)
            assert chunk, f"cut after {len(data)} bytes: {data[-300:]!r}"
            data += chunk
            time.sleep(0.1)
        rest, _ = _until_closed_or_done(sock)
        data += rest
    events = sse_events(_dechunk(data.split(b"\r\n\r\n", 1)[1]))
    assert events[-1] == "[DONE]", data[-300:]
    assert not any('"error"' in e for e in events), [e for e in events if "error" in e]


def test_a_stalled_reader_cut_in_engine_logs_one_line_not_an_error(
        model_dir: Path, tmp_path: Path) -> None:
    """A cut used to surface as a group of ClientGone that reached the app's catch-all:
    ~100 lines of ``ERROR ... unhandled error in a request handler`` per cut, so slow
    clients could flood the log. Now each cut is at most one INFO line."""
    cuts = 3
    srv = ServerProcess(model_dir, "--topology", "engine", "--stream-timeout", "2",
                        "--log-level", "info", log_dir=tmp_path)
    socks: list[socket.socket] = []
    try:
        base = srv.wait_ready()
        before = len(srv.stderr().splitlines())
        for i in range(cuts):  # readers that never read: cut after --stream-timeout
            sock = _connect(base, SO_RCVBUF=2048, TCP_MAXSEG=536)
            sock.sendall(_post("/v1/completions", {
                "prompt": f"stalled {i}", "max_tokens": CONTEXT - 64, "n": 2, "logprobs": 5,
                "ignore_eos": True, "stream": True}))
            socks.append(sock)
        # Wait for the cuts themselves (the engine may have finished generating by
        # then: what is cut is the response, whose output waits for the reader).
        deadline = time.monotonic() + GUARD
        while sum("(--stream-timeout): closing" in line
                  for line in srv.stderr().splitlines()[before:]) < cuts:
            assert time.monotonic() < deadline, srv.stderr()[-3000:]
            time.sleep(0.1)
        for sock in socks:
            assert _until_closed(sock)[1]  # the cut closed the connection
        assert http(base + "/health")[0] == 200
    finally:
        for sock in socks:
            sock.close()
        rc = srv.stop()
    assert rc == 0, srv.stderr()[-2000:]
    during = srv.stderr().splitlines()[before:]
    bad = [line for line in during if "ERROR" in line or "Traceback" in line]
    assert not bad, "\n".join(during[:60])
    gone = [line for line in during if "client gone" in line]
    assert len(gone) <= cuts, "\n".join(gone)


# The race a cut can meet: the disconnect watcher cancels the response's scope while a
# pump's send raises ClientGone. The group that leaves the pumps' nursery then holds
# trio's Cancelled too, so ``except Exception`` around ``_respond`` does not see it; the
# scope strips the Cancelled and a group of ClientGone alone leaves ``_run``.
_CUT_RACE = """
import trio
from actorllm.server import generation
from actorllm.server.job import ClientGone

async def _respond(self):
    async with trio.open_nursery() as pumps:
        pumps.start_soon(trio.sleep_forever)
        await trio.sleep(0)
        self._nursery.cancel_scope.cancel()
        raise ClientGone()

generation.GenerationResponse._respond = _respond
"""


def test_a_cut_that_races_the_disconnect_watcher_is_one_line(model_dir: Path,
                                                            tmp_path: Path) -> None:
    """Before the fix the group reached the app's catch-all: ``ERROR ... unhandled error
    in a request handler`` and a traceback of nested groups for every cut."""
    cuts = 3
    srv = ServerProcess(model_dir, "--topology", "engine", "--log-level", "info",
                        prelude=_CUT_RACE, log_dir=tmp_path)
    try:
        base = srv.wait_ready()
        before = len(srv.stderr().splitlines())
        for i in range(cuts):
            with _connect(base) as sock:
                sock.sendall(_post("/v1/completions", {"prompt": f"raced {i}",
                                                       "max_tokens": 4, "stream": True}))
                _until_closed_or_done(sock)
        assert http(base + "/health")[0] == 200
    finally:
        rc = srv.stop()
    assert rc == 0, srv.stderr()[-2000:]
    during = srv.stderr().splitlines()[before:]
    bad = [line for line in during if "ERROR" in line or "Traceback" in line]
    assert not bad, "\n".join(during[:60])
    assert sum("client gone" in line for line in during) == cuts, "\n".join(during)


def _until_closed_or_done(sock: socket.socket) -> tuple[bytes, bool]:
    data = b""
    while b"data: [DONE]" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data, True
        data += chunk
    return data, False


def _dechunk(raw: bytes) -> bytes:
    """The payload of a chunked HTTP/1.1 body."""
    out = b""
    while raw:
        size, _, raw = raw.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, raw = out + raw[:n], raw[n + 2:]
    return out


# --- 4. a frozen engine shows in /health ------------------------------------------------


def _engine_child(pid: int) -> int:
    """The pid of the ``engine`` child process of ``pid``."""
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        if "engine" in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
            return int(child)
    raise AssertionError(f"no engine child of {pid}")


def _health_until(base: str, want: int) -> tuple[int, bytes]:
    deadline = time.monotonic() + GUARD
    while True:
        try:
            status, _, body = http(base + "/health")
        except OSError as exc:  # the server exited (its engine was killed)
            return 0, str(exc).encode()
        if status == want or time.monotonic() > deadline:
            return status, body
        time.sleep(0.1)


def test_a_stopped_engine_process_shows_in_health_and_recovers(
        model_dir: Path, tmp_path: Path) -> None:
    srv = ServerProcess(model_dir, "--topology", "engine", log_dir=tmp_path)
    try:
        base = srv.wait_ready()
        assert http(base + "/health")[0] == 200
        child = _engine_child(srv.proc.pid)
        os.kill(child, signal.SIGSTOP)
        try:
            status, body = _health_until(base, 503)
        finally:
            os.kill(child, signal.SIGCONT)
        # Late heartbeats, not the supervisor's kill: the engine is not dead.
        assert status == 503, body
        assert json.loads(body)["error"]["code"] == "engine_unresponsive", body
        # Its heartbeats resume: healthy again, and it still generates.
        status, body = _health_until(base, 200)
        assert status == 200, body
        status, _, body = http(base + "/v1/completions", "POST",
                               {"prompt": "after", "max_tokens": 2})
        assert status == 200, body
    finally:
        rc = srv.stop()
    assert rc == 0, srv.stderr()


# --- 5. stalled readers do not hold a shutdown past --drain-timeout -----------------------


def test_stalled_readers_do_not_hold_the_shutdown_past_the_drain_timeout(
        model_dir: Path, tmp_path: Path) -> None:
    stream_timeout = 120.0
    srv = ServerProcess(model_dir, "--topology", "engine", "--drain-timeout", "2",
                        "--stream-timeout", str(stream_timeout), log_dir=tmp_path)
    socks: list[socket.socket] = []
    try:
        base = srv.wait_ready()
        for i in range(5):  # clients that never read
            sock = _connect(base, SO_RCVBUF=4096, TCP_MAXSEG=536)
            sock.sendall(_post("/v1/completions", {
                "prompt": f"stalled {i}", "max_tokens": CONTEXT - 64, "logprobs": 20,
                "ignore_eos": True, "stream": True}))
            socks.append(sock)
        # Their output backs up behind full sockets (the writes wait) ...
        deadline = time.monotonic() + GUARD
        while metrics(base).get("actorllm:pending_output_bytes", 0) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        srv.send_signal(signal.SIGTERM)
        # ... and the process still exits with the drain, not at the writes' timeout.
        try:
            rc = srv.proc.wait(stream_timeout / 2)
        except subprocess.TimeoutExpired:
            rc = None
    finally:
        for sock in socks:
            sock.close()
        srv.stop()
    assert rc == 0, srv.stderr()[-2000:]
    log = srv.stderr()
    # A cut client is one line at most, never a traceback per cut.
    assert "unhandled error" not in log and "Traceback" not in log, log[-3000:]


class _Child:
    def __init__(self, role: str, last_heard: float) -> None:
        self.role, self.last_heard, self.proc, self.ready = role, last_heard, object(), True
        self.exited = trio.Event()


def _supervisor(children: list[_Child]) -> Supervisor:
    """A Supervisor with these children (as late() sees them), started by nobody."""
    sup = Supervisor.__new__(Supervisor)
    sup.children = {c.role: c for c in children}  # type: ignore[misc]
    sup.stopping, sup.ticked = False, trio.current_time()
    return sup


async def test_late_heartbeats_are_judged_on_trios_clock(mock_clock: trio.testing.MockClock,
                                                         ) -> None:
    engine_child = _Child("engine", trio.current_time())
    sup = _supervisor([engine_child, _Child("detokenizer", trio.current_time())])
    mock_clock.jump(LATE_AFTER * 0.9)
    sup.ticked = trio.current_time()
    assert sup.late() is None  # a beat or so late: not yet
    mock_clock.jump(LATE_AFTER * 0.2)
    sup.ticked = trio.current_time()
    sup.children["detokenizer"].last_heard = trio.current_time()
    late = sup.late()
    assert late is not None and "engine process" in late  # names the silent one
    # This loop itself stalled (its own tick is old): the beats may wait unread.
    mock_clock.jump(LATE_AFTER * 2)
    assert sup.late() is None
    sup.ticked = trio.current_time()
    assert sup.late() is not None
    # It beats again: healthy.
    engine_child.last_heard = sup.children["detokenizer"].last_heard = trio.current_time()
    assert sup.late() is None
    # A child that exited is the supervisor's death path, not lateness.
    mock_clock.jump(LATE_AFTER * 2)
    sup.ticked = trio.current_time()
    for child in sup.children.values():
        child.exited.set()
    assert sup.late() is None
