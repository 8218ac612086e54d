"""Speculative decoding (n-gram prompt lookup): the proposer against a naive reference,
greedy output token-identical to transformers with speculation on (preemption, chunked
prefill, prefix caching, overlap, the engine topology), stops and lengths exact when a
step accepts several tokens, aborts that leak nothing, the rejection sampler's
distribution (chi-square), the flag's validation and the metrics."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
import trio
from helpers import abort_three_of_four, build_tiny_model, collect_all, hf_greedy, hf_model
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from sim.profiles import examples
from steps import Plans

from actorllm.config import CPU_DRAFT_TOKENS_PER_STEP, EngineConfig, SpeculativeConfig
from actorllm.engine.async_engine import AsyncEngine, Resources, open_engine
from actorllm.llm import collect
from actorllm.model import ForwardBatch
from actorllm.ops.cpu_step import DecodeStep
from actorllm.scheduler.draft_cost import (
    BLOCK_COST,
    DRAFT_COST,
    ROW_BLOCK,
    best_drafts,
    draft_gain,
    pays_from,
    plain_step,
)
from actorllm.scheduler.ngram import history, history_array, lookup_row
from actorllm.scheduler.sequence import Sequence
from actorllm.scheduler.speculation import Speculation
from actorllm.text.ngram import _match_arrays, _match_list, propose_ngram
from actorllm.wire.messages import FEED_LAST_SAMPLE, SamplingParams, ScheduledSeq, StepPlan
from actorllm.worker import packing
from actorllm.worker.packing import BlockTables, one_token_rows, pack_plan
from actorllm.worker.runner import ModelRunner
from actorllm.worker.sampler import SamplingState
from actorllm.worker.sampling_batch import SamplingBatch
from actorllm.worker.speculative import verify, verify_drafts, verify_slot

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


# --- the proposer ----------------------------------------------------------------------


def naive_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence
            if tokens[start:start + n] == suffix:
                # The text is guessed to go on copying itself from there: one token at a
                # time, each the one ``len(tokens) - (start + n)`` before it.
                text = list(tokens)
                for _ in range(k):
                    text.append(text[start + n + len(text) - len(tokens)])
                return text[len(tokens):]
    return []


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.integers(0, 2), min_size=2, max_size=80), st.integers(1, 5))
def test_the_two_match_scans_agree(tokens: list[int], top: int) -> None:
    """The one-by-one scan (few earlier copies of the last token) and the whole-array one
    (many) find the same match: the longest, the latest of the longest."""
    arr = np.asarray(tokens, dtype=np.int64)
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    assume(len(ends))
    top = min(top, len(tokens) - 1)
    assert _match_list(tokens, len(tokens), ends.tolist(), top) == \
        _match_arrays(arr, len(tokens), ends, top)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 9), max_size=70), st.booleans()),
                max_size=8))
def test_the_history_array_follows_the_sequence(appends: list[tuple[list[int], bool]]
                                                ) -> None:
    """``history`` keeps a sequence's tokens, and where each occurs, across calls, and
    ``history_array`` the same as an array, extended by what was appended since, and
    built again when its output was not just extended."""
    seq = Sequence("a", [3, 1, 4], SamplingParams(max_tokens=1000), 1000, frozenset())
    for tokens, replace in appends:
        if replace and seq.output_ids:
            seq.output_ids = [*seq.output_ids[:-1], seq.output_ids[-1] + 1]
        seq.output_ids += tokens
        got = history(seq)
        assert got == seq.prompt_ids + seq.output_ids
        assert seq.spec_where == {t: [i for i, u in enumerate(got) if u == t] for t in got}
        if tokens:  # (the array may lag the list: it is extended only when asked for)
            assert history_array(seq).tolist() == got


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60),
       st.lists(st.integers(0, 3), max_size=60), st.integers(1, 5), st.integers(1, 4),
       st.integers(0, 3))
def test_a_rows_kept_lookup_equals_the_naive_reference(prompt: list[int], out: list[int],
                                                       k: int, n_min: int, extra: int
                                                       ) -> None:
    """``lookup_row``, asked at every length of the output (as a row asks each step),
    proposes what the reference does; with these small vocabularies a token's earlier
    copies are often past ``MANY_ENDS``, so both scans are run."""
    seq = Sequence("a", prompt, SamplingParams(max_tokens=1000), 1000, frozenset())
    for t in [None, *out]:
        if t is not None:
            seq.output_ids.append(t)
        tokens = seq.prompt_ids + seq.output_ids
        assert lookup_row(seq, k, n_min, n_min + extra)[0] == \
            naive_ngram(tokens, k, n_min, n_min + extra)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 5), st.integers(1, 4),
       st.integers(0, 3))
def test_propose_ngram_equals_the_naive_reference(tokens: list[int], k: int, n_min: int,
                                                  extra: int) -> None:
    n_max = n_min + extra
    assert propose_ngram(tokens, k, n_min, n_max) == naive_ngram(tokens, k, n_min, n_max)


@settings(max_examples=examples(200), deadline=None)
@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(1, 16),
       st.sampled_from(sorted(DRAFT_COST.values())))
def test_drafts_grow_with_acceptance_and_only_when_they_pay(a: float, b: float, cap: int,
                                                             cost: float) -> None:
    """The policy's draft count: never above the cap, never fewer for a higher estimate,
    and none unless the expected gain is positive."""
    lo, hi = sorted((a, b))
    k_lo, k_hi = best_drafts(lo, cap, cost), best_drafts(hi, cap, cost)
    assert 0 <= k_lo <= k_hi <= cap
    assert (k_lo == 0) == all(draft_gain(lo, k, cost) <= 0 for k in range(1, cap + 1))
    assert best_drafts(1.0, cap, DRAFT_COST["ngram"]) == cap  # all accepted: the most


@settings(max_examples=examples(300), deadline=None)
@given(st.floats(0.0, 1.0), st.integers(1, 16), st.integers(1, 32),
       st.sampled_from(sorted(DRAFT_COST.values())))
def test_the_estimate_from_which_drafting_pays_is_exact(alpha: float, cap: int, rows: int,
                                                        cost: float) -> None:
    """``pays_from``'s bounds agree with ``best_drafts`` on every estimate, and the
    Speculation's check by them (``_paying``) is ``best_drafts > 0`` exactly."""
    lo, hi = pays_from(cap, cost, rows)
    assert lo < hi
    assert not best_drafts(lo, cap, cost, rows)
    if hi <= 1.0:
        assert best_drafts(hi, cap, cost, rows)
    if alpha <= lo:
        assert not best_drafts(alpha, cap, cost, rows)
    if alpha >= hi:
        assert best_drafts(alpha, cap, cost, rows)
    method = next(m for m, c in DRAFT_COST.items() if c == cost)
    spec = Speculation(SpeculativeConfig(method=method, num_speculative_tokens=cap,
                                         model="d" if method == "draft_model" else None))
    assert spec._paying(alpha, cap, rows) == bool(best_drafts(alpha, cap, cost, rows))


@settings(max_examples=examples(200), deadline=None)
@given(st.floats(0.0, 1.0), st.integers(1, 16), st.integers(1, 64), st.integers(0, 64),
       st.sampled_from(sorted(DRAFT_COST.values())))
def test_drafts_shrink_as_the_batch_grows(alpha: float, cap: int, rows: int, more: int,
                                          cost: float) -> None:
    """Beside more rows a saved step is worth less (``plain_step(rows) / rows``) and a
    draft costs at least as much, so a row never carries more drafts in a bigger batch;
    and it carries one only if that draft alone, or more, gains more than they cost."""
    k, k_more = best_drafts(alpha, cap, cost, rows), best_drafts(alpha, cap, cost, rows + more)
    assert 0 <= k_more <= k <= cap
    assert plain_step(rows + more) / (rows + more) <= plain_step(rows) / rows
    if k:
        assert draft_gain(alpha, k, cost, rows) > 0
        assert all(draft_gain(alpha, j, cost, rows) <= draft_gain(alpha, k, cost, rows)
                   for j in range(1, cap + 1))


