"""Prompt logprobs (issue 18): each prompt position's logprob, reported exactly once.

The Scheduler part is driven by hand with a Worker that reports what it is asked for;
the Worker part and the engine end to end are checked against transformers'
``log_softmax`` of the model's logits at every prompt position (fp32, within 1e-4),
with and without chunked prefill and preemption.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from helpers import hf_model
from steps import Plans, execute

from actorllm.config import EngineConfig
from actorllm.engine.async_engine import AsyncEngine, Resources, open_engine
from actorllm.llm import GenerationResult, collect
from actorllm.scheduler import actor as scheduler_module
from actorllm.scheduler.actor import Scheduler
from actorllm.scheduler.batch import Batch
from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import (
    InvalidRequest,
    NewSeqData,
    PromptLogprobs,
    SampledToken,
    SamplingParams,
    ScheduledSeq,
    SchedulerInput,
    SequenceRequest,
    StepPlan,
    StepResult,
    TokenBatch,
    TokenLogprob,
)
from actorllm.worker.runner import ModelRunner
from actorllm.worker.sampler import SamplingState, prompt_logprobs

EOS = 1


# --- the Scheduler: which positions it asks for, and that each is reported once ---------


class ReportingWorker:
    """Plays the Worker: reports exactly the positions a plan asks for, as -position."""

    def __init__(self, overlap: int = 0) -> None:
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.overlap = overlap  # report this many positions before the first one asked

    def answer(self, plan: StepPlan) -> StepResult:
        tokens, reports = [], []
        for s in plan.seqs:
            if s.new is not None:
                self.prompts[s.rid] = s.new.prompt_token_ids
            if s.prompt_logprobs_from is not None:
                prompt = self.prompts[s.rid]
                lo = max(s.prompt_logprobs_from - self.overlap, s.start_pos + 1)
                hi = min(s.start_pos + len(s.token_ids), len(prompt) - 1)
                assert lo <= hi, "asked for positions this chunk does not predict"
                reports.append(PromptLogprobs(s.rid, lo, tuple(
                    TokenLogprob(prompt[p], -float(p)) for p in range(lo, hi + 1))))
            if s.sample:
                tokens.append(SampledToken(s.rid, 7))
        return StepResult.of_tokens(plan, tokens, prompt_logprobs=tuple(reports))


def scheduler(num_blocks: int, budget: int, caching: bool = True) -> Scheduler:
    return Scheduler(Mailbox("s", SchedulerInput, 8), Mailbox("w", StepPlan, 2),
                     Mailbox("d", TokenBatch, 8), num_blocks=num_blocks, block_size=4,
                     max_num_seqs=8, max_num_batched_tokens=budget,
                     enable_prefix_caching=caching)


def seq_request(rid: str, prompt_len: int, max_tokens: int, **params: Any) -> SequenceRequest:
    return SequenceRequest(rid, tuple(range(10, 10 + prompt_len)),
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                           max_tokens, (EOS,))


def drive(s: Scheduler, worker: ReportingWorker
          ) -> tuple[dict[str, list[Any]], list[StepPlan], list[tuple[str, str, tuple[int, ...]]]]:
    """Run to the end: each rid's prompt logprob entries in arrival order, the plans, and
    the finishes (rid, reason, the tokens that came with it)."""
    reported: dict[str, list[Any]] = {}
    plans, finishes = [], []
    for _ in range(300):
        plan = s.schedule()
        if plan is None:
            break
        plans.append(plan)
        s.handle(worker.answer(plan))
        batch = s.take_batch()
        for out in batch.outputs if batch else ():
            if out.prompt_logprobs:
                assert out.prompt_token_ids or reported.get(out.rid), "ids come first"
                reported.setdefault(out.rid, []).extend(out.prompt_logprobs)
            if out.finish_reason:
                finishes.append((out.rid, out.finish_reason, out.token_ids))
    assert not s.drain_problems()
    return reported, plans, finishes


@pytest.mark.parametrize(("budget", "overlap"), [(4, 0), (5, 0), (5, 3)])
def test_each_prompt_position_is_reported_once_across_chunks_and_preemption(
        budget: int, overlap: int) -> None:
    # 5 blocks of 4 tokens, a small budget: "b" (a 14-token prompt) is prefilled in
    # chunks while "a" decodes, runs out of blocks and is preempted in the middle of its
    # prefill (more than once). With `overlap`, the Worker re-reports positions it was
    # not asked for (a recompute chunk reaching past the last reported position): the
    # Scheduler must still pass each position on once.
    # Without the prefix cache a recompute starts at 0 (test_prefix_cache.py has it on).
    s = scheduler(num_blocks=5, budget=budget, caching=False)
    s.handle(seq_request("a", 4, 14))
    s.handle(seq_request("b", 14, 3, prompt_logprobs=2))
    reported, plans, _ = drive(s, ReportingWorker(overlap))
    b_plans = [x for p in plans for x in p.seqs if x.rid == "b"]
    restarts = [i for i, x in enumerate(b_plans) if i and x.start_pos == 0]
    mid = [i for i in restarts if b_plans[i - 1].start_pos + len(b_plans[i - 1].token_ids) < 14]
    assert mid, "b must be preempted in the middle of its prefill"
    assert b_plans[mid[0]].prompt_logprobs_from is None, \
        "the recompute does not ask again for positions already reported"
    if overlap:
        assert any(x.prompt_logprobs_from is not None and x.prompt_logprobs_from > x.start_pos + 1
                   for x in b_plans), "a recompute chunk must start before what it owes"
    entries = reported["b"]
    assert entries[0] is None
    assert [(e.token_id, e.logprob) for e in entries[1:]] == [(10 + p, -float(p))
                                                               for p in range(1, 14)]
    assert "a" not in reported  # it did not ask


def test_max_tokens_zero_runs_the_prefill_and_finishes_with_length() -> None:
    s = scheduler(num_blocks=16, budget=4)
    s.handle(seq_request("z", 10, 0, prompt_logprobs=0))
    s.handle(seq_request("one", 1, 0, prompt_logprobs=0))  # a 1-token prompt: just None
    reported, plans, finishes = drive(s, ReportingWorker())
    z = [x for p in plans for x in p.seqs if x.rid == "z"]
    assert [x.start_pos for x in z] == [0, 4, 8] and not any(x.sample for x in z)
    assert sorted(finishes) == [("one", "length", ()), ("z", "length", ())]
    assert len(reported["z"]) == 10 and reported["one"] == [None]


def test_prefix_cache_rule_keeps_owed_positions_computed() -> None:
    seq = scheduler_module.Sequence("r", list(range(10)), SamplingParams(prompt_logprobs=1),
                                    4, frozenset())
    assert seq.skippable_prefix() == 0  # nothing reported: every row must run
    seq.prompt_lps_next = 6  # positions 0..5 reported; the row of position 5 scores 6
    assert seq.skippable_prefix() == 5
    seq.prompt_lps_next = 10
    assert seq.skippable_prefix() == seq.num_tokens  # all reported: a cache may serve all
    plain = scheduler_module.Sequence("p", list(range(10)), SamplingParams(), 4, frozenset())
    assert plain.skippable_prefix() == 10


def test_sampling_params_validation() -> None:
    SamplingParams(max_tokens=0, prompt_logprobs=0).validate()
    for bad in (-1, 21):
        with pytest.raises(InvalidRequest) as err:
            SamplingParams(prompt_logprobs=bad).validate()
        assert err.value.param == "prompt_logprobs"
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(max_tokens=-1).validate()
    assert err.value.param == "max_tokens"


# --- the Worker: the positions asked for, from the rows that ask ----------------------


def hf_prompt_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' ``log_softmax`` of the logits at every position, ``[len(ids), vocab]``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_against(entries: Any, ids: list[int], ref: torch.Tensor, k: int,
                  first: int = 1) -> None:
    """``entries`` score prompt positions ``first, first + 1, ...`` like ``ref`` does."""
    for pos, e in enumerate(entries, start=first):
        assert e.token_id == ids[pos]
        assert e.logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4), pos
        top = ref[pos - 1].topk(k)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_dir, num_blocks=64, block_size=4)


def test_runner_reports_the_prompt_positions_each_chunk_asks_for(
        runner: ModelRunner, tiny_llama_dir: Path) -> None:
    ids = [0, *range(20, 43)]  # 24 tokens
    ref = hf_prompt_logprobs(hf_model(tiny_llama_dir), ids)
    params = SamplingParams(temperature=0.0, prompt_logprobs=3)
    table = tuple(range(7))
    new = NewSeqData(params, tuple(ids))
    # Chunked: [0, 10) scores positions 1..10, [10, 24) scores 11..23 and samples.
    plans = Plans()
    first = execute(runner, 1, (ScheduledSeq("a", tuple(ids[:10]), 0, table, False,
                                             new, prompt_logprobs_from=1),), plans=plans)
    second = execute(runner, 2, (ScheduledSeq("a", tuple(ids[10:]), 10, table, True,
                                              None, prompt_logprobs_from=11),), plans=plans)
    assert first.error is None and second.error is None
    (p1,), (p2,) = first.prompt_logprobs, second.prompt_logprobs
    assert (p1.rid, p1.start, len(p1.logprobs)) == ("a", 1, 10)
    assert (p2.start, len(p2.logprobs)) == (11, 13) and len(second.tokens) == 1
    check_against(p1.logprobs + p2.logprobs, ids, ref, 3)
    # A recompute after preemption that owes positions from 15 on: only those come back.
    out = second.tokens[0].token_id
    again = execute(runner, 3, (ScheduledSeq("a", (*ids, out), 0, table, True,
                                             NewSeqData(params, tuple(ids), (out,)),
                                             prompt_logprobs_from=15),),
                    drop=("a",), plans=plans)
    (p3,) = again.prompt_logprobs
    assert p3.start == 15 and len(p3.logprobs) == 9
    check_against(p3.logprobs, ids, ref, 3, first=15)
    runner.execute(StepPlan(4, drop=("a",)))
    assert runner.num_states == 0


def test_only_the_rows_that_ask_go_through_the_lm_head() -> None:
    torch.manual_seed(0)
    head = torch.randn(8, 50)
    rows_seen: list[int] = []

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        rows_seen.append(hidden.shape[0])
        return hidden @ head

    hidden = torch.randn(16, 8)
    asks = ScheduledSeq("ask", tuple(range(6)), 0, (0,), False, prompt_logprobs_from=1)
    quiet = ScheduledSeq("quiet", tuple(range(10)), 0, (1,), True)
    states = {"ask": SamplingState(SamplingParams(prompt_logprobs=2), range(12)),
              "quiet": SamplingState(SamplingParams(), range(10))}
    (got,) = prompt_logprobs(hidden, (quiet, asks), states, compute_logits)
    assert rows_seen == [6]  # rows 10..15 (the asking seq's); none of quiet's 10
    ref = torch.log_softmax(hidden[10:16] @ head, dim=-1)
    assert got.rid == "ask" and got.start == 1
    for j, e in enumerate(got.logprobs):
        assert e.token_id == j + 1
        assert e.logprob == pytest.approx(ref[j, j + 1].item(), abs=1e-5)
        assert [t for t, _ in e.top] == ref[j].topk(2).indices.tolist()
    rows_seen.clear()
    assert prompt_logprobs(hidden, (quiet,), states, compute_logits) == ()
    assert rows_seen == []


# --- the engine end to end, against transformers -----------------------------------------

PROMPTS = [
    "the quick brown fox jumps over the lazy dog and then some more words " * 2,
    "once upon a time, in a land far away, there lived a very patient engineer who wrote tests",
    "numbers 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18",
    "hello there",
    "a",
]

_resources: dict[tuple[str, int], Resources] = {}


@asynccontextmanager
async def engine_for(model: Path, num_kv_blocks: int, budget: int) -> AsyncIterator[AsyncEngine]:
    config = EngineConfig(model=str(model), num_kv_blocks=num_kv_blocks, block_size=4,
                          max_model_len=128, max_num_batched_tokens=budget)
    key = (str(model), num_kv_blocks)
    if key not in _resources:
        _resources[key] = Resources(config)
    async with open_engine(config, resources=_resources[key]) as engine:
        yield engine
        assert await engine.wait_drained() == []


async def run_all(engine: AsyncEngine, prompts: list[str],
                  params: list[SamplingParams]) -> list[GenerationResult]:
    results: list[GenerationResult | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        results[i] = await collect(engine, f"pl-{i}", prompts[i], params[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return [r for r in results if r is not None]


@pytest.mark.parametrize(("num_kv_blocks", "budget", "squeezed"),
                         [(256, 2048, False), (40, 16, True)],
                         ids=["whole-prefill", "chunked-and-preempted"])
async def test_prompt_logprobs_equal_transformers(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, num_kv_blocks: int,
        budget: int, squeezed: bool) -> None:
    # Which sequences were preempted while they still owed prompt logprobs (observed,
    # not changed: the real preempt runs).
    owed_at_preemption: list[int] = []
    real_preempt = Batch.preempt

    def watch(self: Batch, seq: scheduler_module.Sequence) -> None:
        if seq.owes_prompt_logprobs and seq.prompt_lps_next > 1:
            owed_at_preemption.append(seq.prompt_lps_next)
        real_preempt(self, seq)

    monkeypatch.setattr(Batch, "preempt", watch)
    k = 3
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             prompt_logprobs=k, logprobs=1)] * 3
    params += [SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=k),  # score only
               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]  # no asking
    async with engine_for(tiny_llama_dir, num_kv_blocks, budget) as engine:
        results = await run_all(engine, PROMPTS, params)
        tokenizer = engine.tokenizer
        stats = engine.frontend.stats
    if squeezed:
        assert stats.num_preemptions > 0 and owed_at_preemption, \
            "a sequence must be preempted in the middle of its prompt logprobs"
        assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > budget
    hf = hf_model(tiny_llama_dir)
    for prompt, p, res in zip(PROMPTS, params, results, strict=True):
        ids = tokenizer(prompt).input_ids
        (out,) = res.outputs
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs == () and out.prompt_token_ids == tuple(ids)
            continue
        assert list(out.prompt_token_ids) == ids
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        check_against(out.prompt_logprobs[1:], ids, hf_prompt_logprobs(hf, ids), k)
        assert out.finish_reason == "length"
        assert len(out.token_ids) == p.max_tokens


# --- the HTTP layer, in process: echo + logprobs, vLLM's prompt_logprobs, validation ---


async def post(engine: AsyncEngine, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    from helpers import Call, app_for

    call = await Call(path, body).run(app_for(engine))
    if body.get("stream") and call.status == 200:
        return call.status or 0, call.events()
    return call.status or 0, call.json()


def check_echo(lp: dict[str, Any], text: str, ids: list[int], ref: torch.Tensor,
               tokenizer: Any, skip_special: bool) -> None:
    """The echoed prompt's part of a legacy ``logprobs``, against transformers."""
    n = len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, n):
        assert lp["token_logprobs"][pos] == pytest.approx(ref[pos - 1, ids[pos]].item(),
                                                          abs=1e-4)
        # logprobs: 1 -> the best alternative, plus the prompt's own token.
        best = int(ref[pos - 1].argmax())
        top = lp["top_logprobs"][pos]
        assert top[_piece(tokenizer, best)] == pytest.approx(ref[pos - 1, best].item(),
                                                             abs=1e-4)
        assert len(top) == (1 if best == ids[pos] else 2)
    for pos in range(n):
        # Where token `pos` begins in the echoed text: the length of the text before it.
        before = tokenizer.decode(ids[:pos], skip_special_tokens=skip_special)
        assert text.startswith(before)
        assert lp["text_offset"][pos] == len(before), pos
        assert lp["tokens"][pos] == _piece(tokenizer, ids[pos])


