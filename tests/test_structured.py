"""Structured output and tool calling with the embedded model (issue 16).

The embedded model writes Python documentation and knows nothing of JSON: whatever it
produces under a grammar is valid only because the grammar masked everything else. So
every check here is against the schema (``jsonschema``), the regex or the choice list,
never against a recorded output. Schemas bound their strings and arrays so that the
engine finishes (the grammar completes, then only EOS is allowed) well inside
``max_tokens``.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import jsonschema
import pytest
import torch
import trio
from helpers import Call, app_for

from actorllm.config import EngineConfig, default_model_dir
from actorllm.engine.async_engine import AsyncEngine, Resources, open_engine
from actorllm.llm import collect, make_request
from actorllm.text.structured import (
    GrammarRefused,
    LLGuidanceBackend,
    MaskFiller,
    PendingMasks,
    _bias,
    apply_grammar_masks,
)
from actorllm.wire.messages import ChatMessage, SamplingParams, StructuredOutput
from actorllm.worker.sampler import SamplingState

_NAME = {"type": "string", "maxLength": 6}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0,
                                                             "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "maximum": 9,
                                                         "minimum": -9},
                                                   "y": {"type": "integer", "maximum": 9,
                                                         "minimum": -9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "label": _NAME}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                               "maxItems": 3},
                                      "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def resources() -> Resources:
    return Resources(EngineConfig(model=str(default_model_dir()), num_kv_blocks=256))


@pytest.fixture
async def engine(resources: Resources) -> AsyncIterator[AsyncEngine]:
    async with open_engine(resources.config, resources=resources) as eng:
        yield eng
        assert await eng.wait_drained(30.0) == []


def _chat(content: str = "Describe it.") -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


async def test_twenty_json_schema_requests_all_validate(engine: AsyncEngine) -> None:
    app = app_for(engine)
    calls: list[tuple[dict[str, Any], Call]] = []
    for i in range(20):
        schema = SCHEMAS[i % len(SCHEMAS)]
        if i % 2:
            body = {"messages": _chat(f"Item {i}"), "max_tokens": 80, "seed": i,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "s", "schema": schema}}}
            calls.append((schema, Call("/v1/chat/completions", body)))
        else:
            body = {"prompt": f"Record {i}:", "max_tokens": 80, "seed": i,
                    "structured_outputs": {"json": schema}} if i % 4 else \
                {"prompt": f"Record {i}:", "max_tokens": 80, "seed": i, "guided_json": schema}
            calls.append((schema, Call("/v1/completions", body)))
    async with trio.open_nursery() as nursery:  # all at once: they share batches
        for _, call in calls:
            nursery.start_soon(call.run, app)
    for schema, call in calls:
        assert call.status == 200, call.chunks
        choice = call.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        jsonschema.validate(json.loads(text), schema)
        assert choice["finish_reason"] == "stop", text  # the grammar ended it, not the budget


async def test_json_object_regex_and_choice(engine: AsyncEngine) -> None:
    app = app_for(engine)
    obj = await Call("/v1/chat/completions", {
        "messages": _chat(), "max_tokens": 60, "seed": 1,
        "response_format": {"type": "json_object"}}).run(app)
    assert obj.status == 200, obj.chunks
    choice = obj.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # an unbounded object may run out of tokens; what was made is still a prefix
        assert choice["message"]["content"].startswith("{")
    pattern = r"[A-Z][a-z]{1,5}-[0-9]{2}"
    for body, check in (
        ({"guided_regex": pattern}, lambda t: re.fullmatch(pattern, t)),
        ({"structured_outputs": {"regex": pattern}}, lambda t: re.fullmatch(pattern, t)),
        ({"guided_choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
        ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
        # min_tokens past the grammar's end: the grammar wins, EOS is still allowed.
        ({"guided_choice": ["ok"], "min_tokens": 6}, lambda t: t == "ok"),
        # Grammars: Lark (vLLM's structured_outputs.grammar) and GBNF (guided_grammar).
        ({"structured_outputs": {"grammar": 'start: "id-" /[0-9]{2}/'}},
         lambda t: re.fullmatch(r"id-[0-9]{2}", t)),
        ({"guided_grammar": 'root ::= ("yes" | "no") "!"'}, lambda t: t in ("yes!", "no!")),
        # response_format on completions too (vLLM's completions take it).
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMAS[1]}}},
         lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1]) is None),
    ):
        for seed in range(3):
            call = await Call("/v1/completions", {"prompt": "Answer:", "max_tokens": 24,
                                                  "seed": seed, **body}).run(app)
            assert call.status == 200, call.chunks
            choice = call.json()["choices"][0]
            assert check(choice["text"]), (body, choice["text"])
            assert choice["finish_reason"] == "stop"


async def test_streamed_constrained_output_and_n_children(engine: AsyncEngine) -> None:
    schema = SCHEMAS[0]
    call = await Call("/v1/chat/completions", {
        "messages": _chat(), "max_tokens": 80, "n": 3, "seed": 5, "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}).run(
            app_for(engine))
    assert call.status == 200, call.chunks
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for event in call.events()[:-1]:
        for c in json.loads(event)["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    assert sorted(texts) == [0, 1, 2]  # one matcher per child
    for i, text in texts.items():
        jsonschema.validate(json.loads(text), schema)
        assert finish[i] == "stop"


async def test_constrained_and_free_rows_in_one_batch(engine: AsyncEngine) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (alone,) = (await collect(engine, "alone", "The module", free)).outputs
    schema = SCHEMAS[1]
    constrained = SamplingParams(temperature=0.0, max_tokens=30,
                                 structured=StructuredOutput("json", json.dumps(schema)))
    results: dict[str, Any] = {}

    async def run(rid: str, params: SamplingParams) -> None:
        results[rid] = await collect(engine, rid, "The module", params)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "free", free)
        nursery.start_soon(run, "json", constrained)
    # The free row is untouched by its neighbour's mask: greedy, token for token.
    assert results["free"].outputs[0].token_ids == alone.token_ids
    jsonschema.validate(json.loads(results["json"].outputs[0].text), schema)


def test_masks_touch_only_constrained_rows(resources: Resources) -> None:
    backend = LLGuidanceBackend(resources.hf_tokenizer, resources.info.vocab_size,
                                resources.info.eos_token_ids)
    grammar = backend.grammar(StructuredOutput("choice", json.dumps(["yes", "no"])))
    logits = torch.randn(2, resources.info.vocab_size)
    before = logits.clone()
    apply_grammar_masks(logits, [grammar, None])
    assert torch.equal(logits[1], before[1])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    texts = {resources.hf_tokenizer.decode([t]) for t in allowed}
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    assert torch.equal(logits[0, allowed], before[0, allowed])
    # Several constrained rows are filled together (llguidance's threads): each row must
    # get exactly the mask it gets alone.
    other = backend.grammar(StructuredOutput("regex", "[0-9]+"))
    batch = torch.randn(3, resources.info.vocab_size)
    alone = [batch[i : i + 1].clone() for i in range(3)]
    apply_grammar_masks(batch, [grammar, None, other])
    apply_grammar_masks(alone[0], [grammar])
    apply_grammar_masks(alone[2], [other])
    for i in range(3):
        assert torch.equal(batch[i], alone[i][0])


def test_masks_filled_beside_the_forward_equal_the_synchronous_ones(
        resources: Resources) -> None:
    # The Worker's MaskFiller computes the masks in its thread while the forward runs:
    # the logits it leaves must be exactly those of the synchronous form, step after step
    # (the matchers advance between steps), for all-constrained and mixed batches.
    backend = LLGuidanceBackend(resources.hf_tokenizer, resources.info.vocab_size,
                                resources.info.eos_token_ids)
    vocab = resources.info.vocab_size
    specs = [StructuredOutput("json", json.dumps(SCHEMAS[i])) for i in (0, 3, 4)]
    threaded = [backend.grammar(spec) for spec in specs]
    synced = [backend.grammar(spec) for spec in specs]
    filler = MaskFiller(vocab, torch.device("cpu"))
    assert filler.start([None, None]) is None  # a free batch starts nothing
    # An accelerator's filler hands over the packed bits, unpacked where the logits are.
    packed = MaskFiller(vocab, torch.device("meta"))
    serial = MaskFiller(vocab, torch.device("cpu"))
    serial.overlap = False  # the benchmark's baseline: the same masks, no thread
    gen = torch.Generator().manual_seed(0)
    for step in range(12):
        logits = torch.randn(5, vocab, generator=gen)
        want = logits.clone()
        layout = [None, *threaded, None] if step % 2 else [*threaded, None, None]
        pending = (packed, filler, serial)[step % 3].start(layout)
        assert pending is not None
        pending.apply(logits)
        rows = [1, 2, 3] if step % 2 else [0, 1, 2]
        for j, row in enumerate(rows):  # each row alone, the synchronous way
            apply_grammar_masks(want[row : row + 1], [synced[j]])
        assert torch.equal(logits, want)
        free = [0, 4] if step % 2 else [3, 4]
        assert torch.isfinite(logits[free]).all()
        for j, row in enumerate(rows):
            token = int(logits[row].argmax())  # an allowed token: advance both alike
            threaded[j].accept(token)
            synced[j].accept(token)


def test_unpacking_on_the_device_equals_unpacking_in_numpy() -> None:
    # The accelerator path unpacks the bits with torch shifts, the CPU path with numpy;
    # both give 0 where a bit is set and -inf elsewhere, ids past the words banned.
    gen = torch.Generator().manual_seed(1)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 3), dtype=torch.int32, generator=gen)
    for vocab in (70, 96, 100):
        numpy_bias = _bias(bitmask, vocab, in_numpy=True)
        shift_bias = _bias(bitmask, vocab, in_numpy=False)
        assert torch.equal(numpy_bias, shift_bias)
        for r in range(4):
            for t in range(vocab):
                bit = t < 96 and (int(bitmask[r, t // 32]) >> (t % 32)) & 1
                assert numpy_bias[r, t] == (0.0 if bit else float("-inf")), (r, t)


async def test_preemption_mid_structure_replays_the_grammar() -> None:
    # 10 blocks of 16 tokens for 6 sequences that each grow to ~60: the Scheduler must
    # preempt some of them mid-object, and the Worker rebuilds their matchers from the
    # tokens they had made.
    config = EngineConfig(model=str(default_model_dir()), num_kv_blocks=10, max_model_len=160)
    small = Resources(config)
    schema = {"type": "object", "properties": {
        "items": {"type": "array", "items": _NAME, "minItems": 4, "maxItems": 4}},
        "required": ["items"], "additionalProperties": False}
    params = SamplingParams(max_tokens=120, seed=7, temperature=1.0,
                            structured=StructuredOutput("json", json.dumps(schema)))
    prompt = "A list of names from the standard library documentation, in JSON:" * 2
    results: dict[int, Any] = {}
    async with open_engine(config, resources=small) as eng:
        async def run(i: int) -> None:
            results[i] = await collect(eng, f"p{i}", prompt,
                                       SamplingParams(**{**_fields(params), "seed": i}))

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(run, i)
        stats = eng.frontend.stats
        assert await eng.wait_drained(30.0) == []
    assert stats is not None and stats.num_preemptions > 0, "the test must preempt"
    for res in results.values():
        assert res.error is None, res.error
        jsonschema.validate(json.loads(res.outputs[0].text), schema)


def _fields(params: SamplingParams) -> dict[str, Any]:
    import attrs

    return attrs.asdict(params, recurse=False)


async def test_stop_strings_and_aborts_end_constrained_sequences(engine: AsyncEngine) -> None:
    # A stop string inside the structure ends it there, with "stop"; an abort mid-structure
    # ends it too; either way the Worker drops the matcher with the rest (the fixture's
    # wait_drained checks that no sampling state is left).
    pattern = "[a-z]{4}-[0-9]{4}"
    stopped = await collect(engine, "stop", "Code:", SamplingParams(
        max_tokens=30, seed=1, stop=["-"],
        structured=StructuredOutput("regex", pattern)))
    assert stopped.error is None
    out = stopped.outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch("[a-z]{4}", out.text), out.text
    schema = {"type": "array", "items": _NAME, "minItems": 50}
    params = SamplingParams(max_tokens=200, seed=2, ignore_eos=True,
                            structured=StructuredOutput("json", json.dumps(schema)))
    got = 0
    async with aclosing(engine.generate(make_request("gone", "List:", params))) as stream:
        async for res in stream:
            got += sum(len(o.token_ids) for o in res.outputs)
            if got >= 5:
                break  # leaving the stream aborts the request mid-array
    assert got >= 5


async def test_python_api_refuses_a_bad_grammar(engine: AsyncEngine) -> None:
    bad = SamplingParams(structured=StructuredOutput("regex", "[a-", "structured_outputs"))
    res = await collect(engine, "bad", "x", bad)
    assert res.error is not None and "regex" in res.error


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: nope_undefined_rule"}}, "structured_outputs"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
])
async def test_bad_constraints_are_400_naming_the_field(engine: AsyncEngine,
                                                        body: dict[str, Any], param: str) -> None:
    for stream in (False, True):
        call = await Call("/v1/chat/completions", {"messages": _chat(), "max_tokens": 4,
                                                   "stream": stream, **body}).run(app_for(engine))
        assert call.status == 400, call.chunks
        assert call.json()["error"]["param"] == param, call.json()


_SCHEMA_IN = {
    "guided_json": '"guided_json": {"enum": [%s]}',
    "response_format": '"response_format": {"type": "json_schema", "json_schema": '
                       '{"name": "n", "schema": {"enum": [%s]}}}',
    "structured_outputs": '"structured_outputs": {"json": {"type": "object", '
                          '"properties": {"a": {"const": %s}}}}',
}


@pytest.mark.parametrize("param", sorted(_SCHEMA_IN))
@pytest.mark.parametrize(("number", "why"), [
    ("18446744073709551616", "is beyond +-(2**53 - 1)"),  # 2**64: llguidance refuses it
    ("9007199254740993", "is beyond +-(2**53 - 1)"),  # 2**53 + 1: it would write 2**53
    ("-9007199254740992", "is beyond +-(2**53 - 1)"),
    ("1e999", "is not finite"),  # JSON text that parses as infinity
    ("-1e999", "is not finite"),
])
async def test_a_schema_number_the_grammar_cannot_hold_is_400_naming_the_field(
        engine: AsyncEngine, param: str, number: str, why: str) -> None:
    raw = '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, %s}' % (
        _SCHEMA_IN[param] % number)
    call = Call("/v1/chat/completions", {})
    call.body = raw.encode()  # the number as written, not as Python would write it
    await call.run(app_for(engine))
    assert call.status == 400, call.chunks
    error = call.json()["error"]
    assert error["param"] == param and why in error["message"], error


async def test_the_largest_numbers_the_grammar_holds_are_accepted(engine: AsyncEngine) -> None:
    for number in (2**53 - 1, -(2**53 - 1), 2.5, -0.25):
        schema = {"type": "object", "properties": {"a": {"enum": [number]}},
                  "required": ["a"], "additionalProperties": False}
        params = SamplingParams(max_tokens=40, structured=StructuredOutput(
            "json", json.dumps(schema), "guided_json"))
        res = await collect(engine, f"n{number}", "x", params)
        assert res.error is None, res.error
        assert json.loads(res.outputs[0].text) == {"a": number}, res.outputs[0].text


async def test_python_api_refuses_a_schema_integer_beyond_2_53(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=4, structured=StructuredOutput(
        "json", '{"enum": [18446744073709551616]}', "structured_outputs"))
    res = await collect(engine, "big", "x", params)
    assert res.error is not None and "is beyond +-(2**53 - 1)" in res.error


def test_a_refused_token_raises_instead_of_going_on_unconstrained(
        resources: Resources) -> None:
    backend = LLGuidanceBackend(resources.hf_tokenizer, resources.info.vocab_size,
                                resources.info.eos_token_ids)
    grammar = backend.grammar(StructuredOutput("choice", json.dumps(["yes", "no"])))
    logits = torch.zeros(1, resources.info.vocab_size)
    apply_grammar_masks(logits, [grammar])
    refused = int(torch.isinf(logits[0]).nonzero()[0])  # one the mask forbids
    state = SamplingState(SamplingParams(max_tokens=4), [1, 2], grammar=grammar)
    with pytest.raises(GrammarRefused, match=rf"refused sampled token {refused}"):
        state.append(refused)


async def test_a_refused_token_fails_the_request_with_the_grammars_error(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    # A mask that lets everything through (as a masking bug would): the first token the
    # grammar refuses ends the request with that error, not with unconstrained text.
    monkeypatch.setattr(PendingMasks, "apply", lambda self, logits: None)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                            structured=StructuredOutput("regex", "q{16}", "guided_regex"))
    res = await collect(engine, "refused", "The json module", params)
    assert res.error is not None and "output constraint refused sampled token" in res.error


async def test_a_refused_token_fails_only_its_own_request(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    # The refusal is per row: a request batched with the refused one runs to its end.
    monkeypatch.setattr(PendingMasks, "apply", lambda self, logits: None)
    bad = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                         structured=StructuredOutput("regex", "q{16}", "guided_regex"))
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results: dict[str, Any] = {}

    async def one(rid: str, params: SamplingParams) -> None:
        results[rid] = await collect(engine, rid, "The json module", params)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "refused-alone", bad)
        nursery.start_soon(one, "unconstrained", free)
    assert results["refused-alone"].error is not None
    assert "output constraint refused sampled token" in results["refused-alone"].error
    assert results["unconstrained"].error is None
    assert len(results["unconstrained"].outputs[0].token_ids) == 16


# --- tools ----------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "n",
                                                                "schema": {"type": "object"}}}},
    {"guided_regex": "a+"},
])
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
async def test_a_forced_tool_choice_with_another_constraint_is_400(
        engine: AsyncEngine, choice: Any, constraint: dict[str, Any]) -> None:
    # Both would force the output, and only one grammar can: refused, not one ignored.
    call = await Call("/v1/chat/completions", {
        "messages": _chat(), "max_tokens": 4, "tools": [WEATHER, TIME], "tool_choice": choice,
        **constraint}).run(app_for(engine))
    assert call.status == 400, call.chunks
    error = call.json()["error"]
    assert error["param"] == "tool_choice" and "cannot be combined with" in error["message"]
    assert await engine.wait_drained(30.0) == []


def _reassemble(events: list[str]) -> Any:
    """The official client's own reassembly of a streamed chat completion."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    for event in events[:-1]:
        state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(event)))
    return state.get_final_completion()