def test_the_cost_model_drafts_alone_and_not_where_drafting_broke_even() -> None:
    """Measured on the CPU (docs/architecture.md): one row drafts deep at the benchmark's
    acceptance; 4 rows at acceptance 0.63 broke even with 2 drafts a row, so the model
    gives them none, while a row whose drafts are nearly always accepted still drafts."""
    ngram = DRAFT_COST["ngram"]
    assert best_drafts(0.63, 8, ngram, 1) >= 4
    assert best_drafts(0.63, 2, ngram, 4) == 0
    assert best_drafts(0.9, 2, ngram, 4) == 2
    assert best_drafts(0.9, 8, ngram, 16) <= 1


@pytest.mark.parametrize("bounded", [True, False])
def test_a_lone_row_stops_short_of_a_new_gemm_row_block_unless_it_pays(bounded: bool
                                                                       ) -> None:
    """A lone row's ninth token starts a new block of GEMM rows on the CPU (BLOCK_COST):
    at an estimate of 0.75 the eighth draft's expected step (0.75^8 = 0.10) pays its
    token but not the block, at 0.95 (0.66) both; beside other rows, and where a step's
    drafts are unbounded (a GPU's default), there is no such cost."""
    ngram = DRAFT_COST["ngram"]
    assert best_drafts(0.75, 8, ngram, 1) == 8
    assert best_drafts(0.75, 8, ngram, 1, BLOCK_COST) == ROW_BLOCK - 1
    assert best_drafts(0.95, 8, ngram, 1, BLOCK_COST) == 8
    assert best_drafts(0.75, 8, ngram, 2, BLOCK_COST) == best_drafts(0.75, 8, ngram, 2)
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_max=4,
                                         max_draft_tokens_per_step=8 if bounded else None))
    seq = Sequence("a", [5, 6, 7, 8, 9] * 3, SamplingParams(max_tokens=100), 100,
                   frozenset())
    seq.spec_hits, seq.spec_tries = [1.0] * 5, [2.0] * 5
    seq.spec_hits[4], seq.spec_tries[4] = 3.0, 4.0  # 4-gram matches: 0.75
    assert len(spec.propose(seq, 8, 1)) == (ROW_BLOCK - 1 if bounded else 8)


