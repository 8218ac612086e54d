"""The HTTP edge in-process (issue 14): bad text, loop blocking, the drain cut, engine death.

The app runs on the engine's own trio loop, driven through raw ASGI calls (``Call`` from
helpers.py), so each test can look inside afterwards: the engine must be fully
drained after every refusal, cut and death.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import json
import os
import random
import string
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import CONTEXT, Call, app_for

from actorllm.engine.async_engine import AsyncEngine, Resources
from actorllm.tokenizer.actor import PromptEncoder
from actorllm.wire.messages import GenerateRequest, SamplingParams

LONE = "\ud800"  # a lone surrogate: valid in JSON and in a Python str, not in UTF-8


def _error(call: Call) -> dict[str, Any]:
    error = call.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error  # type: ignore[no-any-return]


# --- 1. lone surrogates -------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": LONE}, "prompt"),
    ("/v1/completions", {"prompt": LONE, "stream": True}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "a" + LONE]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "Hi", "model": LONE}, "model"),
    ("/v1/completions", {"prompt": "Hi", "stop": [LONE]}, "stop[0]"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {LONE: 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "user": LONE}, "user"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": LONE, "content": "Hi"}], "stream": True},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": LONE}]}]}, "messages[0].content[0].text"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ("/tokenize", {"prompt": "Hi", "model": LONE}, "model"),
    ("/detokenize", {"tokens": [5], "model": LONE}, "model"),
])
async def test_lone_surrogates_are_400_naming_the_field(engine: AsyncEngine, path: str,
                                                        body: dict[str, Any],
                                                        param: str) -> None:
    call = await Call(path, body).run(engine_app(engine))
    assert call.status == 400, call.chunks
    error = _error(call)
    assert error["param"] == param and "surrogate" in error["message"], error
    assert await engine.wait_drained(30.0) == []


def engine_app(engine: AsyncEngine) -> Any:
    return app_for(engine)


def test_prompt_encoder_refuses_lone_surrogates(resources: Resources) -> None:
    """The Python API reaches the Tokenizer without the HTTP schema: it checks too."""
    enc = PromptEncoder(resources.hf_tokenizer, resources.info)
    params = SamplingParams(max_tokens=4)
    from actorllm.wire.messages import ChatMessage, InvalidRequest
    for req, param in [
        (GenerateRequest("a", params, prompt="ok " + LONE), "prompt"),
        (GenerateRequest("b", params, messages=(ChatMessage("user", "fine"),
                                                      ChatMessage("user", LONE))),
         "messages[1]"),
    ]:
        with pytest.raises(InvalidRequest) as info:
            enc.encode(req)
        assert info.value.param == param


async def test_engine_api_lone_surrogate_is_invalid_request(engine: AsyncEngine) -> None:
    """Through the engine (the Tokenizer actor), the error is invalid_request, not internal."""
    from actorllm.wire.outputs import RequestError
    with pytest.raises(RequestError) as info:
        async for _ in engine.generate(GenerateRequest("s1", SamplingParams(max_tokens=2),
                                                       prompt=LONE)):
            pass
    assert info.value.code == "invalid_request" and info.value.param == "prompt"
    assert await engine.wait_drained(30.0) == []


# --- 6. booleans are not integers ----------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/detokenize", {"tokens": [True]}, "tokens[0]"),
    ("/v1/completions", {"prompt": [[False]]}, "prompt"),
    ("/v1/completions", {"prompt": [5, True]}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [True]}, "stop_token_ids[0]"),
    ("/v1/completions", {"prompt": "Hi", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": False}, "logprobs"),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 2}, "messages"),
    ("/v1/completions", {"prompt": "Hi", "stop": [""]}, "stop"),
])
async def test_booleans_and_bounds_are_refused(engine: AsyncEngine, path: str,
                                               body: dict[str, Any], param: str) -> None:
    call = await Call(path, body).run(engine_app(engine))
    assert call.status == 400, call.chunks
    assert _error(call)["param"] == param


# --- 2. the loop is not blocked by tokenizing client text --------------------------------


class _LoopGate:
    """Stands in for the Rust tokenizer behind ``hf_tokenizer``: encoding a big text
    returns only once the trio loop has run its heartbeat after the encoding began.

    Off the loop, the heartbeat runs beside the encoding and the gate opens at once; on
    the loop, the heartbeat cannot run until the encoding returns, so the gate waits out
    its guard and records the starved call. No clock is asserted on: the event is the
    heartbeat running while a big prompt is being tokenized.
    """

    BIG = 4 * 1024  # characters: short texts may be tokenized on the loop by design

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.ticked = threading.Event()
        self.big_calls = 0
        self.starved = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name not in ("encode", "encode_batch", "encode_batch_fast"):
            return value

        def gated(*args: Any, **kwargs: Any) -> Any:
            if not self._is_big(args):
                return value(*args, **kwargs)
            self.big_calls += 1
            self.ticked.clear()
            out = value(*args, **kwargs)
            if not self.ticked.wait(timeout=10.0):  # a guard: on the loop it never comes
                self.starved += 1
            return out

        return gated

    def _is_big(self, args: tuple[Any, ...]) -> bool:
        flat = [a for arg in args for a in (arg if isinstance(arg, list) else [arg])]
        return any(isinstance(a, str) and len(a) > self.BIG for a in flat)

    async def heartbeat(self) -> None:
        while True:
            self.ticked.set()
            await trio.sleep(0.001)


def _big_text(words: int = 20_000) -> str:
    """Random words, as an attacker would send (the BPE word cache makes a repeated text
    fast): well over the context, and over the Tokenizer actor's inline limit."""
    rng = random.Random(14)
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9)))
                    for _ in range(words))