def _piece(tokenizer: Any, tid: int) -> str:
    """A token's text the way the server shows it: its bytes, decoded on their own."""
    from actorllm.server.logprobs import TokenTexts

    return TokenTexts(tokenizer).get(tid)[0]


@pytest.fixture
async def engine(tiny_llama_dir: Path) -> AsyncIterator[AsyncEngine]:
    async with engine_for(tiny_llama_dir, num_kv_blocks=256, budget=8) as eng:  # chunked
        yield eng


async def test_completions_echo_with_logprobs(engine: AsyncEngine, tiny_llama_dir: Path) -> None:
    tokenizer = engine.tokenizer
    hf = hf_model(tiny_llama_dir)
    text_prompt = "The river runs past the old mill"
    id_prompt = [0, *range(40, 52)]
    for prompt in (text_prompt, id_prompt):
        status, resp = await post(engine, "/v1/completions", {
            "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3,
            "temperature": 0, "ignore_eos": True})
        assert status == 200, resp
        (choice,) = resp["choices"]
        skip = isinstance(prompt, str)
        ids = tokenizer(prompt).input_ids if skip else prompt
        echo = prompt if skip else tokenizer.decode(ids, skip_special_tokens=False)
        lp = choice["logprobs"]
        assert choice["text"].startswith(echo)
        assert len(lp["tokens"]) == len(ids) + 3
        check_echo(lp, choice["text"], ids, hf_prompt_logprobs(hf, ids), tokenizer, skip)
        assert lp["text_offset"][len(ids)] == len(echo)  # the completion follows the echo
        assert all(v is not None for v in lp["token_logprobs"][len(ids):])
        # A request that owes prompt logprobs computes its whole prompt: nothing cached.
        assert resp["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 3,
                                 "total_tokens": len(ids) + 3,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    status, resp = await post(engine, "/v1/completions", {
        "prompt": text_prompt, "echo": True, "logprobs": 1, "max_tokens": 3,
        "temperature": 0, "ignore_eos": True})

    # max_tokens 0: the prompt's scores only (what a scoring client asks for).
    status, zero = await post(engine, "/v1/completions", {
        "prompt": text_prompt, "echo": True, "logprobs": 1, "max_tokens": 0,
        "temperature": 0})
    assert status == 200, zero
    (choice,) = zero["choices"]
    assert choice["text"] == text_prompt and choice["finish_reason"] == "length"
    n = len(tokenizer(text_prompt).input_ids)
    assert choice["logprobs"] == {k: v[:n] for k, v in resp["choices"][0]["logprobs"].items()}
    assert zero["usage"]["completion_tokens"] == 0

    # Streamed: the same lists, split over the chunks.
    status, events = await post(engine, "/v1/completions", {
        "prompt": text_prompt, "echo": True, "logprobs": 1, "max_tokens": 3,
        "temperature": 0, "ignore_eos": True, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    merged = {k: [x for c in chunks if c["logprobs"] for x in c["logprobs"][k]]
              for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert merged == resp["choices"][0]["logprobs"]
    assert "".join(c["text"] for c in chunks) == resp["choices"][0]["text"]


async def test_vllm_prompt_logprobs_parameter(engine: AsyncEngine, tiny_llama_dir: Path) -> None:
    tokenizer = engine.tokenizer
    hf = hf_model(tiny_llama_dir)
    prompt = "Hello! How are you today?"
    ids = tokenizer(prompt).input_ids
    ref = hf_prompt_logprobs(hf, ids)
    status, resp = await post(engine, "/v1/completions", {
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2})
    assert status == 200, resp
    (choice,) = resp["choices"]
    assert choice["logprobs"] is None and choice["text"] != ""  # no echo: no prompt text
    field = choice["prompt_logprobs"]
    assert len(field) == len(ids) and field[0] is None
    for pos in range(1, len(ids)):
        entry = field[pos]
        assert entry[str(ids[pos])]["logprob"] == pytest.approx(ref[pos - 1, ids[pos]].item(),
                                                                abs=1e-4)
        top2 = ref[pos - 1].topk(2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in top2] == [1, 2]
        assert set(entry) == {str(ids[pos]), *map(str, top2)}

    # Chat: OpenAI's answer has no prompt logprobs; vLLM's parameter asks for them.
    messages = [{"role": "user", "content": prompt}]
    status, plain = await post(engine, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 1, "temperature": 0})
    assert status == 200 and "prompt_logprobs" not in plain
    status, asked = await post(engine, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
    assert status == 200, asked
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    chat_ref = hf_prompt_logprobs(hf, chat_ids)
    field = asked["prompt_logprobs"]
    assert len(field) == len(chat_ids) and field[0] is None
    for pos in range(1, len(chat_ids)):
        assert list(field[pos]) == [str(chat_ids[pos])]
        assert field[pos][str(chat_ids[pos])]["logprob"] == pytest.approx(
            chat_ref[pos - 1, chat_ids[pos]].item(), abs=1e-4)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
async def test_prompt_logprob_requests_that_are_400(engine: AsyncEngine, path: str,
                                                    body: dict[str, Any], param: str) -> None:
    status, resp = await post(engine, path, body)
    assert status == 400, resp
    assert resp["error"]["param"] == param


def test_prompt_logprobs_cross_process_boundaries(tiny_llama_dir: Path) -> None:
    # `pipeline`: Scheduler + Worker in one child process, the Detokenizer in another, so
    # the pieces cross two sockets (TokenOut, then TextDelta) through the codec.
    from actorllm.llm import LLM

    llm = LLM(model=str(tiny_llama_dir), topology="pipeline", num_kv_blocks=64, block_size=4,
              max_model_len=128, max_num_batched_tokens=8)
    prompt = "The baker opens at six and makes bread"
    (res,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=0,
                                                   prompt_logprobs=2))
    assert res.error is None
    (out,) = res.outputs
    ids = llm.tokenizer(prompt).input_ids
    assert out.token_ids == () and out.finish_reason == "length"
    assert list(out.prompt_token_ids) == ids and out.prompt_logprobs[0] is None
    check_against(out.prompt_logprobs[1:], ids, hf_prompt_logprobs(hf_model(tiny_llama_dir),
                                                                   ids), 2)


def test_a_gap_in_the_workers_report_fails_only_that_request() -> None:
    s = scheduler(num_blocks=16, budget=4)
    s.handle(seq_request("gap", 10, 2, prompt_logprobs=0))
    s.handle(seq_request("fine", 3, 2))
    plan = s.schedule()
    assert plan is not None
    # The Worker skips position 1 of "gap" (it reports 2..4 where 1..4 was asked for).
    bad = PromptLogprobs("gap", 2, tuple(TokenLogprob(10 + p, -1.0) for p in range(2, 5)))
    s.handle(StepResult.of_tokens(plan, (SampledToken("fine", 7),), prompt_logprobs=(bad,)))
    batch = s.take_batch()
    assert batch is not None
    ends = {o.rid: (o.finish_reason, o.error) for o in batch.outputs if o.finish_reason}
    assert ends["gap"][0] == "error" and "position 2, expected 1" in ends["gap"][1]
    assert "gap" not in s.seqs and "fine" in s.seqs