def test_beside_many_rows_a_row_probes_each_kind_once_then_skips_the_lookup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At 4 rows the prior does not pay: each kind of match gets one probe draft; once
    every kind was tried and none pays, the row stops looking up n-grams (each lookup
    costs it a scan of its history every step), and its estimates drift back towards
    the prior meanwhile. Alone, the same row proposes again at once."""
    import actorllm.scheduler.speculation as speculation

    lookups: list[int] = []

    def counted(seq: Sequence, k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
        lookups.append(k)
        return real(seq, k, n_min, n_max)

    real = speculation.lookup_row
    monkeypatch.setattr(speculation, "lookup_row", counted)
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2,
                                         max_draft_tokens_per_step=8))
    seq = Sequence("a", [5, 6, 7, 5, 6, 7, 5], SamplingParams(max_tokens=100), 100,
                   frozenset())
    assert spec.propose(seq, 2, 4) == [6]  # a 2-gram match, never tried: a probe of one
    spec.verdict(seq, 1, 0)
    assert seq.spec_skip and lookups == [2]  # nothing it tried pays: back-off
    while seq.spec_skip:
        assert spec.propose(seq, 2, 4) == []
    seq.output_ids += [9, 5]  # [.. 5, 9, 5]: (9, 5) never occurred, 5 alone matches
    assert spec.propose(seq, 2, 4) == [9]  # the untried 1-gram kind: a probe
    spec.verdict(seq, 1, 0)
    while seq.spec_skip:
        spec.propose(seq, 2, 4)
    before = len(lookups)
    tries = list(seq.spec_tries)
    assert [spec.propose(seq, 2, 4) for _ in range(5)] == [[]] * 5
    assert len(lookups) == before  # every kind tried, none pays: no lookup
    assert all(abs(t - 2.0) < abs(b - 2.0) for t, b in zip(seq.spec_tries[1:], tries[1:],
                                                            strict=True))
    assert spec.propose(seq, 4, 1) and len(lookups) == before + 1  # alone it pays again
    unbounded = Speculation(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2))
    fresh = Sequence("b", [5, 6, 7, 5, 6, 7, 5], SamplingParams(max_tokens=100), 100,
                     frozenset())
    assert unbounded.propose(fresh, 4, 4) == [6, 7, 5, 6]  # a GPU's default: as if alone


def test_beside_many_rows_a_few_rows_probe_a_kind_for_the_rest() -> None:
    """A kind of match no row has tried is probed beside 4 rows; once the rows' verdicts
    on it add up to a prior's worth and say it does not pay there, a fresh row spends no
    probe on it (and skips the lookup); verdicts that say it pays bring the probes back."""
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=1,
                                         max_draft_tokens_per_step=8))

    def fresh(i: int) -> Sequence:
        return Sequence(f"r{i}", [5, 6, 5], SamplingParams(max_tokens=100), 100, frozenset())

    probed = 0
    for i in range(10):
        seq = fresh(i)
        if spec.propose(seq, 2, 4) == [6]:
            probed += 1
            spec.verdict(seq, 1, 0)
    assert probed == 3, probed  # 1, 1.75, 2.31 tries: two rows' misses were not enough
    assert not spec.wants(fresh(10), 4) and spec.wants(fresh(10), 1)  # alone: the prior
    for i in range(4):  # rows alone find the kind paying
        seq = fresh(20 + i)
        assert spec.propose(seq, 4, 1)
        spec.verdict(seq, 1, 1)
    assert spec.propose(fresh(30), 2, 4) == [6]


def test_under_overlap_a_row_nothing_of_which_pays_is_not_held_back() -> None:
    """``wants`` (a row not planned ahead, waiting for its verdict or token) only while
    some kind of its matches may pay: beside 4 rows, once its kinds were tried and
    failed, the row may run ahead again, and each step planned ahead forgives its
    estimates a bit. Unbounded drafts (a GPU) cost a row as alone: it still wants."""
    bounded = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=1,
                                max_draft_tokens_per_step=8)
    spec = Speculation(bounded)
    seq = Sequence("a", [5, 6, 5], SamplingParams(max_tokens=100), 100, frozenset())
    assert spec.wants(seq, 4)  # the 1-gram kind never tried: a probe may come
    assert spec.propose(seq, 2, 4) == [6]
    spec.verdict(seq, 1, 0)
    seq.spec_skip = 0
    assert not spec.wants(seq, 4) and spec.wants(seq, 1)  # alone the estimate pays
    before = seq.spec_tries[1]
    spec.step_without_proposal(seq)
    assert abs(seq.spec_tries[1] - 2.0) < abs(before - 2.0)
    unbounded = Speculation(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=1))
    other = Sequence("b", [5, 6, 5], SamplingParams(max_tokens=100), 100, frozenset())
    unbounded.propose(other, 4, 4)
    unbounded.verdict(other, 4, 0)
    other.spec_skip = 0
    assert unbounded.wants(other, 4)


def test_proposals_stop_short_of_max_tokens_skip_logprob_rows_and_back_off() -> None:
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=4))
    seq = Sequence("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=3), 3, frozenset())
    assert spec.propose(seq, 10) == [3, 1]  # at most max_tokens - 1 drafts
    assert spec.propose(seq, 1) == [3]  # the token budget's room
    lp = Sequence("b", [1, 2, 3, 1, 2], SamplingParams(logprobs=1), 16, frozenset())
    assert spec.propose(lp, 10) == []
    spec.verdict(seq, 2, 0)  # one miss: the estimate (0.3 from a prior of 0.5) still pays
    assert seq.spec_skip == 0 and spec.propose(seq, 10) == [3, 1]
    spec.verdict(seq, 2, 0)
    spec.verdict(seq, 2, 0)  # now nothing pays: two steps without proposals
    assert seq.spec_skip == 2 and seq.spec_misses == 1
    assert [spec.propose(seq, 10) for _ in range(2)] == [[], []]
    assert spec.propose(seq, 10) == []  # and a match of that length is passed over ...
    for _ in range(6):
        spec.propose(seq, 10)
    assert spec.propose(seq, 10) == [3]  # ... until it has recovered: a probe of one draft
    spec.verdict(seq, 1, 1)
    assert seq.spec_misses == 0 and spec.accepted_per_pos == [1, 0, 0, 0]
    assert spec.propose(seq, 10) == [3, 1]  # an accepted draft raises the estimate
    assert spec.per_row(100) == 4  # no cap
    capped = Speculation(SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=4))
    assert (capped.per_row(3), capped.per_row(4)) == (2, 0)


def test_a_step_shares_its_draft_tokens_between_the_running_rows() -> None:
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=4, max_draft_tokens_per_step=16))
    assert [spec.per_row(n) for n in (1, 4, 5, 8, 16, 17, 64)] == [4, 4, 3, 2, 1, 0, 0]
    unset = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert unset is not None and unset.max_draft_tokens_per_step is None
    assert unset.for_device("cpu").max_draft_tokens_per_step == CPU_DRAFT_TOKENS_PER_STEP
    assert unset.for_device("cuda:0").max_draft_tokens_per_step is None
    mine = SpeculativeConfig.parse('{"num_speculative_tokens": 4, '
                                   '"max_draft_tokens_per_step": 64}')
    assert mine is not None and mine.for_device("cpu").max_draft_tokens_per_step == 64


def test_speculative_config_is_checked() -> None:
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}') \
        == SpeculativeConfig("ngram", 2, 4, 1)
    for bad, words in (("{", "not JSON"), ('{"num_speculative_tokens": 0}', "positive"),
                       ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
                       ('{"method": "ngram"}', "required"),
                       ('{"num_speculative_tokens": 2, "k": 1}', "unknown key"),
                       ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                        '"prompt_lookup_max": 2}', "must not exceed")):
        with pytest.raises(ValueError, match=words):
            EngineConfig(speculative_config=bad)


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_bad_speculative_config_is_one_line_and_exit_2(command: str) -> None:
    args = [command, "--speculative-config", '{"method": "draft", "num_speculative_tokens": 1}']
    out = subprocess.run([sys.executable, "-m", "actorllm", *args,
                          *(["x"] if command == "run" else [])],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--speculative-config" in lines[0], out.stderr


# --- verification: the distribution ------------------------------------------------------


def _chi_square(counts: Counter[int], probs: torch.Tensor, n: int) -> float:
    expected = probs * n
    keep = expected > 0
    observed = torch.tensor([counts.get(i, 0) for i in range(len(probs))], dtype=torch.float64)
    assert observed[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
    SamplingParams(temperature=1.3, seed=11, presence_penalty=0.5),
])
def test_rejection_sampling_keeps_the_target_distribution(params: SamplingParams) -> None:
    """Six tokens; fixed logits at each position; drafts [2, 4] (a point-mass draft).
    The first emitted token must follow the target's first distribution, and the second,
    when the first draft was accepted, its second one. Fixed seeds: no flakes; a wrong
    acceptance rule (always, or with p(x) / max) is off by hundreds."""
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.2, 0.9, -1.0, 0.5, 0.0],
                           [0.1, 0.8, -0.5, 0.3, 1.2, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    n = 6000
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for i in range(n):
        p = params if params.seed is None else SamplingParams(
            temperature=params.temperature, seed=params.seed + i,
            presence_penalty=params.presence_penalty)
        state = SamplingState(p, (0, 1), ())
        out = verify(logits, [2, 4], state, ())
        assert state.output_token_ids == out and 1 <= len(out) <= 3
        first[out[0]] += 1
        if out[0] == 2:
            second[out[1]] += 1

    def target(row: torch.Tensor, history: tuple[int, ...]) -> torch.Tensor:
        import numpy as np

        from actorllm.worker.filters import candidates
        from actorllm.worker.sampler import process_logits
        state = SamplingState(params, (0, 1), history)
        row = process_logits(row[None].clone(), [state], ())
        k = params.top_k if 0 < params.top_k < 6 else 6
        vals, ids = candidates(row, np.array([params.temperature], dtype=np.float32),
                               np.array([k]), np.array([params.top_p], dtype=np.float32),
                               np.array([params.min_p], dtype=np.float32))
        probs = torch.zeros(6, dtype=torch.float64)
        probs[ids[0]] = vals.softmax(-1)[0].double()
        return probs

    # 99.99th percentiles of chi-square with 5 degrees of freedom: 25.7.
    assert _chi_square(first, target(logits[0], ()), n) < 25.7
    assert _chi_square(second, target(logits[1], (2,)), sum(second.values())) < 25.7


def test_greedy_verification_accepts_while_the_draft_is_the_argmax() -> None:
    logits = torch.eye(5)[[1, 2, 3, 4]] * 3  # argmax: 1, 2, 3, 4
    state = SamplingState(SamplingParams(temperature=0.0), (0,))
    assert verify(logits, [1, 2, 0], state, ()) == [1, 2, 3]  # mismatch: the target's 3
    state = SamplingState(SamplingParams(temperature=0.0), (0,))
    assert verify(logits, [1, 2, 3], state, ()) == [1, 2, 3, 4]  # all accepted: the bonus


@settings(max_examples=examples(100), deadline=None)
@given(st.integers(0, 60), st.integers(1, 8), st.integers(0, 4), st.integers(-1, 1))
@example(56, 8, 0, 1)  # (a table that would outgrow its width: the long profile found it)
def test_a_lone_speculating_row_is_packed_as_the_general_path_splits_it(
        start: int, drafts: int, other: int, spare: int) -> None:
    """``pack_plan``'s own path for one speculating row gives the batch the general path
    gives split into one-token rows (every field and dtype), and the same errors: a row
    past ``max_model_len``, a table too short."""
    block, limit = 4, 64
    tables = BlockTables(200, block, limit)
    tables.apply(Plans().plan(0, [ScheduledSeq("z", (1,), 0, tuple(range(other)), True)]))
    need = -(-(start + 1 + drafts) // block)
    # (no longer than a table can be: a row past max_model_len is the error tested below)
    table = tuple(range(50, 50 + min(max(need + spare, 0), tables.width)))
    tables.apply(Plans().plan(1, [ScheduledSeq("a", (1,), 0, table, True)]))
    row = ScheduledSeq("a", tuple(range(7, 8 + drafts)), start, (), True)
    plan = attrs.evolve(Plans().plan(2, [row]), num_drafts=(drafts,))
    slots = tables.apply(plan)

    def packed(one_token: bool) -> ForwardBatch | str:
        try:
            batch = pack_plan(plan, tables, slots, limit, torch.device("cpu"),
                              lambda *a: np.zeros(0), one_token=one_token)
        except ValueError as e:
            return str(e)
        return batch if one_token else one_token_rows(plan, batch)

    direct, split = packed(True), packed(False)
    if isinstance(split, str):
        assert direct == split
        return
    assert isinstance(direct, ForwardBatch)
    for f in dataclasses.fields(split):
        a, b = getattr(direct, f.name), getattr(split, f.name)
        assert (a.dtype == b.dtype and torch.equal(a, b)) if isinstance(a, torch.Tensor) \
            else a == b, f.name


def test_a_drafting_step_packed_as_one_token_rows_gives_the_modules_logits(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of speculating rows (3 and 1 drafts) and a plain decode row, packed as
    one-token rows for the one-op decode step, against the module running the speculating
    rows as multi-token rows: the same logits at every verified position and the same K/V
    (within float tolerance: the linears see other row counts), on a random cache."""
    runner = ModelRunner(tiny_llama_dir, num_blocks=64, block_size=4)
    assert runner.decode_step is not None
    rows = [ScheduledSeq("a", (7, 8, 9, 10), 9, (5, 2, 9, 30), True),
            ScheduledSeq("b", (11,), 5, (1, 3), True),
            ScheduledSeq("c", (12, 13), 14, (4, 6, 7, 8), True)]
    plan = attrs.evolve(Plans().plan(1, rows), num_drafts=(3, 0, 1))
    tables = BlockTables(runner.num_blocks, 4, runner.max_model_len)
    slots = tables.apply(plan)

    whole = pack_plan(plan, tables, slots, runner.max_model_len, runner.device,
                      lambda *a: np.zeros(0))
    split = one_token_rows(plan, whole)
    assert not DecodeStep.applies(whole) and DecodeStep.applies(split)
    chunk = attrs.evolve(plan, num_drafts=(3, 0, 0))  # "c" a prefill chunk: the module's
    assert one_token_rows(chunk, whole) is whole
    assert split.seq_lens.tolist() == [10, 11, 12, 13, 6, 15, 16]
    assert torch.equal(split.sample_indices, whole.sample_indices)  # 1 + drafts per row
    # The Worker packs a verify step split at once (pack_plan's one_token): the same batch.
    direct = pack_plan(plan, tables, slots, runner.max_model_len, runner.device,
                       lambda *a: np.zeros(0), one_token=True)
    for f in dataclasses.fields(split):
        a, b = getattr(direct, f.name), getattr(split, f.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
    # A prefill chunk in the step is split too (the op runs prefill): its sampling rows
    # stay the chunk's last token.
    mixed = pack_plan(chunk, tables, slots, runner.max_model_len, runner.device,
                      lambda *a: np.zeros(0), one_token=True)
    assert mixed.max_seqlen_q == 1 and mixed.seq_lens.tolist() == split.seq_lens.tolist()
    assert mixed.sample_indices.tolist() == [0, 1, 2, 3, 4, 6]
    # ... unless a chunk is longer than the op's limit: then the module runs the step.
    monkeypatch.setattr(packing, "ONE_OP_MAX_CHUNK", 3)
    assert pack_plan(chunk, tables, slots, runner.max_model_len, runner.device,
                     lambda *a: np.zeros(0), one_token=True).max_seqlen_q == 4
    g = torch.Generator().manual_seed(0)
    caches = [(torch.randn(k.shape, generator=g), torch.randn(v.shape, generator=g))
              for k, v in runner.kv_caches]
    copies = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        want = runner.model.compute_logits(
            runner.model(whole, caches, runner.backend)[whole.sample_indices])
        got = runner.model.compute_logits(
            runner.decode_step(split, copies)[split.sample_indices])
    assert got.shape == want.shape == (7, runner.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (k, v), (k2, v2) in zip(caches, copies, strict=True):
        torch.testing.assert_close((k2, v2), (k, v), rtol=1e-5, atol=1e-5)


def test_plain_greedy_rows_verified_at_once_match_row_by_row_verification() -> None:
    """verify_drafts takes plain greedy rows together (one argmax); rows with a penalty or
    a min_tokens still to reach go position by position. Both against verify_slot."""
    vocab, g = 12, torch.Generator().manual_seed(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(5,)),
              SamplingParams(temperature=0.0)]
    drafts = [3, 2, 3, 4, 0]  # row 4 plain decode: sampled as usual, not here
    logits = torch.randn(sum(d + 1 for d in drafts), vocab, generator=g)
    tokens, at = [], 0
    for d in drafts:  # each row's drafts the argmax, but for one in the middle: a run of
        best = logits[at:at + d].argmax(-1).tolist()  # accepted drafts, then a rejection
        if d > 1:
            best[d // 2] = (best[d // 2] + 1) % vocab
        tokens += [1, *best]
        at += d + 1

    def batch() -> SamplingBatch:
        b = SamplingBatch(vocab, torch.device("cpu"), (1,), 8)
        for i, p in enumerate(params):
            b.add(i, SamplingState(p, [7, 8, 7, 9], [8, 3]))
        return b

    plan = StepPlan(1, rids=tuple("abcde"), num_tokens=tuple(d + 1 for d in drafts),
                    token_ids=tuple(tokens), start_pos=(6,) * 5, sample=(True,) * 5,
                    num_drafts=tuple(drafts))
    slots = np.arange(5)
    got, last = verify_drafts(logits, plan, slots, (together := batch()))
    ref, at = batch(), 0
    for j, d in enumerate(drafts):
        if d:
            want = verify_slot(ref, j, logits[at:at + d + 1], tokens[at + 1:at + d + 1])
            assert got[j] == want, j
        at += d + 1
    assert 1 < len(got[0]) < 4 and set(got) == {0, 1, 2, 3}
    assert torch.equal(last, logits[[3, 6, 10, 15, 16]])
    for col in ("num_out", "last_token"):
        assert (together.cols[col] == ref.cols[col]).all(), col


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=5),
       st.integers(0, 2 ** 16), st.sampled_from([0, 16, 64]))
