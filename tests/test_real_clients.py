"""Clients people point at an OpenAI-compatible server, driven as they are shipped against
a real ``actorllm serve`` (the embedded model): LangChain's ``ChatOpenAI``, the OpenAI
Agents SDK and lm-evaluation-harness's ``local-completions`` model.

The oracles are transformers on the same weights: LangChain's greedy answer must be what
``generate`` gives for the chat template's tokens, and lm-eval's scores and generations
through the server what lm-eval's own ``hf`` backend computes in-process.
The openai SDK's chat ``parse()`` helpers are here too; its Responses helpers are in
tests/test_responses.py, its tool streams in tests/test_tool_calls_server.py.
(``tests/test_lm_eval_protocol.py`` replays lm-eval's requests by hand, for string
prompts.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import agents
import openai
import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage
from langchain_openai import ChatOpenAI
from lm_eval import utils as lm_utils
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.models.openai_completions import LocalCompletionsAPI
from pydantic import BaseModel, Field
from test_server import ServerProcess, http, labeled, wait_idle

from actorllm.config import default_model_dir

MODEL_DIR = Path(default_model_dir())
MODEL = "default"
MAX_TOKENS = 24
ABORTED = "actorllm:aborted_requests_total"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    srv = ServerProcess(MODEL_DIR, "--served-model-name", MODEL,
                        "--enable-tokenizer-info-endpoint",
                        log_dir=tmp_path_factory.mktemp("real-clients"))
    for ready in srv.serve_module():
        yield ready.url


def chat_model(base: str, **kw: Any) -> ChatOpenAI:
    return ChatOpenAI(base_url=base + "/v1", api_key="x", model=MODEL, max_retries=0,
                      timeout=120, **{"temperature": 0, "max_tokens": MAX_TOKENS, **kw})


# --- LangChain's ChatOpenAI -----------------------------------------------------------------


def test_langchain_greedy_answer_is_what_transformers_generates(
        base: str, default_tokenizer: Any, default_hf: Any) -> None:
    question = "Write a function that adds two numbers"
    msg = chat_model(base).invoke(question)
    ids = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True,
        return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = default_hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert msg.content == default_tokenizer.decode(new, skip_special_tokens=True)
    assert msg.usage_metadata is not None
    assert msg.usage_metadata["input_tokens"] == ids.shape[1]
    assert msg.usage_metadata["output_tokens"] == len(new)
    assert msg.response_metadata["finish_reason"] == (
        "stop" if new[-1] == default_tokenizer.eos_token_id else "length")
    # Streamed, the chunks add up to the same answer, usage in the last one.
    chunks = list(chat_model(base, stream_usage=True).stream(question))
    assert "".join(str(c.content) for c in chunks) == msg.content
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert usage and usage[-1]["output_tokens"] == len(new)


class City(BaseModel):
    name: str = Field(max_length=16)
    population: int


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_parses(base: str, method: str) -> None:
    llm = chat_model(base, max_tokens=64).with_structured_output(
        City, method=method, include_raw=True)
    got = llm.invoke("Name a city and its population.")
    assert got["parsing_error"] is None, got["raw"]
    assert isinstance(got["parsed"], City)


def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return f"sunny in {city}"


def lookup_time(zone: str) -> str:
    """The time of day in a time zone."""
    return f"noon in {zone}"


@pytest.mark.parametrize("choice", ["get_weather", "required"])
def test_langchain_bound_tools_are_called(base: str, choice: str) -> None:
    llm = chat_model(base, max_tokens=64).bind_tools([get_weather, lookup_time],
                                                    tool_choice=choice)
    msg = llm.invoke("What is the weather in Paris?")
    assert isinstance(msg, AIMessage) and msg.tool_calls, msg
    for call in msg.tool_calls:
        assert call["name"] in ({choice} if choice != "required" else
                                {"get_weather", "lookup_time"})
        param = "city" if call["name"] == "get_weather" else "zone"
        assert isinstance(call["args"][param], str)
    if choice != "required":
        assert [c["name"] for c in msg.tool_calls] == [choice]


def test_langchain_n_batch_and_the_responses_api(base: str) -> None:
    result = chat_model(base, n=2, temperature=0.8, seed=7).generate([[HumanMessage("Say hi")]])
    assert len(result.generations[0]) == 2
    answers = chat_model(base, max_tokens=6).batch(["Hi", "Hello", "Hey"])
    assert len(answers) == 3 and all(a.content for a in answers)
    # With use_responses_api the same model speaks /v1/responses; greedy, the text is the
    # chat answer to the same message.
    via_responses = chat_model(base, max_tokens=8, use_responses_api=True).invoke("Hi")
    assert via_responses.text == chat_model(base, max_tokens=8).invoke("Hi").content


def test_langchain_leaving_a_stream_aborts_the_request(base: str) -> None:
    # A chat UI's "stop": the consumer leaves astream; the server must see the client go
    # and abort the request rather than generate its 400 tokens for nobody.
    before = labeled(base, ABORTED, reason="client_disconnect")

    async def read_three() -> int:
        llm = chat_model(base, max_tokens=400, extra_body={"ignore_eos": True})
        seen = 0
        async for _ in llm.astream("Write a long story."):
            seen += 1
            if seen == 3:
                break
        return seen

    assert asyncio.run(read_three()) == 3
    idle = wait_idle(base)  # (had it not been aborted, it would run its 400 tokens first)
    assert idle["actorllm:num_requests_running"] == 0
    assert idle["actorllm:kv_cache_usage_perc"] == 0
    assert labeled(base, ABORTED, reason="client_disconnect") == before + 1


def test_langchain_unsupported_field_is_a_400_naming_it(base: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat_model(base, reasoning_effort="low").invoke("Hi")
    assert err.value.status_code == 400
    assert err.value.param == "reasoning_effort"


# --- the openai SDK's parse helpers for chat ------------------------------------------------


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=12)


def test_openai_chat_parse_and_its_stream(base: str) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "temperature": 0,
                          "messages": [{"role": "user", "content": "Name a city."}]}
    whole = client.chat.completions.parse(response_format=City, **kw)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "stop" and message.refusal is None
    assert isinstance(message.parsed, City)
    assert message.parsed == City.model_validate_json(message.content or "")
    with client.chat.completions.stream(response_format=City, **kw) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert {"content.delta", "content.done"} <= kinds
    assert final.choices[0].message.parsed == message.parsed  # greedy: the same answer
    # A strict tool from a pydantic model: the client parses the forced call's arguments.
    called = client.chat.completions.parse(
        tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
        parallel_tool_calls=False,
        **{**kw, "messages": [{"role": "user", "content": "Weather in Paris?"}]})
    (call,) = called.choices[0].message.tool_calls or []
    assert call.function.name == "GetWeather"
    assert call.function.parsed_arguments == GetWeather.model_validate_json(
        call.function.arguments)


def test_openai_sdk_return_token_ids_are_what_the_model_ran(
        base: str, default_tokenizer: Any, default_hf: Any) -> None:
    """vLLM's ``return_token_ids`` (RL frameworks read it through the openai SDK's
    extra fields): the prompt's ids are the chat template's, a choice's are what
    transformers' greedy ``generate`` gives; streamed, the chunks' ids add up to the
    same and the prompt's come once; completions carry both on each choice."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    talk = [{"role": "user", "content": "Name a river."}]
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0,
                          "extra_body": {"return_token_ids": True}}
    prompt = default_tokenizer.apply_chat_template(
        talk, add_generation_prompt=True, return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        new = default_hf.generate(prompt, max_new_tokens=8, do_sample=False)[0,
                                                                             prompt.shape[1]:]
    whole = client.chat.completions.create(messages=talk, **kw)  # type: ignore[call-overload]
    assert whole.model_extra["prompt_token_ids"] == prompt[0].tolist()
    assert whole.choices[0].model_extra["token_ids"] == new.tolist()
    stream = client.chat.completions.create(messages=talk, stream=True, **kw)
    chunks = list(stream)  # type: ignore[call-overload]
    told = [c.model_extra["prompt_token_ids"] for c in chunks
            if (c.model_extra or {}).get("prompt_token_ids")]
    assert told == [prompt[0].tolist()]
    # ... on the role chunk, the first, as vLLM sends them
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["prompt_token_ids"] == prompt[0].tolist()
    assert [t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids", [])
            ] == new.tolist()
    text = "The river"
    ids = default_tokenizer(text).input_ids
    with torch.no_grad():
        want = default_hf.generate(torch.tensor([ids]), max_new_tokens=8,
                                   do_sample=False)[0, len(ids):].tolist()
    done = client.completions.create(prompt=[text, text], n=2, **kw)  # type: ignore[call-overload]
    assert len(done.choices) == 4
    for choice in done.choices:
        assert choice.model_extra["prompt_token_ids"] == ids
        assert choice.model_extra["token_ids"] == want
    streamed = list(client.completions.create(prompt=text, stream=True, **kw))  # type: ignore[call-overload]
    assert [c.choices[0].model_extra.get("prompt_token_ids") for c in streamed
            if c.choices and c.choices[0].model_extra.get("prompt_token_ids")] == [ids]
    assert [t for c in streamed for ch in c.choices
            for t in ch.model_extra.get("token_ids", [])] == want
    plain = client.completions.create(prompt=text, model=MODEL, max_tokens=2)
    assert "token_ids" not in (plain.choices[0].model_extra or {})


def test_openai_sdk_truncate_prompt_tokens_runs_the_prompts_tail(
        base: str, default_tokenizer: Any, default_hf: Any) -> None:
    """vLLM's ``truncate_prompt_tokens`` through the SDK's extra fields: completions and
    chat run only the prompt's last k tokens (greedy output is transformers' on them,
    usage counts them); with ``echo`` it is refused by name."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    text, k = "The river runs down to the sea, and the sea runs on and on.", 6
    ids = default_tokenizer(text).input_ids
    assert len(ids) > k
    with torch.no_grad():
        want = default_hf.generate(torch.tensor([ids[-k:]]), max_new_tokens=8,
                                   do_sample=False)[0, k:].tolist()
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0,
                          "extra_body": {"truncate_prompt_tokens": k, "return_token_ids": True}}
    done = client.completions.create(prompt=text, **kw)  # type: ignore[call-overload]
    assert done.usage.prompt_tokens == k
    assert done.choices[0].model_extra["prompt_token_ids"] == ids[-k:]
    assert done.choices[0].model_extra["token_ids"] == want
    chat = client.chat.completions.create(  # type: ignore[call-overload]
        messages=[{"role": "user", "content": text}], **kw)
    assert chat.usage.prompt_tokens == k and len(chat.model_extra["prompt_token_ids"]) == k
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(prompt=text, echo=True, **kw)  # type: ignore[call-overload]
    assert err.value.param == "truncate_prompt_tokens"


# --- the OpenAI Agents SDK ------------------------------------------------------------------


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_agents_sdk_runs_a_tool(base: str, api: str) -> None:
    # The agent is made to call its tool; the run ends with the tool's result (a second,
    # free turn would read the result under the call's id, which is random, so its text
    # and whether it ends within max_tokens change from run to run). Streamed too.
    cities: list[str] = []

    @agents.function_tool
    def weather(city: str) -> str:
        """Get the weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    async def run(streamed: bool) -> tuple[Any, set[str]]:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        model = (agents.OpenAIResponsesModel if api == "responses" else
                 agents.OpenAIChatCompletionsModel)(model=MODEL, openai_client=client)
        agent = agents.Agent(name="w", instructions="Be brief.", model=model,
                             tools=[weather], tool_use_behavior="stop_on_first_tool",
                             model_settings=agents.ModelSettings(
                                 tool_choice="required", parallel_tool_calls=False,
                                 temperature=0, max_tokens=64))
        if not streamed:
            return await agents.Runner.run(agent, "Weather in Paris?", max_turns=3), set()
        result = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
        kinds = {event.type async for event in result.stream_events()}
        return result, kinds

    agents.set_tracing_disabled(True)
    whole, _ = asyncio.run(run(streamed=False))
    items = [type(i).__name__ for i in whole.new_items]
    assert items == ["ToolCallItem", "ToolCallOutputItem"], items
    assert len(cities) == 1 and whole.final_output == f"sunny in {cities[0]}"
    streamed, kinds = asyncio.run(run(streamed=True))
    assert {"raw_response_event", "run_item_stream_event"} <= kinds
    assert [type(i).__name__ for i in streamed.new_items] == items
    assert streamed.final_output == whole.final_output  # greedy: the same forced call


# --- lm-evaluation-harness's local-completions --------------------------------------------


def local_completions(base: str, **kw: Any) -> LocalCompletionsAPI:
    return LocalCompletionsAPI(model=MODEL, base_url=base + "/v1/completions",
                               tokenized_requests=True, max_length=511, num_concurrent=2,
                               batch_size=4, **kw)


def hf_backend(hf: Any, tokenizer: Any, api: LocalCompletionsAPI, **kw: Any) -> HFLM:
    """lm-eval's in-process backend, windowed as ``api`` is: the API model keeps one
    position for the token it asks for, so its rolling windows are one shorter."""
    return HFLM(pretrained=hf, tokenizer=tokenizer, max_length=api.max_length - 1,
                batch_size=4, **kw)


CONTEXT = "Return a new list containing all items from the iterable in ascending "
CHOICES = ["order.", "colour.", "time.", " orderly fashion."]


def test_lm_eval_scores_through_the_server_as_its_hf_backend(
        base: str, default_tokenizer: Any, default_hf: Any) -> None:
    # The README's command: the client's own tokenizer, BOS added, token ids sent.
    api = local_completions(base, tokenizer_backend="huggingface", tokenizer=str(MODEL_DIR),
                            add_bos_token=True)
    ref = hf_backend(default_hf, default_tokenizer, api, add_bos_token=True)
    pairs = [Instance("loglikelihood", {}, (CONTEXT, c), i) for i, c in enumerate(CHOICES)]
    pairs.append(Instance("loglikelihood", {}, ("", "The os module provides"), len(CHOICES)))
    got, want = api.loglikelihood(pairs), ref.loglikelihood(pairs)
    for (score, greedy), (ref_score, ref_greedy) in zip(got, want, strict=True):
        assert score == pytest.approx(ref_score, abs=1e-3), (got, want)
        assert greedy == ref_greedy
    text = (MODEL_DIR / "heldout_sample.txt").read_text(encoding="utf-8")
    rolling = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    windows = lm_utils.get_rolling_token_windows(
        token_list=api.tok_encode(text), prefix_token=api.prefix_token_id,
        max_seq_len=api.max_length - 1, context_len=1)
    assert len(list(windows)) > 2  # the text spans several windows
    (score,), (ref_score,) = api.loglikelihood_rolling(rolling), ref.loglikelihood_rolling(rolling)
    assert score == pytest.approx(ref_score, abs=0.02)  # (over ~1,700 tokens)
    gen = [Instance("generate_until", {}, ("def add(a, b):\n    ",
                                           {"until": ["\n\n"], "max_gen_toks": 24}), 0),
           Instance("generate_until", {}, ("The os module provides",
                                           {"until": ["."], "max_gen_toks": 20}), 1)]
    assert api.generate_until(gen) == ref.generate_until(gen)


def test_lm_eval_tokenizes_through_the_server_when_it_may(
        base: str, default_tokenizer: Any, default_hf: Any) -> None:
    # Served with --enable-tokenizer-info-endpoint, the harness's default backend finds
    # /tokenizer_info and tokenizes with /tokenize (it adds no BOS there: lm-eval's
    # add_bos_token is for a tokenizer of its own).
    api = local_completions(base)
    assert api.tokenizer_backend == "remote"
    assert api.tok_encode(CONTEXT) == default_tokenizer(CONTEXT, add_special_tokens=False).input_ids
    ref = hf_backend(default_hf, default_tokenizer, api, add_bos_token=False)
    pairs = [Instance("loglikelihood", {}, (CONTEXT, c), i) for i, c in enumerate(CHOICES)]
    got, want = api.loglikelihood(pairs), ref.loglikelihood(pairs)
    for (score, greedy), (ref_score, ref_greedy) in zip(got, want, strict=True):
        assert score == pytest.approx(ref_score, abs=1e-3), (got, want)
        assert greedy == ref_greedy
    status, _, raw = http(base + "/tokenizer_info")
    info = json.loads(raw)
    assert status == 200 and info["eos_token"] == default_tokenizer.eos_token
    assert info["chat_template"] == default_tokenizer.chat_template
