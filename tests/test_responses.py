"""``POST /v1/responses`` through the official ``openai`` client (issue 31).

The Responses API rides the chat completions path, so greedy text must equal the chat
answer to the same conversation; the client's own stream helper reassembles the typed
events; tools, ``text.format``, the store and ``previous_response_id`` are driven the
way an agent client does. Reasoning items are checked on hand-written model text (the
embedded model never thinks by itself).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response
from pydantic import BaseModel
from test_server import ServerProcess, http

from actorllm.config import default_model_dir
from actorllm.server.reasoning import REASONING_PARSERS
from actorllm.server.render import ChatRenderer
from actorllm.server.response_store import ResponseStore
from actorllm.server.responses import input_messages
from actorllm.server.responses_stream import ResponsesRenderer
from actorllm.wire.outputs import CompletionOutput

WEATHER = {"type": "function", "name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}


class Answer(BaseModel):
    answer: bool


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    srv = ServerProcess(Path(default_model_dir()), "--served-model-name", "m",
                        "--responses-store-size", "3",
                        log_dir=tmp_path_factory.mktemp("responses"))
    for ready in srv.serve_module():
        yield openai.OpenAI(base_url=ready.url + "/v1", api_key="x", max_retries=0,
                            timeout=120)


def test_text_equals_the_chat_answer(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="m", instructions="Be brief.", input="Hello",
                                   max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(
        model="m", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hello"}])
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage is not None and chat.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    finish = chat.choices[0].finish_reason
    assert resp.status == ("incomplete" if finish == "length" else "completed")


def test_stream_reassembles_to_the_whole_answer(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "m", "input": "Is water wet?", "temperature": 0,
                          "max_output_tokens": 40, "text_format": Answer}
    whole = client.responses.parse(**kw)
    types = []
    with client.responses.stream(**kw) as stream:
        for event in stream:
            types.append(event.type)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert isinstance(final.output_parsed, Answer) and final.output_parsed == whole.output_parsed
    assert types[:2] == ["response.created", "response.in_progress"]
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.delta", "response.output_text.done",
                 "response.output_item.done"):
        assert kind in types
    assert types[-1] == "response.completed"


def test_tool_call_and_its_answer_continue_the_conversation(client: openai.OpenAI) -> None:
    forced: dict[str, Any] = {"model": "m", "input": "Weather in Paris?", "tools": [WEATHER],
                              "tool_choice": "required", "parallel_tool_calls": False,
                              "max_output_tokens": 60, "temperature": 0}
    first = client.responses.create(**forced)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    with client.responses.stream(**forced) as stream:
        deltas = sum(e.type == "response.function_call_arguments.delta" for e in stream)
        streamed = stream.get_final_response()
    (scall,) = [o for o in streamed.output if o.type == "function_call"]
    assert (scall.name, scall.arguments) == (call.name, call.arguments) and deltas > 1
    nxt = client.responses.create(
        model="m", previous_response_id=first.id, max_output_tokens=5, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert nxt.previous_response_id == first.id and nxt.usage is not None
    assert first.usage is not None and nxt.usage.input_tokens > first.usage.input_tokens
    # The same conversation spelled out in full reads the same prompt.
    again = client.responses.create(
        model="m", max_output_tokens=5, tools=[WEATHER],
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert again.usage is not None and again.usage.input_tokens == nxt.usage.input_tokens


def test_store_is_bounded_and_misses_are_404(client: openai.OpenAI) -> None:
    ids = [client.responses.create(model="m", input=f"n{i}", max_output_tokens=1).id
           for i in range(4)]
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # --responses-store-size 3: the oldest went
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id="resp_nope")
    unstored = client.responses.create(model="m", input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id=unstored.id)


@pytest.mark.parametrize(("extra", "named"), [
    ({"background": True}, "background"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]")])
def test_unsupported_fields_are_refused_by_name(client: openai.OpenAI, extra: dict[str, Any],
                                               named: str) -> None:
    url = str(client.base_url).rstrip("/") + "/responses"
    status, _, body = http(url, "POST", {"model": "m", "input": "x", **extra})
    assert status == 400
    assert named in json.loads(body)["error"]["message"] + str(json.loads(body)["error"]["param"])


# --- without a server ---------------------------------------------------------------------


def _render(text: str, pieces: list[str], *, stream: bool) -> Any:
    chat = ChatRenderer(response_id="resp_x", created=0, model="m", num_choices=1,
                        texts=None, logprobs=False,  # type: ignore[arg-type]
                        reasoning=REASONING_PARSERS["qwen3"])
    kept: list[dict[str, Any]] = []

    def envelope(status: str, output: list[Any], usage: Any, details: Any) -> dict[str, Any]:
        return {"id": "resp_x", "object": "response", "created_at": 0, "status": status,
                "output": output, "usage": usage, "incomplete_details": details, "model": "m",
                "tools": [], "tool_choice": "auto", "parallel_tool_calls": True}

    renderer = ResponsesRenderer(chat, envelope, kept.append)

    class Job:
        index_base = 0
        echo = ""
        echo_skips_special = True

    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    if not stream:
        chat.choices[0].merged.add(CompletionOutput(0, text, (1,), finish_reason="stop"))
        return Response.model_validate(renderer.final(usage)), kept
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)
    events = renderer.prelude([])
    for i, piece in enumerate(pieces):
        out = CompletionOutput(0, piece, (1,),
                               finish_reason="stop" if i == len(pieces) - 1 else None)
        events += renderer.add(Job(), out) or []  # type: ignore[arg-type]
    events += renderer.usage_chunk(usage)
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter: Any = TypeAdapter(ResponseStreamEvent)
    for event in events:
        state.handle_event(adapter.validate_python(event))
    return state._completed_response, kept


@pytest.mark.parametrize("cut", [1, 5, 9, 17, 30])
def test_reasoning_items_whole_and_streamed(cut: int) -> None:
    text = "<think>It is cold.</think>\n\nTake a coat."
    whole, kept = _render(text, [], stream=False)
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "It is cold."
    assert whole.output_text == "Take a coat." and kept and kept[0]["status"] == "completed"
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    final, kept = _render(text, pieces, stream=True)
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "It is cold."
    assert final.output_text == "Take a coat."


def test_store_ages_out(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("actorllm.server.response_store.time.monotonic", lambda: now[0])
    store = ResponseStore(size=10, ttl=60)
    store.put({"id": "resp_a"}, [])
    now[0] += 30
    store.put({"id": "resp_b"}, [{"role": "user", "content": "b"}])
    now[0] += 45  # a is 75 s old, b 45 s
    assert store.get("resp_b")[1] == [{"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="not found"):
        store.get("resp_a")


def test_input_items_become_chat_messages() -> None:
    got = input_messages([
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"}])
    assert got == [
        {"role": "system", "content": "rules"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"}]
