"""The Worker's persistent sampling batch against a per-row reference, across steps in
which rows join, sample, and leave (so slots are reused)."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim.profiles import examples

from actorllm.ops.cpu_step import load_sampler
from actorllm.wire.messages import SamplingParams
from actorllm.worker.sampler import SamplingState, sample
from actorllm.worker.sampling_batch import SamplingBatch

EOS = 3
VOCAB = 40
CPU = torch.device("cpu")
F32 = torch.float32
SAMPLER = load_sampler()  # None where the op cannot be built: both runs are the plain path


def reference_process(row: torch.Tensor, p: SamplingParams, prompt: list[int],
                      output: list[int]) -> torch.Tensor:
    """min_tokens, logit_bias and the penalties on one row, one id at a time."""
    row = row.clone()
    if len(output) < p.min_tokens:
        for t in (*p.stop_token_ids, *(() if p.ignore_eos else (EOS,))):
            row[t] = -math.inf
    for t, bias in p.logit_bias:
        row[t] += torch.tensor(bias, dtype=F32)
    if p.repetition_penalty != 1.0:
        pen = torch.tensor(p.repetition_penalty, dtype=F32)
        for t in set(prompt) | set(output):
            row[t] = row[t] / pen if row[t] > 0 else row[t] * pen
    freq = torch.tensor(p.frequency_penalty, dtype=F32)
    pres = torch.tensor(p.presence_penalty, dtype=F32)
    if p.frequency_penalty or p.presence_penalty:
        for t in set(output):
            row[t] -= freq * output.count(t) + pres
    return row


def reference_support(row: torch.Tensor, p: SamplingParams, slack: float = 1e-4) -> set[int]:
    """The ids a sampled row may draw from its processed logits: temperature, top_k, min_p
    and top_p applied by sorting, with a little slack at the probability thresholds."""
    probs = torch.softmax(row.double() / p.temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    k = p.top_k if 0 < p.top_k < len(order) else len(order)
    floor = p.min_p * probs[order[0]] * (1 - slack)
    kept = [t for rank, t in enumerate(order[:k]) if rank == 0 or probs[t] >= floor]
    total = sum(probs[t] for t in kept)
    allowed, before = set(), 0.0
    for rank, t in enumerate(kept):
        if rank and before / total >= p.top_p + slack:
            break
        allowed.add(t)
        before += probs[t]
    return allowed


_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.0, 0.6, 1.0, 1.5]),
    top_k=st.sampled_from([0, 0, 1, 4, 50]),
    top_p=st.sampled_from([1.0, 1.0, 0.9, 0.5]),
    min_p=st.sampled_from([0.0, 0.0, 0.2]),
    seed=st.one_of(st.none(), st.none(), st.integers(0, 2**40)),
    repetition_penalty=st.sampled_from([1.0, 1.2, 1.2, 0.7]),
    presence_penalty=st.sampled_from([0.0, 0.0, 0.5]),
    frequency_penalty=st.sampled_from([0.0, 0.0, -0.3, 0.25]),
    min_tokens=st.sampled_from([0, 0, 2]),
    stop_token_ids=st.sampled_from([(), (5,)]),
    logit_bias=st.sampled_from([(), ((1, 3.0), (7, -2.5))]),
    logprobs=st.sampled_from([None, None, 0, 2]),
)
_row = st.tuples(_params, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
                 st.lists(st.integers(0, VOCAB - 1), max_size=4))


class Reference:
    """The rows the batch should hold: params, prompt and output so far, by slot."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[SamplingParams, list[int], list[int]]] = {}

    def check_step(self, batch: SamplingBatch, logits: torch.Tensor, slots: np.ndarray
                   ) -> list[int]:
        processed = logits.clone()
        batch.process(processed, slots)
        expected = [reference_process(logits[i], *self.rows[s]) for i, s in
                    enumerate(slots.tolist())]
        for i, s in enumerate(slots.tolist()):
            assert torch.equal(processed[i], expected[i]), (s, self.rows[s][0])
        tokens, token_list, lp_rows, lps = batch.sample(logits, slots)
        assert tokens.tolist() == token_list
        assert lp_rows == [i for i, s in enumerate(slots.tolist())
                           if self.rows[s][0].logprobs is not None]
        for i, lp in zip(lp_rows, lps, strict=True):
            raw = torch.log_softmax(logits[i], -1)
            assert lp.token_id == token_list[i]
            assert math.isclose(lp.logprob, raw[token_list[i]].item(), abs_tol=1e-5)
            assert len(lp.top) == self.rows[int(slots[i])][0].logprobs
        for i, s in enumerate(slots.tolist()):
            p, prompt, output = self.rows[s]
            if p.temperature < 1e-5:
                assert token_list[i] == int(expected[i].argmax())
            elif p.seed is not None:  # its own logits and (seed, position) only
                alone = sample(logits[i : i + 1], [SamplingState(p, prompt, output)], (EOS,))
                assert token_list[i] == alone[0][0]
            else:
                assert token_list[i] in reference_support(expected[i], p), (p, token_list[i])
        batch.commit(slots, tokens, token_list)
        for s, t in zip(slots.tolist(), token_list, strict=True):
            self.rows[s][2].append(t)
        return token_list


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(_row, min_size=1, max_size=20), steps=st.integers(1, 5),
       seed=st.integers(0, 2**31 - 1), fused=st.booleans(), data=st.data())