def test_plain_greedy_rows_alone_are_verified_and_committed_at_once(
        rows: list[tuple[int, int]], seed: int, few: int) -> None:
    """A batch of plain greedy rows only (no penalty table): each row's accepted drafts,
    its own token and the batch's columns are verify_slot's, whether the first rejection
    comes early, late or never (the bonus token); compared in Python (a few drafts) or
    in whole-array ops (``few``: ``FEW_DRAFTS``, where one becomes the other)."""
    import actorllm.worker.speculative as speculative

    before, speculative.FEW_DRAFTS = speculative.FEW_DRAFTS, few
    try:
        _check_plain_greedy_rows(rows, seed)
    finally:
        speculative.FEW_DRAFTS = before


def _check_plain_greedy_rows(rows: list[tuple[int, int]], seed: int) -> None:
    vocab, g = 9, torch.Generator().manual_seed(seed)
    drafts = [d for d, _ in rows]
    logits = torch.randn(sum(d + 1 for d in drafts), vocab, generator=g)
    tokens, at = [], 0
    for d, wrong in rows:
        best = logits[at:at + d].argmax(-1).tolist()
        if wrong < d:  # the draft at ``wrong`` is not the argmax: rejected there
            best[wrong] = (best[wrong] + 1) % vocab
        tokens += [1, *best]
        at += d + 1

    def batch() -> SamplingBatch:
        b = SamplingBatch(vocab, torch.device("cpu"), (1,), 8)
        for i in range(len(rows)):
            b.add(i, SamplingState(SamplingParams(temperature=0.0), [7, 8], [3] * i))
        return b

    n = len(rows)
    plan = StepPlan(1, rids=tuple(f"r{i}" for i in range(n)),
                    num_tokens=tuple(d + 1 for d in drafts), token_ids=tuple(tokens),
                    start_pos=(4,) * n, sample=(True,) * n, num_drafts=tuple(drafts))
    got, _ = verify_drafts(logits, plan, np.arange(n), (together := batch()))
    ref, at = batch(), 0
    for j, (d, wrong) in enumerate(rows):
        if d:
            want = verify_slot(ref, j, logits[at:at + d + 1], tokens[at + 1:at + d + 1])
            assert got[j] == want and len(want) == min(wrong, d) + 1, j
        at += d + 1
    assert set(got) == {j for j, d in enumerate(drafts) if d}
    assert together.seen is None
    for col in ("num_out", "last_token"):
        assert (together.cols[col] == ref.cols[col]).all(), col


