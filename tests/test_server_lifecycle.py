"""``actorllm serve`` start-up and shutdown: one-line errors, overload, drain on a signal."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from test_server import CONTEXT, ServerProcess, http, wait_draining


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "actorllm", "serve", *args],
                          capture_output=True, text=True, timeout=300)


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("actorllm: error: "), stderr
    return lines[0]


def test_bad_model_directory(tmp_path: Path) -> None:
    done = _serve("--model", str(tmp_path / "missing"), "--port", "0")
    assert done.returncode != 0 and "serving" not in done.stdout
    assert "model directory not found" in _error_line(done.stderr)


def test_port_in_use(tiny_llama_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _serve("--model", str(tiny_llama_dir), "--port", str(port))
    assert done.returncode != 0 and "serving" not in done.stdout
    assert "in use" in _error_line(done.stderr)


def _long_stream(client: openai.OpenAI) -> openai.Stream:  # type: ignore[type-arg]
    return client.completions.create(model="m", prompt="Hello", max_tokens=CONTEXT - 8,
                                     temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})


# Every model step held 10 ms, so the streams of the drain tests (~250 steps) outlive
# the checks made while draining however fast the machine: without the hold they could
# end, and the server exit, first.
_HOLD_STEPS = """
import time
from actorllm.worker.runner import ModelRunner
execute = ModelRunner.execute
def held(self, plan):
    time.sleep(0.01)
    return execute(self, plan)
ModelRunner.execute = held
"""


def test_overload_env_key_and_graceful_drain(tiny_llama_dir: Path, tmp_path: Path) -> None:
    srv = ServerProcess(tiny_llama_dir, "--served-model-name", "m", "--drain-timeout", "60",
                        env={"ACTORLLM_API_KEY": "env-key"}, settings={"max_pending": 2},
                        prelude=_HOLD_STEPS, log_dir=tmp_path)
    try:
        base = srv.wait_ready()
        keyless = openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            keyless.models.list()
        client = openai.OpenAI(base_url=base + "/v1", api_key="env-key", max_retries=0,
                               timeout=120)
        streams = [_long_stream(client) for _ in range(2)]
        iters = [iter(s) for s in streams]
        texts = [next(it).choices[0].text for it in iters]
        # Two sequences are live and the cap is two: the next one is refused with 503.
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="m", prompt="Hi", max_tokens=2)
        assert info.value.status_code == 503 and info.value.code == "overloaded"

        srv.send_signal(signal.SIGTERM)
        wait_draining(base)
        # Still accepting, but refusing new work with a 503 that says why.
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="m", prompt="Hi", max_tokens=2)
        assert info.value.status_code == 503 and info.value.code == "shutting_down"
        status, _, body = http(base + "/health")
        assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
        # ... while the streams already running finish normally.
        for i, it in enumerate(iters):
            finish = None
            for chunk in it:
                texts[i] += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            assert finish == "length"
    finally:
        rc = srv.stop()
    assert rc == 0, srv.stderr()
    assert "draining" in srv.stderr()


def test_drain_timeout_aborts_the_rest(tiny_llama_dir: Path, tmp_path: Path) -> None:
    srv = ServerProcess(tiny_llama_dir, "--drain-timeout", "0", "--served-model-name", "m",
                        prelude=_HOLD_STEPS, log_dir=tmp_path)
    try:
        base = srv.wait_ready()
        assert http(base + "/health")[0] == 200
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        it = iter(_long_stream(client))
        next(it)
        srv.send_signal(signal.SIGINT)
        finish = None
        # Cut short with an error event (the client raises it), never a bare cut.
        with pytest.raises(openai.APIError) as info:
            for chunk in it:
                finish = chunk.choices[0].finish_reason or finish
        assert finish is None and "drain-timeout" in info.value.message
        rc = srv.proc.wait(120)
    finally:
        srv.stop()
    assert rc == 0, srv.stderr()
