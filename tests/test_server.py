"""The OpenAI-compatible server, end to end, driven by the official ``openai`` client.

One real server (``python -m actorllm serve`` in a subprocess, on 127.0.0.1 and a free
port, with the tiny Llama) is shared by the module. A subprocess keeps disconnect tests
honest: the server sees a real socket close, exactly as in production.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny"
CONTEXT = 256  # the tiny models' max_position_embeddings
MAX_REQUEST_BYTES = 64 * 1024

# `serve_main` with settings the command line does not (yet) expose, e.g. max_pending.
_SERVE_SCRIPT = """
import logging, sys
from actorllm.cli import build_parser, engine_config
from actorllm.server import serve_main
extra = dict(a.split("=", 1) for a in sys.argv[1].split(",") if a)
args = build_parser().parse_args(sys.argv[2:])
for k, v in extra.items():
    setattr(args, k, int(v))
logging.basicConfig(level=args.log_level.upper())
sys.exit(serve_main(engine_config(args), args))
"""


class ServerProcess:
    """``actorllm serve`` in a subprocess; ``url`` once its start-up line is printed."""

    def __init__(self, model_dir: Path, *args: str, env: dict[str, str] | None = None,
                 settings: dict[str, int] | None = None, log_dir: Path | None = None,
                 script: str | None = None, prelude: str = "") -> None:
        flags = ["serve", "--model", str(model_dir), "--num-kv-blocks", "512", *args]
        if "--port" not in args:
            flags += ["--port", "0"]
        if script is not None:  # a `python -c` stand-in for `python -m actorllm`
            cmd = [sys.executable, "-c", script, *flags]
        elif settings or prelude:  # `prelude`: code run in the server before it starts
            extra = ",".join(f"{k}={v}" for k, v in (settings or {}).items())
            cmd = [sys.executable, "-c", prelude + _SERVE_SCRIPT, extra, *flags]
        else:
            cmd = [sys.executable, "-m", "actorllm", *flags]
        self.stderr_path = (log_dir or Path("/tmp")) / f"server-{os.getpid()}-{id(self)}.log"
        self._stderr = open(self.stderr_path, "w")  # closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, env={**os.environ, **(env or {})})
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = ""
        self.signaled = False

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_ready(self, timeout: float = 240.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"server exited ({self.proc.wait()}): {self.stderr()}")
            if line.startswith("actorllm: serving "):
                self.url = line.rsplit(" at ", 1)[1].strip()
                return self.url
        raise RuntimeError(f"server not ready after {timeout} s: {self.stderr()}")

    def send_signal(self, signum: int = signal.SIGTERM) -> None:
        self.signaled = True
        self.proc.send_signal(signum)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 90.0) -> int:
        """Signal (unless the test did), wait, and return the exit code (kill if it hangs)."""
        # A second signal would mean "stop now", or kill a process that is already exiting.
        if self.proc.poll() is None and not self.signaled:
            self.proc.send_signal(signum)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._stderr.close()
        return rc

    def serve_module(self) -> Iterator[ServerProcess]:
        """A fixture's body: wait until ready, hand it over, then stop it and check that it
        exited cleanly."""
        try:
            self.wait_ready()
            yield self
        finally:
            rc = self.stop()
        assert rc == 0, self.stderr()


# --- plain HTTP helpers (stdlib only) ---------------------------------------------------


def http(url: str, method: str = "GET", body: Any = None, headers: dict[str, str] | None = None,
         raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={
        **({"Content-Type": "application/json"} if data is not None else {}),
        **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def wait_draining(base: str, within: float = 60.0) -> None:
    """Wait until the server says it is shutting down (``/health`` answers 503): the event
    a test sends SIGTERM for, not a guess at how long the signal takes to land. The
    deadline is a hang guard only."""
    deadline = time.monotonic() + within
    while http(base + "/health")[0] != 503:
        assert time.monotonic() < deadline, "the server never began to drain"
        time.sleep(0.01)


def metrics(base: str) -> dict[str, float]:
    """``/metrics`` parsed with prometheus-client's parser: sample name -> sum over labels."""
    status, _, text = http(base + "/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def labeled(base: str, name: str, **labels: str) -> float:
    """One sample of ``/metrics``: the value of ``name`` with exactly ``labels`` (0 if
    absent)."""
    status, _, text = http(base + "/metrics")
    assert status == 200
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def wait_idle(base: str, within: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is used (``within`` only
    guards against a hang: the callers assert on what the metrics say, not on when)."""
    deadline = time.monotonic() + within
    while True:
        m = metrics(base)
        idle = (m["actorllm:num_requests_running"] == 0
                and m["actorllm:num_requests_waiting"] == 0
                and m["actorllm:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.02)


# --- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    srv = ServerProcess(tiny_llama_dir, "--api-key", API_KEY, "--served-model-name", MODEL,
                        "--max-request-bytes", str(MAX_REQUEST_BYTES),
                        log_dir=tmp_path_factory.mktemp("server"))
    yield from srv.serve_module()


@pytest.fixture(scope="module")
def base(server: ServerProcess) -> str:
    return server.url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(content: str = "Hello!") -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


# --- basic shapes -------------------------------------------------------------------------


def test_models_health_version(client: openai.OpenAI, base: str) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert http(base + "/health")[0] == 200
    status, _, body = http(base + "/version")
    assert status == 200 and json.loads(body)["version"]


def test_chat_completion(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=chat(), max_tokens=8,
                                          temperature=0)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.model == MODEL and isinstance(resp.created, int)
    (choice,) = resp.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.prompt_tokens > 0
    assert 1 <= resp.usage.completion_tokens <= 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    again = client.chat.completions.create(model=MODEL, messages=chat(), max_tokens=8,
                                           temperature=0)
    assert again.choices[0].message.content == choice.message.content  # greedy is greedy


def test_chat_stream_equals_whole(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=chat("Tell me"), max_tokens=12,
                              temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]
    assert {c.id for c in chunks} == {chunks[0].id}


def test_completion_prompt_forms(client: openai.OpenAI, base: str) -> None:
    one = client.completions.create(model=MODEL, prompt="The river", max_tokens=5,
                                    temperature=0)
    assert one.object == "text_completion" and one.id.startswith("cmpl-")
    assert len(one.choices) == 1 and one.usage is not None
    tokens = json.loads(http(base + "/tokenize", "POST", {"prompt": "The river"},
                             headers=AUTH)[2])["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=tokens, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == one.choices[0].text
    many = client.completions.create(model=MODEL, prompt=["The river", "A small library"],
                                     max_tokens=5, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == one.choices[0].text == many.choices[1].text
    assert many.usage is not None and many.usage.completion_tokens == 4 * 5
    id_lists = client.completions.create(model=MODEL, prompt=[tokens, tokens[:2]],
                                         max_tokens=3, temperature=0)
    assert len(id_lists.choices) == 2
    assert id_lists.usage is not None and id_lists.usage.prompt_tokens == len(tokens) + 2


def test_completion_stream_and_echo(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt=["Hello", "The baker"], max_tokens=6,
                              temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {0: "length", 1: "length"}
    echoed = client.completions.create(**kw, echo=True)
    for c, e in zip(whole.choices, echoed.choices, strict=True):
        assert e.text == ["Hello", "The baker"][c.index] + c.text
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=6, temperature=0, echo=True, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == echoed.choices[0].text


def test_n3_and_seed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=chat("Write"), max_tokens=10, n=3,
                              temperature=1.0, seed=1234)
    a = client.chat.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    b = client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    # Streaming the same seeded request gives the same three texts.
    texts = {0: "", 1: "", 2: ""}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[i] for i in range(3)] == [c.message.content for c in a.choices]
    others = {client.chat.completions.create(**{**kw, "seed": s, "n": 1}).choices[0]
              .message.content for s in (1, 2, 3)}
    assert len(others) > 1  # different seeds draw differently


def test_stop_strings(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt="The garden", max_tokens=24, temperature=0,
                              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    # A stop string from the middle of the greedy text, of ordinary characters.
    start = next(i for i in range(3, len(full) - 2)
                 if full[i:i + 2].isprintable() and "\ufffd" not in full[i:i + 2])
    stop = full[start:start + 2]
    cut = full.index(stop)
    got = client.completions.create(**kw, stop=[stop, "never-there"])
    assert got.choices[0].text == full[:cut]
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].model_extra["stop_reason"] == stop  # type: ignore[index]
    kept = client.completions.create(**{**kw, "extra_body": {
        "ignore_eos": True, "include_stop_str_in_output": True}}, stop=stop)
    assert kept.choices[0].text == full[:cut + len(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **kw, stop=stop, stream=True))
    assert streamed == full[:cut]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=chat(), max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == 6 == resp.usage.completion_tokens  # type: ignore[union-attr]
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs), abs=1e-4)
        assert e.bytes is not None
    text = b"".join(bytes(e.bytes or []) for e in entries).decode("utf-8", errors="replace")
    assert text == choice.message.content
    streamed = [e for c in client.chat.completions.create(
        model=MODEL, messages=chat(), max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, stream=True, extra_body={"ignore_eos": True})
        if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [e.token for e in streamed] == [e.token for e in entries]
    plain = client.chat.completions.create(model=MODEL, messages=chat(), max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                                     logprobs=2, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value is not None and value <= 0
        assert top is not None and 1 <= len(top) <= 3 and token in top


def test_max_tokens_one(client: openai.OpenAI) -> None:
    a = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                  extra_body={"ignore_eos": True})
    assert a.usage is not None and a.usage.completion_tokens == 1
    assert a.choices[0].finish_reason == "length"
    b = client.chat.completions.create(model=MODEL, messages=chat(), max_completion_tokens=1,
                                       extra_body={"ignore_eos": True})
    assert b.usage is not None and b.usage.completion_tokens == 1
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=chat(), max_tokens=1, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 1


def test_unknown_fields_are_refused_and_labels_accepted(client: openai.OpenAI) -> None:
    # A field the server does not implement is a 400 naming it, never quietly ignored.
    for extra, param in (({"best_of": 1}, "best_of"), ({"foo": {"bar": 1}}, "foo")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=chat(), max_tokens=2,
                                           extra_body=extra)
        assert err.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                  extra_body={"whatever": 3})
    assert err.value.body["param"] == "whatever"  # type: ignore[index]
    # Labels are accepted and ignored on purpose (README: request fields).
    resp = client.chat.completions.create(
        model=MODEL, messages=chat(), max_tokens=2, parallel_tool_calls=True,
        user="someone", presence_penalty=0.5, frequency_penalty=0.5,
        logit_bias={"5": 2.0}, top_p=0.9, stop=None)
    assert resp.choices[0].finish_reason in ("stop", "length")
    resp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, user="x",
                                     extra_body={"top_k": 5, "min_p": 0.1, "min_tokens": 1,
                                                 "repetition_penalty": 1.1,
                                                 "stop_token_ids": [1]})
    assert resp.usage is not None and resp.usage.completion_tokens >= 1


def test_request_id_header(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=chat(), max_tokens=2, extra_headers={"X-Request-Id": "my-id-1"})
    assert raw.headers["x-request-id"] == "my-id-1"
    assert raw.parse().id == "chatcmpl-my-id-1"
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert raw.parse().id == "cmpl-" + raw.headers["x-request-id"]


# --- concurrency ------------------------------------------------------------------------


def test_32_concurrent_streams(base: str) -> None:
    async def main() -> list[tuple[str, int, str | None]]:
        aclient = openai.AsyncOpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0,
                                     timeout=300)

        async def one(i: int) -> tuple[str, int, str | None]:
            stream = await aclient.chat.completions.create(
                model=MODEL, messages=chat(f"Question {i}"), max_tokens=8, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            text, used, finish = "", 0, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    used = chunk.usage.completion_tokens
            return text, used, finish

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert len(results) == 32
    assert all(used == 8 and finish == "length" for _, used, finish in results)
    m = wait_idle(base)
    assert m["actorllm:num_requests_running"] == 0 and m["actorllm:kv_cache_usage_perc"] == 0


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
    ({"extra_body": {"n": "many"}}, "n"),
    ({"extra_body": {"seed": 2**70}}, "seed"),
    ({"prompt": list(range(2, 2 + CONTEXT + 4))}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**6]}, "prompt"),
    ({"logprobs": 50}, "logprobs"),
    ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
])
def test_bad_completion_requests_are_400(client: openai.OpenAI, kwargs: dict[str, Any],
                                         param: str) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kwargs}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**args, stream=stream)
        body = info.value.body
        assert isinstance(body, dict) and body["param"] == param, body
        assert body["type"] == "invalid_request_error" and body["message"]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://x"}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user"}], "extra_body": {"messages": "nope"}}, "messages"),
    ({"max_completion_tokens": 10_000}, "max_completion_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "word " * 300}]}, "prompt"),
])
def test_bad_chat_requests_are_400(client: openai.OpenAI, kwargs: dict[str, Any],
                                   param: str) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": chat(), "max_tokens": 4, **kwargs}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**args, stream=stream)
        body = info.value.body
        assert isinstance(body, dict) and body["param"] == param, body


def test_auth_errors(base: str) -> None:
    wrong = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=chat(), max_tokens=2)
    status, _, body = http(base + "/v1/models")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    # Outside /v1 no key is needed (health checks, scrapers).
    assert http(base + "/health")[0] == 200 and http(base + "/metrics")[0] == 200


def test_not_found_errors(client: openai.OpenAI, base: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=chat(), max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2, stream=True)
    status, _, body = http(base + "/v1/nope", headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 404 and set(json.loads(body)["error"]) == {"message", "type", "param",
                                                                "code"}
    assert http(base + "/nope")[0] == 404


def test_body_too_large_is_413(client: openai.OpenAI, base: str) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="a" * (MAX_REQUEST_BYTES + 10),
                                  max_tokens=2)
    assert info.value.status_code == 413
    # Chunked (no Content-Length): the limit counts the bytes as they arrive.
    with socket.create_connection(_host_port(base)) as sock:
        payload = json.dumps({"prompt": "a" * (MAX_REQUEST_BYTES + 10)}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}"
                "\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        sock.sendall(head.encode())
        for i in range(0, len(payload), 8192):
            part = payload[i:i + 8192]
            try:
                sock.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            except OSError:
                break  # the server answered and closed early: fine
        try:
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        reply = sock.recv(65536).decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413"), reply[:200]


def test_duplicate_request_id_is_409(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=CONTEXT - 8,
                                       stream=True, extra_body={"ignore_eos": True},
                                       extra_headers={"X-Request-Id": "dup-1"})
    try:
        next(iter(stream))  # the first request is live
        with pytest.raises(openai.ConflictError) as info:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                      extra_headers={"X-Request-Id": "dup-1"})
        assert info.value.code == "duplicate_request_id"
    finally:
        stream.close()


def test_bad_input_leaks_nothing(base: str) -> None:
    m = wait_idle(base)
    assert m["actorllm:num_requests_running"] == 0 and m["actorllm:num_requests_waiting"] == 0
    assert m["actorllm:kv_cache_usage_perc"] == 0


# --- disconnects ------------------------------------------------------------------------


def _host_port(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    return host.strip("[]"), int(port)


def _wait_running(base: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(base)
        if m["actorllm:num_requests_running"] >= 1:
            return m
        time.sleep(0.01)
    raise AssertionError("the request never ran")


def _disconnects(base: str) -> tuple[float, float]:
    """Requests aborted for a client disconnect, and requests that ran to their length."""
    return (labeled(base, "actorllm:aborted_requests_total", reason="client_disconnect"),
            labeled(base, "actorllm:request_success_total", finished_reason="length"))


def _assert_aborted_by_the_disconnect(base: str, before: dict[str, float],
                                      disconnects: tuple[float, float]) -> None:
    """The request ended because its client left (not by running to its end), and gave
    back every block. Generous guards: the events, not their timing, are the claim."""
    after = wait_idle(base)
    assert after["actorllm:num_requests_running"] == 0
    assert after["actorllm:kv_cache_usage_perc"] == 0
    assert _disconnects(base) == (disconnects[0] + 1, disconnects[1])
    key = "actorllm:aborted_requests_total"
    assert after.get(key, 0.0) == before.get(key, 0.0) + 1


def test_disconnect_mid_stream_frees_everything(client: openai.OpenAI, base: str) -> None:
    before = wait_idle(base)
    disconnects = _disconnects(base)
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=CONTEXT - 8,
                                       stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it), next(it)
    during = _wait_running(base)
    assert during["actorllm:kv_cache_usage_perc"] > 0
    stream.close()  # drops the connection mid-stream
    _assert_aborted_by_the_disconnect(base, before, disconnects)


def test_disconnect_while_waiting_for_a_whole_response(base: str) -> None:
    before = wait_idle(base)
    disconnects = _disconnects(base)
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": CONTEXT - 8,
                       "ignore_eos": True}).encode()
    with socket.create_connection(_host_port(base)) as sock:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      f"{API_KEY}\r\nContent-Type: application/json\r\nContent-Length: "
                      f"{len(body)}\r\n\r\n").encode() + body)
        _wait_running(base)
    _assert_aborted_by_the_disconnect(base, before, disconnects)


# --- the other endpoints -----------------------------------------------------------------


def test_metrics_parse(base: str) -> None:
    status, headers, text = http(base + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens", "generation_tokens", "request_success", "aborted_requests",
                 "late_outputs_dropped", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "mailbox_depth", "mailbox_high_water"):
        assert f"actorllm:{name}" in families, name
    success = families["actorllm:request_success"]
    reasons = {s.labels.get("finished_reason") for s in success.samples}
    assert {"length", "stop"} <= reasons
    boxes = {s.labels["mailbox"] for s in families["actorllm:mailbox_depth"].samples}
    assert {"frontend", "tokenizer", "scheduler", "worker", "detokenizer"} <= boxes
    m = metrics(base)
    assert m["actorllm:prompt_tokens_total"] > 0 and m["actorllm:generation_tokens_total"] > 0
    assert m["actorllm:engine_steps_total"] > 0 and m["actorllm:worker_forward_seconds_total"] > 0


def test_openapi_is_valid(base: str) -> None:
    status, _, body = http(base + "/openapi.json")
    assert status == 200
    spec = json.loads(body)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                 "/metrics", "/tokenize", "/detokenize"):
        assert path in spec["paths"], path
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(spec)


def test_tokenize_detokenize(base: str) -> None:
    status, _, body = http(base + "/tokenize", "POST", {"prompt": "Hello there"}, headers=AUTH)
    assert status == 200
    tok = json.loads(body)
    assert tok["count"] == len(tok["tokens"]) > 1 and tok["max_model_len"] == CONTEXT
    status, _, body = http(base + "/detokenize", "POST", {"tokens": tok["tokens"][1:]},
                             headers=AUTH)
    assert status == 200 and json.loads(body)["prompt"] == "Hello there"
    status, _, body = http(base + "/tokenize", "POST", {"messages": chat("Hi")}, headers=AUTH)
    assert status == 200 and json.loads(body)["count"] > 2
    status, _, body = http(base + "/detokenize", "POST", {"tokens": [10**7]}, headers=AUTH)
    assert status == 400 and json.loads(body)["error"]["param"] == "tokens"
    status, _, body = http(base + "/tokenize", "POST", raw=b"{not json", headers=AUTH)
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_json"
    # Behind the key, as in vLLM: they take client text and CPU time.
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [5]})):
        status, _, raw = http(base + path, "POST", body)
        assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"


# --- connections after an early answer (issue 14, item 3) --------------------------------


def _early_error_requests(base: str) -> list[tuple[str, dict[str, str], bytes, int]]:
    """Requests answered before their body is read: a wrong key, a body over the limit."""
    small = json.dumps({"prompt": "a" * 30_000}).encode()
    big = json.dumps({"prompt": "a" * (MAX_REQUEST_BYTES + 10)}).encode()
    json_type = {"Content-Type": "application/json"}
    return [("/v1/completions", {**json_type, "Authorization": "Bearer wrong"}, small, 401),
            ("/tokenize", json_type, small, 401),
            ("/v1/completions", {**json_type, **AUTH}, big, 413)]


def test_early_errors_say_connection_close(base: str) -> None:
    host, port = _host_port(base)
    for path, headers, body, status in _early_error_requests(base):
        conn = HTTPConnection(host, port, timeout=30)
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        assert resp.status == status
        assert resp.getheader("connection") == "close", resp.getheaders()
        assert json.loads(resp.read())["error"]["code"]
        conn.close()


def test_keep_alive_client_survives_early_errors(base: str) -> None:
    """A keep-alive client (http.client reconnects when told to close) never fails."""
    host, port = _host_port(base)
    conn = HTTPConnection(host, port, timeout=30)
    try:
        for _ in range(10):
            for path, headers, body, status in _early_error_requests(base):
                conn.request("POST", path, body=body, headers=headers)
                resp = conn.getresponse()
                assert resp.status == status
                resp.read()
                conn.request("GET", "/health")
                resp = conn.getresponse()
                assert resp.status == 200
                resp.read()
    finally:
        conn.close()


# --- hypercorn's own refusals (issue 14, item 7) ------------------------------------------


def _raw_exchange(base: str, data: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(_host_port(base), timeout=30) as sock:
        sock.sendall(data)
        reply = b""
        while True:
            part = sock.recv(65536)
            if not part:
                break
            reply += part
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), headers, body


@pytest.mark.parametrize(("data", "status"), [
    (b"NOT A REQUEST LINE\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
])
def test_protocol_errors_have_openai_bodies(base: str, data: bytes, status: int) -> None:
    got, headers, body = _raw_exchange(base, data)
    assert got == status
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "bad_http_request" and error["type"] == "invalid_request_error"