# --- end to end ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def looping_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny Llama whose attention and MLP outputs are scaled down 1000x: close to a
    bigram model (attention still moves its logits a little), so a prompt that holds a
    chain of its own greedy tokens and restarts it is continued mostly, not always, as
    before. Drafts are then often accepted, sometimes in part: what these tests need.
    (``tiny_llama_dir``, where attention dominates, checks the rejected drafts' K/V.)"""
    from transformers import LlamaForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("looping-llama"), "llama",
                            tokenizer_dir=tokenizer_dir)
    model = LlamaForCausalLM.from_pretrained(str(path))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-3)
            layer.mlp.down_proj.weight.mul_(1e-3)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def loop_prompts(looping_llama_dir: Path) -> list[list[int]]:
    """Prompts that repeat a passage: a chain of greedy tokens, then its first token."""
    model = hf_model(looping_llama_dir)
    prompts = []
    for start in (5, 50, 100, 150, 200, 250):
        chain = hf_greedy(model, [start], 20)[0]
        prompts.append([start, *chain, start])
    return [*prompts, prompts[0], prompts[1]]  # the repeats hit the prefix cache


_resources: dict[tuple[str, int, int], Resources] = {}


@asynccontextmanager
async def spec_engine(model: Path, *, num_kv_blocks: int = 128, max_model_len: int = 128,
                      spec: Any = NGRAM, **kw: Any) -> AsyncIterator[AsyncEngine]:
    config = EngineConfig(model=str(model), num_kv_blocks=num_kv_blocks, block_size=4,
                          max_model_len=max_model_len, speculative_config=spec, **kw)
    key = (str(model), num_kv_blocks, max_model_len)
    if key not in _resources:
        _resources[key] = Resources(config)
    async with open_engine(config, resources=_resources[key]) as engine:
        yield engine
        assert await engine.wait_drained() == []


@pytest.mark.parametrize("overlap", [False, True])
async def test_greedy_equals_transformers_with_speculation(
        looping_llama_dir: Path, loop_prompts: list[list[int]], overlap: bool) -> None:
    """A 24-block pool (two of the 8 sequences fill it: preemption), a 16-token budget
    (chunked prefill), one or two steps in flight (with two, rows planned ahead draft by
    the Worker's lookup); then a prompt sent again once its first run is over (a
    prefix-cache hit)."""
    max_new = 24
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    async with spec_engine(looping_llama_dir, num_kv_blocks=24, max_model_len=64,
                           max_num_batched_tokens=16, async_scheduling=overlap) as engine:
        runner = _resources[(str(looping_llama_dir), 24, 64)].runner
        one_op, ahead = runner.one_op_draft_steps, runner.ahead.drafting_rows
        results = await collect_all(engine, loop_prompts, params)
        stats = engine.frontend.stats
        # Whether the repeats above hit depends on when each arrives (a twin's blocks are
        # hashed only once its step is back, and may be evicted by then); a prompt run
        # again after its first run ended always does.
        first = await collect(engine, "again0", loop_prompts[0], params)
        hits = engine.frontend.stats.prefix_cache_hits
        second = await collect(engine, "again1", loop_prompts[0], params)
        hits = engine.frontend.stats.prefix_cache_hits - hits
    assert runner.one_op_draft_steps > one_op, "drafting steps run by the one-op decode step"
    if overlap:
        assert runner.ahead.drafting_rows > ahead, "rows planned ahead drafted for"
    assert stats.num_preemptions > 0, "the test must exercise preemption"
    assert hits > 0, "and prefix caching"
    assert first.outputs[0].token_ids == second.outputs[0].token_ids \
        == results[0].outputs[0].token_ids
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, "and partial acceptance"
    assert sum(stats.spec_accepted_per_pos) == stats.spec_accepted_tokens
    model = hf_model(looping_llama_dir)
    for prompt, res in zip(loop_prompts, results, strict=True):
        (out,) = res.outputs
        assert list(out.token_ids) == hf_greedy(model, prompt, max_new)[0]
        assert out.finish_reason == "length" and res.error is None


async def test_rejected_drafts_leave_no_trace_where_attention_matters(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain random model: its continuations rarely repeat, so most drafts are
    rejected, and the K/V they wrote is overwritten by the tokens that follow. Any K/V of
    a rejected draft left where attention reads it would change the output. Each row is
    costed as alone: beside the others (how many run together depends on timing) the
    cost model drafts only probes, and the count of rejections was 10 in 3 runs of 5."""
    monkeypatch.setattr(Speculation, "_rows", lambda self, rows: 1)
    prompts = ["a b c a b c a b c a b", "the cat and the dog and the cat and the",
               "numbers 1 2 3 4 5 6 7 8 9 10 11 12 1 2 3", "x y z x y z x y"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    async with spec_engine(tiny_llama_dir, num_kv_blocks=40, max_num_batched_tokens=16,
                           spec={**NGRAM, "prompt_lookup_min": 1}) as engine:
        results = await collect_all(engine, prompts, params)
        stats = engine.frontend.stats
        tokenizer = engine.tokenizer
    assert stats.spec_draft_tokens - stats.spec_accepted_tokens > 10, "rejections"
    model = hf_model(tiny_llama_dir)
    for prompt, res in zip(prompts, results, strict=True):
        ids = tokenizer(prompt).input_ids
        assert list(res.outputs[0].token_ids) == hf_greedy(model, ids, 40)[0], prompt


async def test_greedy_equals_transformers_in_the_engine_topology(
        looping_llama_dir: Path, loop_prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    async with spec_engine(looping_llama_dir, topology="engine") as engine:
        results = await collect_all(engine, loop_prompts[:3], params)
        stats = engine.frontend.stats
    assert stats.spec_accepted_tokens > 0
    model = hf_model(looping_llama_dir)
    for prompt, res in zip(loop_prompts[:3], results, strict=True):
        assert list(res.outputs[0].token_ids) == hf_greedy(model, prompt, 16)[0]


async def test_a_steadily_decoding_row_speculates_under_overlap_as_serve_runs(
        looping_llama_dir: Path, loop_prompts: list[list[int]]) -> None:
    """``actorllm serve``'s engine (``single``, overlap on by default on the CPU), one
    request at a time: a decoding row that may speculate is planned ahead with drafts the
    Worker looks up (AheadRows), so it gets proposals at most of its steps (without
    them, planned ahead, it never would: its last token is always in flight), and the
    tokens are those without speculation and transformers'."""
    max_new = 24
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    got: dict[bool, list[list[int]]] = {}
    for spec in (False, True):
        async with spec_engine(looping_llama_dir, num_kv_blocks=96, serving_http=True,
                               spec=NGRAM if spec else None) as engine:
            assert engine.config.overlap, "serve's default in single on the CPU"
            got[spec] = [list((await collect(engine, f"s{i}", p, params)).outputs[0].token_ids)
                         for i, p in enumerate(loop_prompts[:3])]
            stats = engine.frontend.stats
    # Planned ahead at every step, the rows would get no proposal at all (main did).
    assert stats.spec_num_drafts >= 3 * 3, stats
    assert max_new <= stats.spec_accepted_tokens <= stats.spec_draft_tokens, "a third"
    assert got[True] == got[False]
    model = hf_model(looping_llama_dir)
    for prompt, ids in zip(loop_prompts[:3], got[True], strict=True):
        assert ids == hf_greedy(model, prompt, max_new)[0]


def test_serve_speculates_by_default_through_the_openai_sdk(
        looping_llama_dir: Path, loop_prompts: list[list[int]], tmp_path: Path) -> None:
    """``actorllm serve --speculative-config`` with its defaults (overlap on), one request
    at a time through the openai SDK: draft tokens are proposed and accepted (/metrics),
    and the text is transformers' greedy continuation."""
    import openai
    from test_server import ServerProcess, metrics
    from transformers import AutoTokenizer

    srv = ServerProcess(looping_llama_dir, "--speculative-config", json.dumps(NGRAM),
                        "--served-model-name", "m", log_dir=tmp_path)
    for _ in srv.serve_module():
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                               timeout=120)
        texts = [client.completions.create(model="m", prompt=p, max_tokens=16,
                                           temperature=0.0, extra_body={"ignore_eos": True}
                                           ).choices[0].text for p in loop_prompts[:2]]
        got = metrics(srv.url)
    assert got["actorllm:spec_decode_num_accepted_tokens_total"] >= 8, got
    model, tok = hf_model(looping_llama_dir), AutoTokenizer.from_pretrained(looping_llama_dir)
    for prompt, text in zip(loop_prompts[:2], texts, strict=True):
        assert text == tok.decode(hf_greedy(model, prompt, 16)[0], skip_special_tokens=True)