def test_batch_matches_the_per_row_reference_as_rows_come_and_go(
        rows: list, steps: int, seed: int, fused: bool, data: st.DataObject) -> None:
    """With and without the one-op sampling of steps whose rows need no filter."""
    gen = torch.Generator().manual_seed(seed)
    batch = SamplingBatch(VOCAB, CPU, (EOS,), capacity=4,  # small: it must grow
                          fused=SAMPLER if fused else None)
    ref = Reference()
    waiting = list(rows)
    for _ in range(steps):
        if not waiting and not ref.rows:
            break
        # Some rows leave, some join a free slot (the lowest: slots are reused).
        for s in data.draw(st.lists(st.sampled_from(sorted(ref.rows)), unique=True)
                           if ref.rows else st.just([])):
            batch.remove(s)
            del ref.rows[s]
        for _ in range(data.draw(st.integers(0 if ref.rows or not waiting else 1,
                                             len(waiting)))):
            p, prompt, output = waiting.pop()
            s = min(set(range(len(ref.rows) + 1)) - set(ref.rows))
            batch.add(s, SamplingState(p, prompt, output))
            ref.rows[s] = (p, list(prompt), list(output))
        if not ref.rows:
            continue
        slots = np.asarray(data.draw(st.permutations(sorted(ref.rows))), dtype=np.int64)
        ref.check_step(batch, torch.randn(len(slots), VOCAB, generator=gen) * 3, slots)
    assert len(batch) == len(ref.rows)


def test_a_reused_slot_keeps_nothing_of_the_row_that_left() -> None:
    batch = SamplingBatch(8, CPU, (EOS,), capacity=1)
    both = {"repetition_penalty": 2.0, "presence_penalty": 1.0, "temperature": 0.0}
    batch.add(0, SamplingState(SamplingParams(**both), (1, 2)))
    slots = np.zeros(1, dtype=np.int64)
    tokens, token_list, _, _ = batch.sample(torch.arange(8.0)[None], slots)
    batch.commit(slots, tokens, token_list)
    assert token_list == [7]
    batch.remove(0)
    batch.add(0, SamplingState(SamplingParams(**both), (5,)))
    logits = torch.ones(1, 8)
    batch.process(logits, slots)
    # Only its own prompt id is penalized: not 1, 2 (the old prompt), not 7 (its output).
    assert logits.tolist() == [[1, 1, 1, 1, 1, 0.5, 1, 1]]
    # An id the old row had seen is news to this one when it makes it.
    batch.commit(slots, torch.tensor([1]), [1])
    logits = torch.ones(1, 8)
    batch.process(logits, slots)
    assert logits.tolist() == [[1, -0.5, 1, 1, 1, 0.5, 1, 1]]  # 1: 1 / 2 - presence 1
    # A row without penalties in that slot, then one with: still a clean history.
    batch.remove(0)
    batch.add(0, SamplingState(SamplingParams(temperature=0.0), (1, 2, 3)))
    batch.commit(slots, torch.tensor([6]), [6])
    batch.remove(0)
    batch.add(0, SamplingState(SamplingParams(**both), (4,)))
    logits = torch.ones(1, 8)
    batch.process(logits, slots)
    assert logits.tolist() == [[1, 1, 1, 1, 0.5, 1, 1, 1]]