def _check_call(call: Any) -> None:
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id and call.type == "function"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
async def test_forced_tool_calls_are_valid(engine: AsyncEngine, stream: bool,
                                           choice: Any) -> None:
    body = {"messages": _chat("Weather in Paris?"), "tools": [WEATHER, TIME],
            "tool_choice": choice, "max_tokens": 80, "seed": 3, "stream": stream,
            "parallel_tool_calls": False}
    call = await Call("/v1/chat/completions", body).run(app_for(engine))
    assert call.status == 200, call.chunks
    if stream:
        completion = _reassemble(call.events())
        message, finish = completion.choices[0].message, completion.choices[0].finish_reason
    else:
        from openai.types.chat import ChatCompletion

        completion = ChatCompletion.model_validate(call.json())
        message, finish = completion.choices[0].message, completion.choices[0].finish_reason
    assert finish == "tool_calls"
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    for tc in message.tool_calls:
        _check_call(tc)
    if isinstance(choice, dict):
        assert message.tool_calls[0].function.name == "get_time"


async def test_tool_results_go_back_into_the_conversation(engine: AsyncEngine) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
    ]
    app = app_for(engine)
    call = await Call("/v1/chat/completions", {"messages": messages, "tools": [WEATHER],
                                               "max_tokens": 4}).run(app)
    assert call.status == 200, call.chunks
    # The prompt is the template's, with the tools and the call and its result in it.
    convo = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "call_1", "type": "function", "function": {
                     "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    text = engine.tokenizer.apply_chat_template(convo, tools=[WEATHER], tokenize=False,
                                                add_generation_prompt=True)
    assert '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]' in text
    assert "sunny, 21" in text and "Weather in a city" in text
    ids = engine.tokenizer(text, add_special_tokens=False).input_ids
    assert call.json()["usage"]["prompt_tokens"] == len(ids)
    missing = await Call("/v1/chat/completions", {"messages": [
        *messages[:2], {"role": "tool", "content": "x"}], "max_tokens": 4}).run(app)
    assert missing.status == 400 and missing.json()["error"]["param"] == "messages[2].tool_call_id"


