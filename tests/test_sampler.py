"""The sampler on hand-made logits: greedy, filters, seeds, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from actorllm.wire.messages import SamplingParams
from actorllm.worker.sampler import SamplingState, process_logits, sample, step_seed

EOS = 3


def state(prompt: tuple[int, ...] = (), output: tuple[int, ...] = (), **params) -> SamplingState:
    return SamplingState(SamplingParams(**params), prompt, output)


def tokens(logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
    return [t for t, _ in sample(logits, states, (EOS,))]


def random_logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax():
    logits = random_logits(6)
    assert tokens(logits, [state(temperature=0.0) for _ in range(6)]) == logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy():
    logits = random_logits(4)
    states = [state(temperature=1.0, top_k=1, seed=s if s % 2 else None) for s in range(4)]
    assert tokens(logits, states) == logits.argmax(-1).tolist()


def test_empty_batch():
    assert sample(torch.empty(0, 10), [], ()) == []


def test_seeded_row_ignores_the_rest_of_the_batch():
    logits = random_logits(5)
    row = logits[2:3]
    for seed in range(20):
        alone = tokens(row, [state(temperature=1.0, seed=seed, top_p=0.9)])
        others = [
            state(temperature=0.7, seed=seed + 100),
            state(temperature=0.0),
            state(temperature=1.0, seed=seed, top_p=0.9),
            state(temperature=1.3, top_k=5),
            state(temperature=1.0, logprobs=3),
        ]
        assert tokens(logits, others)[2] == alone[0]


def test_seeded_draw_depends_on_seed_and_position_only():
    row = torch.zeros(1, 50)  # uniform: any structure in the draws comes from the generator
    by_seed = {tokens(row, [state(temperature=1.0, seed=s)])[0] for s in range(20)}
    assert len(by_seed) > 5
    by_position = {
        tokens(row, [state(output=(7,) * n, temperature=1.0, seed=1)])[0] for n in range(20)
    }
    assert len(by_position) > 5
    # Recreated state (as after preemption) with the same history: the same draw.
    first = tokens(row, [state(prompt=(1, 2), output=(9, 9, 9), temperature=1.0, seed=5)])
    again = tokens(row, [state(prompt=(4,), output=(8, 8, 8), temperature=1.0, seed=5)])
    assert first == again


def test_step_seed_spreads():
    seeds = {step_seed(s, p) for s in range(30) for p in range(30)}
    assert len(seeds) == 900 and all(0 <= x < 2**64 for x in seeds)


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    counts = torch.bincount(
        torch.tensor(tokens(logits, [state(temperature=1.0)] * 4000)), minlength=4
    )
    expected = torch.softmax(logits[0], -1) * 4000
    assert ((counts - expected).abs() < 5 * expected.sqrt() + 5).all(), (counts, expected)


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(400, 1)
    probs = torch.softmax(logits[0], -1)  # about .64 .23 .09 .03 .01 .00

    def support(**params) -> set[int]:
        return set(tokens(logits, [state(temperature=1.0, **params)] * 400))

    assert support(top_k=2) == {0, 1}
    assert support(top_p=0.8) == {0, 1}  # .64 < .8, .64 + .23 >= .8
    assert support(top_p=0.5) == {0}
    assert support(min_p=0.1) == {0, 1, 2}  # keeps p >= .064
    assert support(min_p=0.2) == {0, 1}  # keeps p >= .128
    assert support(top_k=3, top_p=0.99) == {0, 1, 2}
    assert probs[2] > 0.05  # so {0, 1} above is not an accident of tiny probabilities


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    s = state(prompt=(0, 1), output=(2,), repetition_penalty=2.0)
    out = process_logits(logits.clone(), [s], ())
    assert out.tolist() == [[1.0, -4.0, 0.5, -1.0, 0.5]]


def test_presence_and_frequency_penalties_count_output_only():
    logits = torch.zeros(1, 5)
    s = state(prompt=(4, 4), output=(1, 2, 2, 2), presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits.clone(), [s], ())
    assert out.tolist() == [[0.0, -0.75, -1.25, 0.0, 0.0]]
    s.append(1)  # the state keeps its counts current
    assert process_logits(logits.clone(), [s], ()).tolist() == [[0.0, -1.0, -1.25, 0.0, 0.0]]


def test_logit_bias_adds_and_steers_greedy():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    s = state(logit_bias=((0, 5.0), (2, -1.5)), temperature=0.0)
    assert process_logits(logits.clone(), [s], ()).tolist() == [[6.0, 2.0, 1.5]]
    assert tokens(logits, [s]) == [0]


def test_untouched_rows_stay_exact():
    logits = random_logits(3)
    states = [state(), state(repetition_penalty=1.5, prompt=(1,)), state()]
    out = process_logits(logits.clone(), states, (EOS,))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert not torch.equal(out[1], logits[1])


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0, 2.0]])  # eos (3) first, stop id 2 second

    def greedy(output: tuple[int, ...], **params) -> int:
        return tokens(logits, [state(output=output, temperature=0.0, **params)])[0]

    assert greedy((), min_tokens=2) == 2
    assert greedy((), min_tokens=2, stop_token_ids=(2,)) == 4
    assert greedy((7, 7), min_tokens=2, stop_token_ids=(2,)) == EOS  # reached: no mask
    assert greedy((), min_tokens=1, ignore_eos=True) == EOS  # eos is not a stop here
    assert greedy((), min_tokens=1, ignore_eos=True, stop_token_ids=(3,)) == 2


def test_logprobs_are_raw_log_softmax_with_sorted_top():
    logits = random_logits(3, vocab=30)
    states = [
        state(temperature=0.5, repetition_penalty=2.0, prompt=(1, 2, 3), logprobs=4, seed=1),
        state(temperature=0.0, logprobs=0),
        state(temperature=0.0),
    ]
    out = sample(logits, states, (EOS,))
    raw = torch.log_softmax(logits, -1)
    for (tok, lp), row in zip(out[:2], raw, strict=False):
        assert lp is not None and lp.token_id == tok
        assert math.isclose(lp.logprob, row[tok].item(), abs_tol=1e-6)
    top = out[0][1].top
    assert [t for t, _ in top] == raw[0].topk(4).indices.tolist()
    assert [v for _, v in top] == pytest.approx(raw[0].topk(4).values.tolist(), abs=1e-6)
    assert out[1][1].top == ()
    assert out[2][1] is None


def test_sample_does_not_touch_inputs():
    logits = random_logits(2)
    before = logits.clone()
    states = [state(repetition_penalty=3.0, prompt=(1,)), state(logit_bias=((2, 1.0),))]
    sample(logits, states, (EOS,))
    assert torch.equal(logits, before)
    assert states[0].output_token_ids == [] and states[1].output_token_ids == []