def test_long_histories_widen_the_id_lists() -> None:
    vocab = 700
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, temperature=0.0)
    prompt = list(range(0, 600, 2))  # 300 distinct ids: past the first width
    batch = SamplingBatch(vocab, CPU, (), capacity=1)
    batch.add(70, SamplingState(p, prompt))  # past the capacity: the batch grows
    slots = np.asarray([70])
    output: list[int] = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        logits = torch.randn(1, vocab, generator=gen)
        processed = logits.clone()
        batch.process(processed, slots)
        assert torch.equal(processed[0], reference_process(logits[0], p, prompt, output))
        tokens, token_list, _, _ = batch.sample(logits, slots)
        batch.commit(slots, tokens, token_list)
        output += token_list


# Drawn by the sampler before the persistent batch (one SamplingState per row, sampled
# with sampler.sample), for rows seeded 7, 11, 3 and 99: seeded draws must not change.
_SEEDED = [dict(temperature=1.0, seed=7), dict(temperature=0.8, top_k=5, seed=11),
           dict(temperature=1.2, top_p=0.9, repetition_penalty=1.3, seed=3),
           dict(temperature=1.0, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.2,
                seed=99)]
_SEEDED_TOKENS = [[44, 43, 14, 1], [3, 0, 15, 39], [38, 20, 10, 43], [24, 3, 37, 5],
                  [9, 37, 17, 18], [6, 25, 6, 33]]


def test_seeded_rows_draw_what_they_drew_before_the_persistent_batch() -> None:
    batch = SamplingBatch(50, CPU, (EOS,))
    slots = np.asarray([9, 2, 30, 4])  # any slots, in any order
    for slot, params in zip(slots.tolist(), _SEEDED, strict=True):
        batch.add(slot, SamplingState(SamplingParams(**params), (1, 2, 3, 4), (5,)))
    got = []
    for step in range(6):
        logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1234 + step)) * 2
        tokens, token_list, _, _ = batch.sample(logits, slots)
        batch.commit(slots, tokens, token_list)
        got.append(token_list)
    assert got == _SEEDED_TOKENS


def test_a_row_without_top_k_does_not_lift_the_others_top_k() -> None:
    """Regression: with no top_p or min_p in the batch, a row with no top_k made the whole
    batch skip the filter, so a top_k=1 row drew from its whole vocabulary."""
    batch = SamplingBatch(VOCAB, CPU, (EOS,))
    batch.add(0, SamplingState(SamplingParams(temperature=1.0), [1]))
    batch.add(1, SamplingState(SamplingParams(temperature=1.0, top_k=1), [1]))
    batch.add(2, SamplingState(SamplingParams(temperature=0.6, top_k=3), [1]))
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(3, VOCAB, generator=gen) * 3
        tokens = batch.sample(logits, np.arange(3))[1]
        assert tokens[1] == int(logits[1].argmax())
        assert tokens[2] in logits[2].topk(3).indices.tolist()


@settings(max_examples=examples(60), deadline=None)
@given(rows=st.lists(_row, min_size=1, max_size=8), data=st.data())
def test_the_plain_column_shortcut_decides_as_the_full_checks(
        rows: list[tuple[SamplingParams, list[int], list[int]]], data: st.DataObject) -> None:
    """op_temperatures' shortcut (every row ``plain``) gives what its full checks give."""
    batch = SamplingBatch(VOCAB, CPU, (EOS,), fused=lambda *a: None)
    for slot, (p, prompt, output) in enumerate(rows):
        batch.add(slot, SamplingState(p, prompt, output))
    order = data.draw(st.permutations(range(len(rows))))
    cases = [np.array(order, dtype=np.int64)] + [np.array([s]) for s in range(len(rows))]
    got = [batch.op_temperatures(slots) for slots in cases]
    batch.cols["plain"][:] = False  # the full checks alone
    for slots, mine in zip(cases, got, strict=True):
        full = batch.op_temperatures(slots)
        assert (mine is None) == (full is None), rows[int(slots[0])][0]
        assert mine is None or np.array_equal(mine, full)