async def test_tokenize_renders_tools_like_the_chat_completion(engine: AsyncEngine) -> None:
    app = app_for(engine)
    messages = _chat("Weather in Paris?")
    plain = await Call("/tokenize", {"messages": messages}).run(app)
    with_tools = await Call("/tokenize", {"messages": messages, "tools": [WEATHER, TIME]}).run(app)
    assert plain.status == 200 and with_tools.status == 200, (plain.chunks, with_tools.chunks)
    assert with_tools.json()["count"] > plain.json()["count"]  # the tools are in the prompt
    chat = await Call("/v1/chat/completions", {"messages": messages, "tools": [WEATHER, TIME],
                                               "max_tokens": 1}).run(app)
    assert chat.status == 200, chat.chunks
    assert chat.json()["usage"]["prompt_tokens"] == with_tools.json()["count"]
    for body, param in (
        ({"prompt": "x", "tools": [WEATHER]}, "tools"),  # tools go with messages
        ({"messages": messages, "tools": [WEATHER, WEATHER]}, "tools"),
        ({"messages": messages, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"messages": messages, "chat_template": "{{ x }}"}, "chat_template"),
        ({"messages": messages, "tool_choice": "auto"}, "tool_choice"),
    ):
        call = await Call("/tokenize", body).run(app)
        assert call.status == 400, call.chunks
        assert call.json()["error"]["param"] == param, call.json()


