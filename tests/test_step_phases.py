"""Host cost per step (issue 28): the step phase timers move on a real run, and the SSE
chunks the fast path renders (a per-response envelope, orjson for the choice) are the same
JSON as the standard library's rendering of the same chunk, key order included."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from helpers import Call, app_for
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples

from actorllm.engine.async_engine import AsyncEngine
from actorllm.metrics import PHASES
from actorllm.server import sse
from actorllm.server.logprobs import TokenTexts
from actorllm.server.render import ChatRenderer, CompletionRenderer
from actorllm.server.schemas import ChatCompletionRequest
from actorllm.server.tools import plan_tools
from actorllm.text.hf import load_hf_tokenizer
from actorllm.wire.messages import TokenLogprob
from actorllm.wire.outputs import CompletionOutput

# --- the timers ----------------------------------------------------------------------------


def phase_seconds(engine: AsyncEngine, phase: str) -> float:
    got = engine.metrics.registry.get_sample_value("actorllm:step_phase_seconds_total",
                                                   {"phase": phase})
    assert got is not None, phase
    return got


async def test_every_phase_of_a_step_is_timed(engine: AsyncEngine) -> None:
    """A streamed chat of two choices, through the in-process app: every phase's counter
    moves, and the sequence-steps count every row of every step."""
    app = app_for(engine)
    call = await Call("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "n": 2,
        "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 2}).run(app)
    assert call.status == 200 and call.events()[-1] == "[DONE]"
    engine.update_gauges()  # what a /metrics scrape does first
    stats = engine.frontend.stats
    for field in ("plan_s", "pack_s", "forward_s", "sample_s", "commit_s", "detokenize_s"):
        assert getattr(stats, field) > 0, field
    assert engine.frontend.route_s > 0
    for phase, _ in PHASES:
        assert phase_seconds(engine, phase) > 0, phase
    # The counters are the stats' totals, not something else.
    assert phase_seconds(engine, "plan") == pytest.approx(stats.plan_s)
    assert phase_seconds(engine, "detokenize") == pytest.approx(stats.detokenize_s)
    assert phase_seconds(engine, "route") == pytest.approx(engine.frontend.route_s)
    # Each choice: its prompt's step(s), then one row per later token.
    assert stats.seq_steps >= 2 * 12 and stats.steps >= 12
    assert engine.metrics.registry.get_sample_value(
        "actorllm:engine_sequence_steps_total") == stats.seq_steps
    assert engine.metrics.registry.get_sample_value(
        "actorllm:generation_tokens_total") == 2 * 12


# --- the SSE rendering -------------------------------------------------------------------


def old_event(payload: dict[str, Any]) -> bytes:
    """An SSE event as the server rendered it before orjson: the standard library's."""
    return b"data: " + json.dumps(payload, separators=(",", ":"),
                                  ensure_ascii=False).encode("utf-8") + b"\n\n"


def parsed(event: bytes) -> Any:
    """An event's JSON with every object as its (key, value) pairs in order (tool call
    ids, random per response, made alike)."""
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    body = re.sub(rb'"call_[0-9a-f]+"', b'"call_"', event[6:-2])
    return json.loads(body, object_pairs_hook=lambda pairs: pairs)


class Job:
    def __init__(self, index_base: int = 0, echo: str = "") -> None:
        self.index_base, self.echo, self.echo_skips_special = index_base, echo, True


@pytest.fixture(scope="module")
def texts(tokenizer_dir: Any) -> TokenTexts:
    return TokenTexts(load_hf_tokenizer(tokenizer_dir))


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}}]
HERMES = ['Let me look. <tool', '_call>{"name": "f", ', '"arguments": {"x": 1}}</tool_call>']

texts_st = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
ids_st = st.lists(st.integers(0, 399), min_size=0, max_size=3)
lp_st = st.floats(-30.0, 0.0, allow_nan=False)