async def test_stops_and_lengths_cut_exactly_when_a_step_accepts_several_tokens(
        looping_llama_dir: Path, loop_prompts: list[list[int]]) -> None:
    """Speculation on and off give the same tokens, text and finish for max_tokens of
    every length, a stop token id and stop strings cut inside accepted runs."""
    prompt = loop_prompts[1]
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    async with spec_engine(looping_llama_dir, spec=None) as engine:
        (full,) = (await collect_all(engine, [prompt], base))[0].outputs
    ids, text = list(full.token_ids), full.text
    cases = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
             for m in range(1, 13)]
    cases += [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                             stop_token_ids=(ids[m],)) for m in (3, 7, 12)]
    cuts = [text[a:a + 3] for a in range(2, len(text) - 3, 5) if text[a:a + 3].strip()]
    cases += [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=(s,))
              for s in cuts[:6]]
    assert len(cases) > 15
    got: dict[bool, list[Any]] = {}
    for spec in (False, True):
        async with spec_engine(looping_llama_dir, spec=NGRAM if spec else None) as engine:
            outs = []
            for i, params in enumerate(cases):
                res = await collect(engine, f"c{i}", prompt, params)
                outs.append(res.outputs[0])
            stats = engine.frontend.stats
        got[spec] = outs
        if spec:
            assert max(stats.spec_accepted_per_pos[1:]) > 0, "several tokens in one step"
    for params, off, on in zip(cases, got[False], got[True], strict=True):
        assert (on.token_ids, on.text, on.finish_reason, on.stop_reason) == \
            (off.token_ids, off.text, off.finish_reason, off.stop_reason), params
    for m in range(1, 13):
        assert list(got[True][m - 1].token_ids) == ids[:m]


async def test_abort_mid_speculation_leaks_nothing(
        looping_llama_dir: Path, loop_prompts: list[list[int]]) -> None:
    """Requests aborted while their drafts are in flight: the engine drains (no block,
    sequence or Worker state left: spec_engine checks) and the others finish."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    async with spec_engine(looping_llama_dir, num_kv_blocks=64) as engine:
        ends = await abort_three_of_four(engine, loop_prompts, params)
        stats = engine.frontend.stats
    assert ends == ["abort", "abort", "abort", "length"]
    assert stats.spec_draft_tokens > 0


async def test_speculation_metrics_on_the_metrics_registry(
        looping_llama_dir: Path, loop_prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    async with spec_engine(looping_llama_dir) as engine:
        await collect_all(engine, loop_prompts[:2], params)
        engine.update_gauges()  # (what a /metrics scrape does first)
        reg = engine.metrics.registry
        stats = engine.frontend.stats
        drafts = reg.get_sample_value("actorllm:spec_decode_num_draft_tokens_total")
        accepted = reg.get_sample_value("actorllm:spec_decode_num_accepted_tokens_total")
        rows = reg.get_sample_value("actorllm:spec_decode_num_drafts_total")
        first = reg.get_sample_value("actorllm:spec_decode_num_accepted_tokens_per_pos_total",
                                     {"position": "0"})
    assert (drafts, accepted, rows) == (stats.spec_draft_tokens, stats.spec_accepted_tokens,
                                        stats.spec_num_drafts)
    assert 0 < accepted <= drafts and first == stats.spec_accepted_per_pos[0] > 0


async def test_sampled_outputs_follow_the_same_distribution_with_speculation(
        looping_llama_dir: Path, loop_prompts: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """400 seeded requests (seed i: each run is deterministic), top-k 3 at temperature
    1.5: the joint distribution of the first two tokens (the second is where a draft is
    verified by rejection) with speculation on against off, a chi-square test of
    homogeneity over the 3 x 3 pairs. 99.99th percentile at 8 degrees of freedom: 31.8."""
    n = 400
    prompt = loop_prompts[2]
    counts: dict[bool, Counter[tuple[int, ...]]] = {}
    for spec in (False, True):
        params = [SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True,
                                 seed=i) for i in range(n)]
        # Every one of the 128 rows may draft (the CPU's default shares 8 draft tokens),
        # and each is costed as alone (as on a GPU), so that the policy drafts in this
        # batch: beside 128 rows on the CPU it would, rightly, hardly ever.
        monkeypatch.setattr(Speculation, "_rows", lambda self, rows: 1)
        async with spec_engine(looping_llama_dir, max_num_seqs=128, spec={
                **NGRAM, "max_draft_tokens_per_step": 4 * 128} if spec else None) as engine:
            results: list[Any] = [None] * n

            async def one(i: int) -> None:
                results[i] = await collect(engine, f"d{i}", prompt, params[i])  # noqa: B023

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
            stats = engine.frontend.stats
        counts[spec] = Counter(tuple(r.outputs[0].token_ids[:2]) for r in results)
        if spec:
            assert stats.spec_num_drafts > n / 4 and stats.spec_accepted_tokens > 0
    cells = sorted(set(counts[False]) | set(counts[True]))
    assert len(cells) <= 9
    chi = 0.0
    for cell in cells:
        a, b = counts[False][cell], counts[True][cell]
        chi += (a - b) ** 2 / (a + b)  # equal sample sizes: sum (a - b)^2 / (a + b)
    assert chi < 31.8, (counts[False], counts[True])


def test_llm_and_the_cli_take_a_speculative_config(looping_llama_dir: Path,
                                                   loop_prompts: list[list[int]]) -> None:
    """``LLM(speculative_config=...)`` and ``actorllm run --speculative-config`` generate
    what transformers does."""
    from actorllm.llm import LLM

    llm = LLM(str(looping_llama_dir), speculative_config=NGRAM, num_kv_blocks=64,
              block_size=4, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (res,) = llm.generate([loop_prompts[0]], params)
    want = hf_greedy(looping_llama_dir, loop_prompts[0], 12)[0]
    assert list(res.outputs[0].token_ids) == want
    text = llm.tokenizer.decode(loop_prompts[0], skip_special_tokens=True)
    out = subprocess.run(
        [sys.executable, "-m", "actorllm", "run", "--model", str(looping_llama_dir),
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
         "--temperature", "0", "--max-tokens", "12", "--ignore-eos", "--output", "jsonl",
         "--max-model-len", "128", text],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert '"finish_reason": "length"' in out.stdout, out.stdout


# --- the Scheduler's side, driven by hand ---------------------------------------------------


def _scheduler(**kw: Any) -> Any:
    from actorllm.scheduler.actor import Scheduler
    from actorllm.wire.mailbox import Mailbox
    from actorllm.wire.messages import SchedulerInput, StepPlan, TokenBatch

    return Scheduler(Mailbox("s", SchedulerInput, 8), Mailbox("w", StepPlan, 2),
                     Mailbox("d", TokenBatch, 8), num_blocks=32, block_size=4,
                     max_num_seqs=4, max_num_batched_tokens=64,
                     speculative=SpeculativeConfig(num_speculative_tokens=3), **kw)


def test_a_partly_accepted_row_rolls_back_to_its_accepted_tokens() -> None:
    """Prompt 5 6 7 5 6, first output 7: the next row proposes 5 6 7 (what followed the
    earlier '5 6 7'). The Worker accepts one draft and emits its own token: two outputs,
    the rejected drafts' positions unscheduled, hashes over accepted tokens only."""
    from actorllm.scheduler.kv_pool import extend_hashes
    from actorllm.wire.messages import SequenceRequest, StepResult

    s = _scheduler()
    s.handle(SequenceRequest("a", (5, 6, 7, 5, 6), SamplingParams(max_tokens=10), 10, (1,)))
    prefill = s.schedule()
    assert prefill is not None and not prefill.num_drafts
    s.handle(StepResult(prefill.step_id, (7,)))  # output 7: history 5 6 7 5 6 7
    plan = s.schedule()
    assert plan is not None and plan.num_drafts == (3,)
    assert plan.token_ids == (7, 5, 6, 7) and plan.start_pos == (5,)
    seq = s.seqs["a"]
    assert seq.num_scheduled == 9 and len(seq.block_table) == 3
    s.handle(StepResult(plan.step_id, (5, 9), num_sampled=(2,)))  # 5 accepted, then 9
    assert seq.output_ids == [7, 5, 9]
    assert (seq.num_computed, seq.num_scheduled) == (7, 7)  # positions 0..6; 9 is next
    tokens = [5, 6, 7, 5, 6, 7, 5, 9]
    assert seq.block_hashes and \
        seq.block_hashes == extend_hashes([], tokens, 4, len(tokens))[:len(seq.block_hashes)]
    assert s.take_batch().outputs[-1].token_ids == (5, 9)  # type: ignore[union-attr]
    assert s.batch.speculation.accepted_per_pos == [1, 0, 0]  # type: ignore[union-attr]