def test_template_renders_tools_and_leaves_plain_chats_alone(resources: Resources) -> None:
    tok = resources.hf_tokenizer
    chat = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi\n"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    # The rule the model was trained on (scripts/train_default_model.py, MODEL_CARD.md).
    expected = "<|bos|>" + "".join(f"<|{m['role']}|>\n{m['content'].strip()}<|end|>\n"
                                   for m in chat) + "<|assistant|>\n"
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == expected
    with_tools = tok.apply_chat_template(chat, tools=[WEATHER], add_generation_prompt=True,
                                         tokenize=False)
    assert '"name": "get_weather"' in with_tools and with_tools.endswith(expected[7:])


# --- no silent ignores ----------------------------------------------------------------------

@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/completions", "suffix", "x"),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/chat/completions", "best_of", 1),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "audio", {"voice": "x", "format": "wav"}),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", "reasoning_effort", "low"),
    ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/chat/completions", "logits_processors", ["x"]),
    ("/v1/chat/completions", "allowed_token_ids", [1]),
    ("/v1/chat/completions", "bad_words", ["x"]),
    ("/v1/chat/completions", "length_penalty", 1.0),
    ("/v1/chat/completions", "chat_template", "{{ x }}"),
    ("/v1/chat/completions", "truncate_prompt_tokens", 0),  # (k >= 1 or -1 is honoured)
    ("/v1/chat/completions", "truncate_prompt_tokens", -2),
    ("/v1/chat/completions", "guided_decoding_backend", "xgrammar"),
    ("/v1/chat/completions", "guided_whitespace_pattern", " "),
    ("/v1/chat/completions", "chat_template_kwargs", {"x": 1}),
    ("/v1/completions", "length_penalty", 1.0),
    ("/v1/chat/completions", "store", True),
    ("/v1/chat/completions", "service_tier", "flex"),
    ("/v1/chat/completions", "modalities", ["audio"]),
    ("/v1/chat/completions", "verbosity", "low"),
])
async def test_unsupported_fields_are_400_naming_them(engine: AsyncEngine, path: str,
                                                       field: str, value: Any) -> None:
    base = {"messages": _chat()} if "chat" in path else {"prompt": "x"}
    call = await Call(path, {**base, "max_tokens": 2, field: value}).run(app_for(engine))
    assert call.status == 400, call.chunks
    param = call.json()["error"]["param"]
    assert param == field or param.startswith(f"{field}["), param