@pytest.mark.parametrize(("path", "make"), [
    ("/tokenize", lambda t: {"prompt": t}),
    ("/tokenize", lambda t: {"messages": [{"role": "user", "content": t}]}),
    # The Tokenizer actor: a chat prompt that is then refused as too long.
    ("/v1/chat/completions", lambda t: {"messages": [{"role": "user", "content": t}]}),
    ("/v1/completions", lambda t: {"prompt": t, "stream": True}),
])
async def test_tokenizing_a_big_prompt_does_not_block_the_loop(
        engine: AsyncEngine, resources: Resources, monkeypatch: pytest.MonkeyPatch,
        path: str, make: Any) -> None:
    text = _big_text()
    gate = _LoopGate(resources.hf_tokenizer._tokenizer)
    monkeypatch.setattr(resources.hf_tokenizer, "_tokenizer", gate)
    app = app_for(engine, max_request_bytes=len(text) * 2 + 4096)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.heartbeat)
        call = await Call(path, make(text)).run(app)
        nursery.cancel_scope.cancel()
    assert call.status == (200 if path == "/tokenize" else 400), call.chunks[:1]
    # The big text was tokenized, and each time the loop ran while it was.
    assert gate.big_calls >= 1
    assert gate.starved == 0, f"{gate.starved} of {gate.big_calls} encodings held the loop"
    assert await engine.wait_drained(30.0) == []


# --- 4. the drain cut ----------------------------------------------------------------------


async def _until(cond: Any, timeout: float = 30.0) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.001)


async def test_drain_cut_ends_a_stream_with_an_error_event(engine: AsyncEngine) -> None:
    app = app_for(engine)
    call = Call("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                         "max_tokens": CONTEXT - 20, "ignore_eos": True,
                                         "stream": True, "n": 2})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call.run, app)
        await _until(lambda: len(call.chunks) >= 4)
        app.state.server.drain_expired.set()
    assert call.status == 200 and call.done  # the chunked body is complete
    events = call.events()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and set(error) == {"message", "type", "param",
                                                               "code"}
    assert await engine.wait_drained(30.0) == []
    assert app.state.server.admission.held == 0


async def test_drain_cut_answers_a_whole_request_with_503(engine: AsyncEngine) -> None:
    app = app_for(engine)
    call = Call("/v1/completions", {"prompt": ["Hello", "The river"], "n": 2,
                                    "max_tokens": CONTEXT - 20, "ignore_eos": True})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call.run, app)
        await _until(lambda: engine.frontend.stats.num_running >= 4)
        app.state.server.drain_expired.set()
    assert call.status == 503 and _error(call)["code"] == "shutting_down"
    assert await engine.wait_drained(30.0) == []


async def test_drain_cut_before_the_first_token(engine: AsyncEngine) -> None:
    """Cut while still waiting for prefill: a 503, as the headers are not out yet."""
    app = app_for(engine)
    app.state.server.drain_expired.set()
    call = await Call("/v1/completions", {"prompt": "Hello", "max_tokens": 50,
                                          "stream": True}).run(app)
    assert call.status == 503 and _error(call)["code"] == "shutting_down"
    assert await engine.wait_drained(30.0) == []


