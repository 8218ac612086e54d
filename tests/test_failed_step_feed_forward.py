"""The real ModelRunner under overlap scheduling when a step fails (issue 33).

With two steps in flight, step N+1 is planned before step N's result is back: its row for
a decoding sequence says ``FEED_LAST_SAMPLE`` (the token step N samples). If step N fails,
it sampled nothing: the runner must feed a stand-in (it would otherwise refuse the step,
failing every other sequence in it), and the Scheduler, which has failed the sequence on
step N's error, must drop what step N+1 made for it and free its blocks only once step
N+1 is back. The simulation's scripted Worker mimics this; here the real runner and the
real Scheduler go through it, and a request run afterwards on the same cache still equals
Hugging Face ``generate`` token for token (the stand-in's K/V harmed nobody).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actorllm.config import read_model_info
from actorllm.scheduler.actor import Scheduler
from actorllm.wire.mailbox import Mailbox
from actorllm.wire.messages import (
    FEED_LAST_SAMPLE,
    SamplingParams,
    SchedulerInput,
    SequenceRequest,
    StepPlan,
    StepResult,
    TokenBatch,
)
from actorllm.worker.runner import ModelRunner

BLOCK = 4
PROMPT = tuple(range(10, 17))  # 7 tokens: the decode rows write into a block of their own
MAX_TOKENS = 6


def scheduler(num_blocks: int) -> Scheduler:
    return Scheduler(Mailbox("s", SchedulerInput, 8), Mailbox("w", StepPlan, 2),
                     Mailbox("d", TokenBatch, 8), num_blocks=num_blocks, block_size=BLOCK,
                     max_num_seqs=4, max_num_batched_tokens=64,
                     max_steps_in_flight=2)  # type: ignore[arg-type]


def request(rid: str, eos: tuple[int, ...]) -> SequenceRequest:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return SequenceRequest(rid, PROMPT, params, MAX_TOKENS, eos)


def outputs(batch: TokenBatch | None, rid: str) -> tuple[list[int], list[Any]]:
    """(token ids, finish entries) the batch carries for ``rid``."""
    if batch is None:
        return [], []
    ids = [t for o in batch.outputs if o.rid == rid for t in o.token_ids]
    return ids, [o for o in batch.outputs if o.rid == rid and o.finish_reason is not None]


def test_a_step_planned_ahead_of_a_failed_one_feeds_a_stand_in(
        tiny_llama_dir: Path, hf_greedy_fn: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    num_blocks = 16
    runner = ModelRunner(tiny_llama_dir, num_blocks=num_blocks, block_size=BLOCK)
    eos = read_model_info(tiny_llama_dir).eos_token_ids
    s = scheduler(num_blocks)
    s.handle(request("a", eos))

    first = s.schedule()  # the prefill, which samples a's first token
    assert first is not None
    r0 = runner.execute(first)
    assert r0.error is None and [t.rid for t in r0.sampled(first)] == ["a"]
    s.handle(r0)
    committed, _ = outputs(s.take_batch(), "a")
    assert committed == [r0.sampled(first)[0].token_id]

    step_n = s.schedule()  # decodes the first token
    ahead = s.schedule()  # planned before step N is back: feeds N's sample forward
    assert step_n is not None and ahead is not None
    assert [q.token_ids for q in step_n.seqs] == [(r0.sampled(first)[0].token_id,)]
    assert [q.token_ids for q in ahead.seqs] == [(FEED_LAST_SAMPLE,)]

    # Step N fails after its forward pass (its K/V written, nothing sampled). Not in
    # compute_logits: a decode step may make its logits and tokens inside the one op.
    sample = runner._sample

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected: the step failed after its forward")

    monkeypatch.setattr(runner, "_sample", broken)
    failed = runner.execute(step_n)
    monkeypatch.setattr(runner, "_sample", sample)
    assert failed.error is not None and "injected" in failed.error

    fed: list[tuple[str, int, int]] = []
    last_sample = runner._last_sample

    def spy(rid: str, position: int) -> int:
        token = last_sample(rid, position)
        fed.append((rid, position, token))
        return token

    monkeypatch.setattr(runner, "_last_sample", spy)
    fed_before = runner.fed_forward
    later = runner.execute(ahead)
    # The stand-in, not a refusal: without it the runner finds its last sample one
    # position short and fails the step (and with it every other row in it).
    assert later.error is None, later.error
    assert fed == [("a", len(PROMPT) + 1, 0)]
    assert runner.fed_forward == fed_before  # (a stand-in is not a token fed forward)
    assert [t.rid for t in later.sampled(ahead)] == ["a"]  # it sampled something from the stand-in

    # The Scheduler fails "a" on step N's error and keeps its blocks for the step ahead...
    s.handle(failed)
    ids, finished = outputs(batch := s.take_batch(), "a")
    assert ids == [] and [f.finish_reason for f in finished] == ["error"]
    assert "a" not in (batch.freed if batch is not None else ())
    assert s.pool.refs, "a's blocks went back while the step ahead still reads them"
    # ...then drops what that step made for it, and frees it.
    s.handle(later)
    ids, finished = outputs(batch := s.take_batch(), "a")
    assert ids == [] and finished == []
    assert batch is not None and "a" in batch.freed
    assert s.ahead_tokens_dropped + s.late_results_dropped >= 1
    assert not s.seqs and not s.pool.refs and not s.in_flight

    # The same prompt again, on the same cache (its prompt blocks are cached): greedy
    # output equals transformers' generate token for token.
    s.handle(request("b", eos))
    got: list[int] = []
    for _ in range(4 * MAX_TOKENS):
        plan = s.schedule()
        if plan is None:
            if not s.in_flight:
                break
            continue
        result: StepResult = runner.execute(plan)
        assert result.error is None, result.error
        s.handle(result)
        got += outputs(s.take_batch(), "b")[0]
    want, _ = hf_greedy_fn(tiny_llama_dir, list(PROMPT), MAX_TOKENS)
    assert got == want
    assert not s.seqs and not s.pool.refs
    assert s.pool.hits > 0  # it did reuse a's prompt blocks