@st.composite
def outputs(draw: Any, n: int) -> list[CompletionOutput]:
    """A stream of outputs for choices 0..n-1, each ending once, the last with a reason."""
    outs: list[CompletionOutput] = []
    for index in range(n):
        for k in range(draw(st.integers(1, 4))):
            ids = tuple(draw(ids_st))
            tops = st.lists(st.tuples(st.integers(0, 399), lp_st), max_size=2)
            lps = tuple(TokenLogprob(t, draw(lp_st), tuple(draw(tops))) for t in ids)
            last = k == 3 or draw(st.booleans())
            outs.append(CompletionOutput(
                index, draw(texts_st), ids, lps,
                finish_reason=draw(st.sampled_from(["stop", "length"])) if last else None,
                stop_reason=draw(st.sampled_from([None, "\n", 7])) if last else None))
            if last:
                break
    return outs


def check_same(render: Any, job: Job, outs: list[CompletionOutput], **kw: Any) -> int:
    """Feed ``outs`` to two renderers alike: the fast event of one must be the JSON of the
    other's chunk dict, in order. Returns the events compared."""
    fast, slow = render(**kw), render(**kw)
    compared = 0
    for out in outs:
        event, chunk = fast.add_event(job, out), slow.add(job, out)
        assert (event is None) == (chunk is None)
        if event is not None:
            assert parsed(event) == parsed(old_event(chunk))
            compared += 1
    for a, b in zip(fast.prelude([]), slow.prelude([]), strict=True):
        assert parsed(sse.event(a)) == parsed(old_event(b))
    return compared


def common(texts: TokenTexts, n: int, logprobs: bool) -> dict[str, Any]:
    return {"response_id": "chatcmpl-é\"x", "created": 1700000000, "model": "m/ü", "texts": texts,
            "num_choices": n, "logprobs": logprobs}


@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(1, 3), logprobs=st.booleans(), data=st.data())
def test_chat_chunks_are_the_same_json(texts: TokenTexts, n: int, logprobs: bool,
                                       data: st.DataObject) -> None:
    outs = data.draw(outputs(n))
    check_same(ChatRenderer, Job(), outs, **common(texts, n, logprobs))


@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(1, 3), logprobs=st.booleans(), echo=st.sampled_from(["", "Hi ☃"]),
       data=st.data())
def test_completion_chunks_are_the_same_json(texts: TokenTexts, n: int, logprobs: bool,
                                             echo: str, data: st.DataObject) -> None:
    outs = data.draw(outputs(n))
    check_same(CompletionRenderer, Job(echo=echo), outs, **common(texts, n, logprobs))


def test_tool_call_chunks_are_the_same_json(texts: TokenTexts) -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    plan = plan_tools(body, "hermes")
    outs = [CompletionOutput(0, piece, (1,), finish_reason="stop" if i == 2 else None)
            for i, piece in enumerate(HERMES)]
    compared = check_same(ChatRenderer, Job(), outs, tools=plan, **common(texts, 1, False))
    assert compared >= 2  # the content before the call, and the call


def test_a_job_of_a_later_prompt_keeps_its_choice_index(texts: TokenTexts) -> None:
    """Completions with several prompts: a job's choices are index_base + i."""
    outs = [CompletionOutput(1, "a", (5,)), CompletionOutput(1, "", (), finish_reason="stop")]
    kw = common(texts, 4, True)
    assert check_same(CompletionRenderer, Job(index_base=2, echo="p"), outs, **kw) == 2
    event = CompletionRenderer(**kw).add_event(Job(index_base=2), outs[0])
    assert event is not None and json.loads(event[6:-2])["choices"][0]["index"] == 3


def test_what_orjson_refuses_goes_the_standard_way() -> None:
    """Non-string keys (the standard library writes them as strings)."""
    assert json.loads(sse.dumps({1: [2.5, None]})) == {"1": [2.5, None]}
    assert sse.dumps({"a": "ü"}) == '{"a":"ü"}'.encode()