def test_under_overlap_a_row_that_may_speculate_is_planned_ahead_for_the_worker_to_draft(
        ) -> None:
    """Two steps may be in flight. A decoding row that may speculate is planned ahead of
    the step that samples its last token, as FEED_LAST_SAMPLE and placeholders
    (AheadRows): its caps per kind of match, the prompt for the Worker's lookup, and a
    start as if the step in flight accepted all its drafts. Its blocks cover that; the
    Worker's counts of drafts and match length drive the verdict; the counters settle
    to the tokens committed."""
    from actorllm.wire.messages import SequenceRequest, StepResult

    s = _scheduler(max_steps_in_flight=2)
    s.handle(SequenceRequest("a", (5, 6, 7, 5, 6), SamplingParams(max_tokens=40), 40, (1,)))
    prefill = s.schedule()
    ahead = s.schedule()  # while the prefill samples the first output
    assert prefill is not None and ahead is not None
    assert ahead.token_ids == (FEED_LAST_SAMPLE, 0, 0, 0) and ahead.num_drafts == (3,)
    assert ahead.start_pos == (5,) and ahead.ahead is not None
    assert ahead.ahead.rows == (0,) and (ahead.ahead.n_min, ahead.ahead.n_max) == (1, 4)
    assert ahead.ahead.caps == (3, 3, 3, 3)  # the prior pays for all 3 drafts, any kind
    assert ahead.ahead.hist_tokens == (5, 6, 7, 5, 6) and ahead.ahead.hist_from == (0,)
    seq = s.seqs["a"]
    s.handle(StepResult(prefill.step_id, (7,)))
    assert seq.output_ids == [7] and seq.num_scheduled == 9  # 5 + 1 + 3 drafts in flight
    after = s.schedule()  # planned ahead of a step whose drafts are in flight
    assert after is not None and after.ahead is not None
    assert after.start_pos == (9,), "as if all 3 were accepted"
    assert (after.ahead.hist_from, after.ahead.hist_tokens) == ((5,), (7,))
    k = after.num_drafts[0]
    assert len(seq.block_table) * 4 >= 9 + 1 + k
    # The Worker looked up 2 drafts from a match of 3 tokens; one was accepted, then 9.
    s.handle(StepResult(ahead.step_id, (5, 9), num_sampled=(2,), ahead_drafted=(2,),
                        ahead_kinds=(3,)))
    assert seq.output_ids == [7, 5, 9] and seq.spec_n == 3
    assert (seq.num_computed, seq.num_scheduled) == (7, 7 + 1 + k)
    spec = s.batch.speculation
    assert (spec.draft_tokens, spec.accepted_tokens) == (2, 1)
    # The next row found no match: it ran no draft.
    s.handle(StepResult(after.step_id, (11,), ahead_drafted=(0,), ahead_kinds=(0,)))
    assert seq.output_ids == [7, 5, 9, 11]
    assert (seq.num_computed, seq.num_scheduled, seq.drafts_in_flight) == (8, 8, 0)
    assert spec.num_drafts == 1
    plan = s.schedule()  # nothing in flight: the Scheduler's own lookup again
    assert plan is not None and plan.ahead is None and plan.start_pos == (8,)


def test_under_overlap_a_row_in_back_off_is_planned_ahead_without_drafts() -> None:
    """A row whose proposal had nothing accepted, none of whose kinds pays, backs off:
    planned ahead, it carries no placeholders (after a step with drafts in flight it is
    still an ahead row, for the Worker to start) and its back-off counts those steps."""
    from actorllm.wire.messages import SequenceRequest, StepResult

    s = _scheduler(max_steps_in_flight=2)
    s.handle(SequenceRequest("a", (5, 6, 7, 5, 6), SamplingParams(max_tokens=40), 40, (1,)))
    prefill, ahead = s.schedule(), s.schedule()
    assert prefill is not None and ahead is not None and ahead.num_drafts == (3,)
    seq = s.seqs["a"]
    s.handle(StepResult(prefill.step_id, (7,)))
    after = s.schedule()
    assert after is not None and after.ahead is not None
    seq.spec_hits[:] = [0.0] * len(seq.spec_hits)  # every kind has failed it before
    seq.spec_tries[:] = [8.0] * len(seq.spec_tries)
    # The Worker drafted 3 from a match of 2; none was accepted: it backs off.
    s.handle(StepResult(ahead.step_id, (9,), num_sampled=(1,), ahead_drafted=(3,),
                        ahead_kinds=(2,)))
    assert seq.spec_skip == 2
    steps = [s.schedule()]  # ahead of ``after``, whose drafts are in flight
    assert steps[0] is not None and not steps[0].num_drafts and seq.spec_skip == 1
    assert steps[0].token_ids == (FEED_LAST_SAMPLE,) and steps[0].ahead is not None
    assert not any(steps[0].ahead.caps), "the Worker only starts it"
    s.handle(StepResult(after.step_id, (10,), ahead_drafted=(0,), ahead_kinds=(0,)))
    assert seq.output_ids == [7, 9, 10]
    steps.append(s.schedule())  # ahead of steps[0], which carries no drafts
    assert steps[1] is not None and steps[1].ahead is None
    assert steps[1].token_ids == (FEED_LAST_SAMPLE,) and seq.spec_skip == 0