async def test_nested_unsupported_fields_are_400_too(engine: AsyncEngine) -> None:
    app = app_for(engine)
    for body, param in (
        ({"messages": [{"role": "user", "content": "x", "refusal": "no"}]},
         "messages[0].refusal"),
        ({"messages": _chat(), "stream": True, "stream_options": {"include_obfuscation": True}},
         "stream_options.include_obfuscation"),
        ({"messages": _chat(), "response_format": {"type": "json_schema",
                                                   "json_schema": {"schema": {}, "x": 1}}},
         "response_format.json_schema.x"),
        ({"messages": _chat(), "tool_choice": "required"}, "tool_choice"),
        # Fields the openai client puts in an assistant message: only null is accepted.
        ({"messages": [{"role": "assistant", "content": "x", "annotations": [{}]}]},
         "messages[0].annotations"),
        ({"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a"}}]},
         "messages[0].audio"),
        ({"messages": [{"role": "assistant", "content": "x",
                        "function_call": {"name": "f", "arguments": "{}"}}]},
         "messages[0].function_call"),
        ({"messages": _chat(), "tools": [WEATHER],
          "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ):
        call = await Call("/v1/chat/completions", {**body, "max_tokens": 2}).run(app)
        assert call.status == 400, call.chunks
        assert call.json()["error"]["param"] == param, call.json()


async def test_best_of_keeps_the_candidates_with_the_highest_cumulative_logprob(
        engine: AsyncEngine) -> None:
    app = app_for(engine)
    base = {"prompt": ["The module", "A list"], "max_tokens": 6, "temperature": 1.0,
            "seed": 4, "ignore_eos": True}
    # The same seeds make the same candidates (child i draws with seed + i).
    every = await Call("/v1/completions", {**base, "n": 3, "logprobs": 0}).run(app)
    best = await Call("/v1/completions", {**base, "n": 2, "best_of": 3}).run(app)
    assert every.status == 200 and best.status == 200, (every.chunks, best.chunks)
    candidates = every.json()["choices"]
    got = best.json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    for p in range(2):
        group = candidates[p * 3 : p * 3 + 3]
        ranked = sorted(group, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
        assert [c["text"] for c in got["choices"][p * 2 : p * 2 + 2]] == \
            [c["text"] for c in ranked[:2]]
    assert all(c["logprobs"] is None for c in got["choices"])  # not asked for
    assert got["usage"]["completion_tokens"] == 2 * 3 * 6  # every candidate was made
    for body in ({"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}):
        call = await Call("/v1/completions", {**base, **body}).run(app)
        assert call.status == 400 and call.json()["error"]["param"] == "best_of", call.chunks


async def test_labels_are_accepted(engine: AsyncEngine) -> None:
    call = await Call("/v1/chat/completions", {
        "messages": _chat(), "max_tokens": 2, "user": "u", "metadata": {"k": "v"},
        "safety_identifier": "s", "prompt_cache_key": "p", "store": False,
        "service_tier": "auto", "modalities": ["text"], "parallel_tool_calls": True,
        "response_format": {"type": "text"}, "tool_choice": "none"}).run(app_for(engine))
    assert call.status == 200, call.chunks
    assert ChatMessage("user", "x").extra == ""


async def test_grammar_crosses_processes() -> None:
    # topology "engine": the spec travels through the codec to the Worker's process,
    # which compiles its own matcher.
    config = EngineConfig(model=str(default_model_dir()), topology="engine", num_kv_blocks=64)
    params = SamplingParams(max_tokens=40, seed=2,
                            structured=StructuredOutput("json", json.dumps(SCHEMAS[1])))
    async with open_engine(config) as eng:
        res = await collect(eng, "x", "Colors:", params)
        assert await eng.wait_drained(30.0) == []
    assert res.error is None and res.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(res.outputs[0].text), SCHEMAS[1])
