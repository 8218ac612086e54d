"""``actorllm serve`` as a process: the drain deadline and engine death (issue 14, items 4-5).

Each test runs on the ``single`` and the ``engine`` topology. The requests in flight are
long (a tiny Llama with an 8k context, told to ignore EOS), so they are still running
when the drain timeout runs out or the engine dies, however fast the machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import build_tiny_model, sse_events
from test_server import ServerProcess, http, wait_draining

LONG_CONTEXT = 8192
KV_BLOCKS = LONG_CONTEXT // 16  # ServerProcess passes --num-kv-blocks 512: exactly one

# `actorllm serve` with a planted bug: the Scheduler raises on a request whose id starts
# with "boom" (a single-topology engine dies by an actor raising, not by a process exit).
_PLANTED = """
import sys
from actorllm import cli
from actorllm.scheduler.actor import Scheduler
handle = Scheduler.handle
def planted(self, msg):
    if getattr(msg, "rid", "").startswith("boom"):
        raise RuntimeError("planted scheduler bug")
    handle(self, msg)
Scheduler.handle = planted
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("long-llama"), "llama",
                            tokenizer_dir=tokenizer_dir,
                            max_position_embeddings=LONG_CONTEXT)


class Stream:
    """A raw streamed completion over its own socket, read by a thread."""

    def __init__(self, base: str, body: dict[str, Any], headers: str = "") -> None:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=120)
        payload = json.dumps(body).encode()
        self.sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{headers}"
                           "Content-Type: application/json\r\n"
                           f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload)
        self.raw = b""
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                self.raw += data
                if self.raw.endswith(b"0\r\n\r\n"):  # the last chunk of a chunked body
                    break
        except OSError:
            pass
        finally:
            self.closed.set()

    def wait_for(self, needle: bytes, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.raw:
            assert not self.closed.is_set() or needle in self.raw, self.raw[-500:]
            assert time.monotonic() < deadline, f"no {needle!r} in {self.raw[-500:]!r}"
            time.sleep(0.01)

    def finish(self, timeout: float = 60.0) -> tuple[int, bytes]:
        """The status and the de-chunked body, once the server has ended the response."""
        assert self.closed.wait(timeout), self.raw[-500:]
        self.sock.close()
        head, _, body = self.raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in head.lower():
            body = _dechunk(body)
        return status, body


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out, data = out + rest[:size], rest[size + 2:]
    raise AssertionError("the chunked body was cut short (no last chunk)")


def _long(stream: bool, **extra: Any) -> dict[str, Any]:
    return {"prompt": "Hello", "max_tokens": LONG_CONTEXT - 16, "ignore_eos": True,
            "stream": stream, **extra}


def _error_of(body: bytes) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error  # type: ignore[no-any-return]


@pytest.fixture(params=["single", "engine"])
def topology(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path


def _in_flight(base: str) -> tuple[Stream, Stream]:
    """A stream past its first chunk and a whole request whose sequence is running."""
    stream = Stream(base, _long(True))
    stream.wait_for(b"data: ")
    whole = Stream(base, _long(False))
    deadline = time.monotonic() + 60
    while True:  # both sequences run
        _, _, text = http(base + "/metrics")
        running = [ln for ln in text.decode().splitlines()
                   if ln.startswith("actorllm:num_requests_running")]
        if running and float(running[0].split()[-1]) >= 2:
            break
        assert time.monotonic() < deadline, text[-300:]
        time.sleep(0.02)
    return stream, whole


def test_drain_answers_503_then_cuts_with_an_error(long_llama_dir: Path, topology: str,
                                                  log_dir: Path) -> None:
    srv = ServerProcess(long_llama_dir, "--topology", topology, "--drain-timeout", "2",
                        log_dir=log_dir)
    try:
        base = srv.wait_ready()
        stream, whole = _in_flight(base)
        srv.send_signal(signal.SIGTERM)
        wait_draining(base)
        # Still accepting: a new connection is answered, and told the server is stopping.
        status, headers, body = http(base + "/v1/completions", "POST", {"prompt": "Hi"})
        assert status == 503 and _error_of(body)["code"] == "shutting_down"
        assert headers.get("connection") == "close"
        status, _, body = http(base + "/health")
        assert status == 503 and _error_of(body)["code"] == "shutting_down"
        # At the drain timeout the stream ends with an error event and [DONE] ...
        status, body = stream.finish()
        events = sse_events(body)
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        assert _error_of(events[-2].encode())["code"] == "shutting_down"
        # ... and the whole request with a 503 body.
        status, body = whole.finish()
        assert status == 503 and _error_of(body)["code"] == "shutting_down"
        rc = srv.proc.wait(60)
    finally:
        srv.stop()
    assert rc == 0, srv.stderr()


def _engine_child(pid: int) -> int:
    """The pid of the ``engine`` child process of ``pid``."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        if "engine" in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
            return int(child)
    raise AssertionError(f"no engine child among {children}")


def _kill_engine(srv: ServerProcess, base: str, topology: str) -> None:
    if topology == "engine":
        os.kill(_engine_child(srv.proc.pid), signal.SIGKILL)
    else:
        http(base + "/v1/completions", "POST", {"prompt": "Hi", "max_tokens": 2},
             headers={"X-Request-Id": "boom-1"})


def _planted_server(model_dir: Path, *args: str, log_dir: Path) -> ServerProcess:
    return ServerProcess(model_dir, *args, log_dir=log_dir, script=_PLANTED)


def test_engine_death_fails_in_flight_requests_then_exits(long_llama_dir: Path,
                                                         topology: str,
                                                         log_dir: Path) -> None:
    srv = _planted_server(long_llama_dir, "--topology", topology, log_dir=log_dir)
    try:
        base = srv.wait_ready()
        stream, whole = _in_flight(base)
        _kill_engine(srv, base, topology)
        status, body = stream.finish()
        events = sse_events(body)
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        assert _error_of(events[-2].encode())["code"] == "engine_dead"
        status, body = whole.finish()
        assert status == 503 and _error_of(body)["code"] == "engine_dead"
        rc = srv.proc.wait(60)  # no signal: it stops by itself
    finally:
        srv.stop()
    assert rc == 3, srv.stderr()
    assert "engine is dead" in srv.stderr()


def test_engine_death_with_stay_keeps_answering_503(long_llama_dir: Path, topology: str,
                                                   log_dir: Path) -> None:
    srv = _planted_server(long_llama_dir, "--topology", topology,
                          "--on-engine-death", "stay", log_dir=log_dir)
    try:
        base = srv.wait_ready()
        _kill_engine(srv, base, topology)
        deadline = time.monotonic() + 30
        while http(base + "/health")[0] == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)
        assert srv.proc.poll() is None  # still up
        status, _, body = http(base + "/health")
        assert status == 503 and _error_of(body)["code"] == "engine_dead"
        status, _, body = http(base + "/v1/completions", "POST", {"prompt": "Hi"})
        assert status == 503 and _error_of(body)["code"] == "engine_dead"
        assert "dead" in _error_of(body)["message"]
    finally:
        rc = srv.stop()
    assert rc == 3, srv.stderr()
