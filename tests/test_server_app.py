"""The ASGI app in-process, on the engine's own trio loop, driven through raw ASGI calls.

Where tests/test_server.py looks from outside (the openai client, /metrics), these look
inside: after every error and every disconnect the engine must be fully drained
(invariant 4: no registry entry, no sequence, no block, no message left anywhere).
"""

from __future__ import annotations

import json
from typing import Any

import trio
from helpers import CONTEXT, Call, app_for

from actorllm.engine.async_engine import AsyncEngine
from actorllm.server.features import Features


async def test_whole_and_streamed_answers(engine: AsyncEngine) -> None:
    app = app_for(engine)
    whole = await Call("/v1/completions", {"prompt": "Hello", "max_tokens": 5,
                                           "temperature": 0, "ignore_eos": True}).run(app)
    assert whole.status == 200, whole.chunks
    text = whole.json()["choices"][0]["text"]
    streamed = await Call("/v1/completions", {"prompt": "Hello", "max_tokens": 5,
                                              "temperature": 0, "ignore_eos": True,
                                              "stream": True}).run(app)
    assert streamed.status == 200 and streamed.done
    events = streamed.events()
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == text
    assert await engine.wait_drained(30.0) == []


async def test_disconnect_mid_stream_drains_the_engine(engine: AsyncEngine) -> None:
    app = app_for(engine)
    call = Call("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                         "max_tokens": CONTEXT - 20, "ignore_eos": True,
                                         "stream": True, "n": 2})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call.run, app)
        while len(call.chunks) < 4:
            await trio.sleep(0.001)
        assert engine.frontend.registry  # running
        call.gone.set()
    assert not call.done  # cut short, no [DONE]
    assert await engine.wait_drained(30.0) == []
    assert engine.metrics.registry.get_sample_value("actorllm:aborted_requests_total",
                                                   {"reason": "client_disconnect"}) == 2


async def test_disconnect_before_a_whole_answer_drains_the_engine(engine: AsyncEngine) -> None:
    app = app_for(engine)
    call = Call("/v1/completions", {"prompt": ["Hello", "The river"], "n": 2,
                                    "max_tokens": CONTEXT - 20, "ignore_eos": True})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call.run, app)
        with trio.fail_after(30):
            while engine.frontend.stats.num_running < 4:
                await trio.sleep(0.001)
        call.gone.set()
    assert call.status is None  # nothing was sent
    assert await engine.wait_drained(30.0) == []


async def test_errors_leave_nothing_behind(engine: AsyncEngine) -> None:
    app = app_for(engine, max_pending=8)
    too_long = list(range(2, 2 + CONTEXT + 1))
    cases: list[tuple[str, dict[str, Any], int, str | None]] = [
        # the second prompt does not fit: the first one, already submitted, is aborted
        ("/v1/completions", {"prompt": [[5, 6, 7], too_long], "max_tokens": 50}, 400, "prompt"),
        ("/v1/completions", {"prompt": [[5, 6, 7], too_long], "max_tokens": 50,
                             "stream": True}, 400, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "n": 9}, 400, "n"),
        # beyond int64: refused at the edge. (Across processes it used to crash the codec;
        # in one process the Tokenizer refuses it too. The regression guard is
        # fuzz/crashes/request/, replayed by tests/test_fuzz_regressions.py.)
        ("/v1/completions", {"prompt": [[5, 6], [2**70]], "max_tokens": 4}, 400, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "model": "x"}, 404, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 1000}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                  "temperature": float("nan")}, 400, "temperature"),
        ("/v1/chat/completions", {"messages": "Hi"}, 400, "messages"),
    ]
    for path, body, status, param in cases:
        call = await Call(path, body).run(app)
        assert call.status == status, (body, call.chunks)
        error = call.json()["error"]
        assert error["param"] == param and set(error) == {"message", "type", "param", "code"}
    assert await engine.wait_drained(30.0) == []
    assert app.state.server.admission.held == 0


async def test_engine_error_mid_stream_is_an_sse_event(engine: AsyncEngine) -> None:
    app = app_for(engine)
    call = Call("/v1/completions", {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True,
                                    "stream": True})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call.run, app)
        while not call.chunks:
            await trio.sleep(0.001)
        engine.frontend.lose_all("the engine process died")
    assert call.status == 200 and call.done
    events = call.events()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and "died" in error["message"]


async def test_duplicate_live_request_id(engine: AsyncEngine) -> None:
    app = app_for(engine)
    first = Call("/v1/completions", {"prompt": "Hello", "max_tokens": CONTEXT - 20,
                                     "ignore_eos": True, "stream": True},
                 headers={"X-Request-Id": "same"})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(first.run, app)
        while not first.chunks:
            await trio.sleep(0.001)
        second = await Call("/v1/completions", {"prompt": "Hi"},
                            headers={"X-Request-Id": "same"}).run(app)
        assert second.status == 409 and second.headers["x-request-id"] == "same"
        assert second.headers["x-should-retry"] == "false"
        first.gone.set()
    assert await engine.wait_drained(30.0) == []
    bad = await Call("/v1/completions", {"prompt": "Hi"},
                     headers={"X-Request-Id": "has space"}).run(app)
    assert bad.status == 400


async def test_health_while_draining(engine: AsyncEngine) -> None:
    app = app_for(engine)
    assert (await Call("/health", method="GET").run(app)).status == 200
    app.state.server.admission.drain()
    assert (await Call("/health", method="GET").run(app)).status == 503
    refused = await Call("/v1/completions", {"prompt": "Hi"}).run(app)
    assert refused.status == 503 and refused.json()["error"]["code"] == "shutting_down"


async def test_tokenizer_info_is_served_only_when_enabled(engine: AsyncEngine) -> None:
    # Off by default, as in vLLM: it shows the chat template and the tokenizer's settings.
    off = await Call("/tokenizer_info", method="GET").run(app_for(engine))
    assert off.status == 404 and off.json()["error"]["code"] == "not_found"
    app = app_for(engine, api_key="k", features=Features(tokenizer_info=True))
    assert (await Call("/tokenizer_info", method="GET").run(app)).status == 401  # as /tokenize
    call = await Call("/tokenizer_info", method="GET",
                      headers={"authorization": "Bearer k"}).run(app)
    info, tok = call.json(), engine.tokenizer
    assert call.status == 200 and info["tokenizer_class"] == type(tok).__name__
    assert (info["bos_token"], info["eos_token"]) == (tok.bos_token, tok.eos_token)
    assert info["chat_template"] == tok.chat_template
    assert not [k for k in info if k.endswith("_file")]


async def test_overload_is_503_and_frees_its_reservation(engine: AsyncEngine) -> None:
    app = app_for(engine, max_pending=2)
    running = Call("/v1/completions", {"prompt": "Hello", "max_tokens": CONTEXT - 20,
                                       "ignore_eos": True, "stream": True, "n": 2})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(running.run, app)
        while not running.chunks:
            await trio.sleep(0.001)
        refused = await Call("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).run(app)
        assert refused.status == 503 and refused.json()["error"]["code"] == "overloaded"
        running.gone.set()
    assert app.state.server.admission.held == 0
    served = await Call("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).run(app)
    assert served.status == 200
    assert await engine.wait_drained(30.0) == []