def test_under_overlap_rows_that_may_speculate_are_planned_ahead_together() -> None:
    """``a`` may speculate, ``b`` is in back-off: every step planned ahead runs both (the
    rows are never split between two half-full steps in flight), ``a`` with
    placeholders, ``b`` without."""
    from actorllm.wire.messages import SequenceRequest, StepResult

    s = _scheduler(max_steps_in_flight=2)
    s.handle(SequenceRequest("a", (5, 6, 7, 5, 6), SamplingParams(max_tokens=40), 40, (1,)))
    s.handle(SequenceRequest("b", (20, 21, 20, 21), SamplingParams(max_tokens=40), 40, (1,)))
    prefill = s.schedule()
    assert prefill is not None and prefill.rids == ("a", "b")
    s.seqs["b"].spec_skip = 8
    in_flight = [prefill]
    for i in range(4):
        plan = s.schedule()
        assert plan is not None and plan.rids == ("a", "b")
        assert plan.num_drafts[0] > 0 and plan.num_drafts[1] == 0
        in_flight.append(plan)
        done = in_flight.pop(0)
        ahead = done.ahead
        s.handle(StepResult(done.step_id, (30 + i, 40 + i),
                            num_sampled=(1, 1) if done.num_drafts else (),
                            ahead_drafted=(0,) * len(ahead.rows) if ahead else (),
                            ahead_kinds=(0,) * len(ahead.rows) if ahead else ()))
    assert s.seqs["a"].output_ids == [30, 31, 32, 33]


def test_an_abort_while_drafts_are_in_flight_waits_for_the_step() -> None:
    from actorllm.wire.messages import AbortRequest, SequenceRequest, StepResult

    s = _scheduler()
    s.handle(SequenceRequest("a", (5, 6, 5, 6, 5), SamplingParams(max_tokens=10), 10, (1,)))
    s.handle(StepResult(s.schedule().step_id, (6,)))
    plan = s.schedule()
    assert plan.num_drafts and plan.num_drafts[0] > 0
    used = s.pool.num_used
    s.handle(AbortRequest("a"))
    assert s.pool.num_used == used, "the draft step still writes its blocks"
    s.handle(StepResult(plan.step_id, (5, 6, 5, 6), num_sampled=(4,)))
    assert s.pool.num_used == 0 and not s.seqs


async def test_a_speculative_trace_checks_and_redrive_says_it_cannot(
        looping_llama_dir: Path, loop_prompts: list[list[int]], tmp_path: Path) -> None:
    """The recorded history of a speculative run is a path through the table (no event
    was added); re-driving it is refused in one sentence, not a crash."""
    from actorllm.lifecycle.table import load_spec
    from actorllm.replay.check import check_trace
    from actorllm.replay.redrive import RedriveError, redrive
    from actorllm.replay.tracefile import load_trace

    path = tmp_path / "spec.jsonl"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    async with spec_engine(looping_llama_dir, trace=str(path)) as engine:
        await collect_all(engine, loop_prompts[:2], params)
        assert engine.frontend.stats.spec_accepted_tokens > 0
    trace = load_trace(path, load_spec())
    assert check_trace(trace, load_spec()) == []
    with pytest.raises(RedriveError, match="speculative"):
        redrive(trace)


def test_a_verify_step_runs_on_the_whole_team(tiny_llama_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-row step with DRAFT_STEP_TOKENS drafts takes the whole team (ops/threads.py),
    also packed as one-token rows for the one-op step (one row per token: the team is
    sized by the plan's rows, not the batch's); a plain decode step stays on one thread."""
    import threading

    from actorllm.cpus import ADAPT_ENV
    from actorllm.ops.threads import DRAFT_STEP_TOKENS
    from actorllm.wire.messages import NewSeqData

    monkeypatch.setenv(ADAPT_ENV, "0")  # the counts as configured, whatever else runs here
    before = torch.get_num_threads()
    try:
        runner = ModelRunner(tiny_llama_dir, num_blocks=64, block_size=4, num_threads=2)
        real, seen = runner.decode_step, []
        assert real is not None

        class Counted:
            applies = staticmethod(real.applies)
            makes_logits = real.makes_logits

            def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
                seen.append(torch.get_num_threads())
                return real(*args, **kwargs)

        runner.decode_step = Counted()  # type: ignore[assignment]
        prompt, plans, table = (0, 5, 6, 7, 5, 6), Plans(), (3, 9, 4, 11)
        new = NewSeqData(SamplingParams(temperature=0.0, max_tokens=32), prompt)
        drafts = (7, 5, 6, 7)[:DRAFT_STEP_TOKENS]

        def steps() -> None:
            runner.execute(plans.plan(1, [ScheduledSeq("a", prompt, 0, table, True, new)]))
            runner.execute(plans.plan(2, [ScheduledSeq("a", (7,), 6, table, True)]))
            verify = plans.plan(3, [ScheduledSeq("a", (5, *drafts), 7, table, True)])
            runner.execute(attrs.evolve(verify, num_drafts=(len(drafts),)))

        t = threading.Thread(target=steps)
        t.start()
        t.join()
        # the prompt (6 tokens: the team), the decode step, the verify step
        assert seen == [2, 1, 2] and runner.one_op_draft_steps == 1
        assert runner.drawn_in_op_steps == 2  # the greedy verify step's argmax drawn there
    finally:
        torch.set_num_threads(before)


def test_the_op_draws_a_verify_steps_positions_only_where_every_drafting_row_is_greedy(
        ) -> None:
    """drawn_temperatures: each row's temperature once per logits row (1 + its drafts)
    while the rows with drafts are greedy; a sampled row with drafts needs the logits
    (rejection sampling): None."""
    from actorllm.worker.speculative import drawn_temperatures

    plan = StepPlan(1, rids=("a", "b", "c"), num_tokens=(3, 1, 2), token_ids=(1,) * 6,
                    start_pos=(5, 5, 5), sample=(True,) * 3, num_drafts=(2, 0, 1))
    temps = np.array([0.0, 0.5, 0.0], dtype=np.float32)
    got = drawn_temperatures(temps, plan)
    assert got is not None and got.tolist() == [0.0, 0.0, 0.0, 0.5, 0.0, 0.0]
    assert got.dtype == np.float32
    assert drawn_temperatures(np.array([0.0, 0.0, 0.5], dtype=np.float32), plan) is None
    greedy = drawn_temperatures(np.zeros(3, dtype=np.float32), plan)
    assert greedy is not None and greedy.tolist() == [0.0] * 6 and greedy.dtype == np.float32


def test_a_row_nothing_of_which_pays_sits_out_the_steps_asking_each_step_would() -> None:
    """_sit_out: a row none of whose kinds pays proposes nothing for exactly the steps
    that asking every step, and forgiving its estimates a bit each time, would have
    taken to make one pay, with the same estimates then; a change of the batch's rows
    has it judged again at once."""
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=1,
                               max_draft_tokens_per_step=8)
    spec = Speculation(config)

    def missed() -> Sequence:
        seq = Sequence("a", [5, 6, 5], SamplingParams(max_tokens=100), 100, frozenset())
        assert spec.propose(seq, 2, 4) == [6]  # a probe
        spec.verdict(seq, 1, 0)
        seq.spec_skip = 0
        return seq

    seq, ref = missed(), missed()
    eager = 0
    while not spec._pays(ref, 2, 2):  # as before: asked, and forgiven, every step
        spec._forgive(ref)
        eager += 1
    lazy = 0
    while not spec.propose(seq, 2, 2):
        lazy += 1
        assert lazy < 100
    assert lazy == eager > 1
    for got, want in ((seq.spec_hits, ref.spec_hits), (seq.spec_tries, ref.spec_tries)):
        assert got == pytest.approx(want)
    spec = Speculation(config)
    again = missed()
    assert spec.propose(again, 2, 2) == [] and again.spec_idle > 0
    assert spec.propose(again, 2, 1)  # alone: judged again, and it pays