async def test_draining_refuses_with_shutting_down(engine: AsyncEngine) -> None:
    app = app_for(engine)
    app.state.server.admission.drain()
    for path, body, method in [("/health", None, "GET"),
                               ("/v1/completions", {"prompt": "Hi"}, "POST")]:
        call = await Call(path, body, method=method).run(app)
        assert call.status == 503 and _error(call)["code"] == "shutting_down"
        assert call.headers.get("connection") == "close"


# --- 5. a dead engine (single topology: an actor raised) ---------------------------------


async def test_an_actor_crash_is_engine_death(engine: AsyncEngine) -> None:
    app = app_for(engine)
    scheduler = engine.actors["scheduler"]
    handle = scheduler.handle

    def crash_on_request(msg: Any) -> None:
        if getattr(msg, "rid", "").startswith("boom"):
            raise RuntimeError("planted scheduler bug")
        handle(msg)

    scheduler.handle = crash_on_request
    running = Call("/v1/completions", {"prompt": "Hello", "max_tokens": CONTEXT - 20,
                                       "ignore_eos": True, "stream": True})
    whole = Call("/v1/completions", {"prompt": "Hello", "max_tokens": CONTEXT - 20,
                                     "ignore_eos": True})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(running.run, app)
        nursery.start_soon(whole.run, app)
        await _until(lambda: len(running.chunks) >= 2 and engine.frontend.stats.num_running >= 2)
        boom = await Call("/v1/completions", {"prompt": "Hi", "max_tokens": 2},
                          headers={"X-Request-Id": "boom-1"}).run(app)
    assert engine.died.is_set() and "planted scheduler bug" in (engine.dead_reason or "")
    # Every request in flight was failed with engine_dead, whichever way it was answering.
    assert boom.status == 503 and _error(boom)["code"] == "engine_dead"
    assert whole.status == 503 and _error(whole)["code"] == "engine_dead"
    events = running.events()
    assert running.done and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_dead"
    assert not engine.frontend.registry
    for path, body, method in [("/health", None, "GET"),
                               ("/v1/completions", {"prompt": "Hi"}, "POST")]:
        call = await Call(path, body, method=method).run(app)
        assert call.status == 503 and _error(call)["code"] == "engine_dead", call.chunks


# --- 8. memory: a plateau under a soak of requests ------------------------------------------


def _rss() -> int:
    """Resident memory now, after a collection and returning free heap pages to the OS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS is noisier, the bound still holds
        pass
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_SOAK = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 1}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 1, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 0}),  # a 400
    ("/tokenize", {"prompt": "The river"}),
    ("/detokenize", {"tokens": [5, 6, 7]}),
]


ROUND = 500


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc (Linux)")
async def test_soak_memory_plateaus(engine: AsyncEngine) -> None:
    """Issue 14, item 8: ~0.8 KB of RSS per request, no plateau, was reported over HTTP.

    tracemalloc showed the Python heap flat after warm-up; so must both it and RSS be
    here: 2,600 requests, four measured rounds after a warm-up, 16 at a time.
    """
    app = app_for(engine)

    async def round_of(n: int) -> None:
        async def worker(k: int) -> None:
            for i in range(k, n, 16):
                path, body = _SOAK[i % len(_SOAK)]
                call = await Call(path, body).run(app)
                assert call.status in (200, 400), call.chunks

        async with trio.open_nursery() as nursery:
            for k in range(16):
                nursery.start_soon(worker, k)

    with trio.fail_after(120):
        await round_of(600)  # warm-up: caches, pools, allocator arenas
        tracemalloc.start(1)
        try:
            rss, heap = [_rss()], [tracemalloc.get_traced_memory()[0]]
            for _ in range(4):
                await round_of(ROUND)
                rss.append(_rss())
                heap.append(tracemalloc.get_traced_memory()[0])
        finally:
            tracemalloc.stop()
    rss_growth = [b - a for a, b in itertools.pairwise(rss)]
    heap_growth = [b - a for a, b in itertools.pairwise(heap)]
    # The first rounds still warm up (80 KB of heap, 1 MB of RSS, then 7-25 KB of heap
    # seen); a leak of 40 bytes of heap a request would still show in the last round
    # (measured there: under 8 KB). That is the precise check. RSS moves by whole pages
    # as the allocator's arenas grow and shrink (CI saw +233 KB, -4 KB, +303 KB in three
    # rounds, and +278 KB in the quietest of three on a busy machine), so it only guards
    # against a native leak: one of 1 KB a request grows *every* round by 500 KB.
    assert heap_growth[-1] < ROUND * 40, heap_growth
    assert min(rss_growth) < ROUND * 1000, rss_growth
    assert await engine.wait_drained(30.0) == []
