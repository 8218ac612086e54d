"""The one-op sampling of a step without filters (ops/cpu_step.sample_rows) against the
torch ops it replaces: argmax exactly, the draw as the same inverse CDF over the unsorted
row (at given uniforms, and in distribution at a fixed seed), and the SamplingBatch
choosing it only where it applies."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from helpers import vector_body

from actorllm.ops import cpu_step
from actorllm.ops.cpu_step import sample_rows
from actorllm.wire.messages import SamplingParams
from actorllm.worker.filters import GREEDY_BELOW
from actorllm.worker.sampling_batch import SamplingBatch, SamplingState

cpu_step.load_op_library()  # raises, saying why, where the op cannot be built here
INF = float("inf")


@pytest.fixture(params=[2, 1, 0], ids=["avx512", "avx2", "plain"])
def each_body(request: pytest.FixtureRequest) -> Iterator[None]:
    """The op's draw and argmax in each vector body this CPU has (AVX-512, AVX2, the
    plain loops): the op takes the widest, so a test of it alone would try one."""
    with vector_body(request.param):
        yield


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return sample_rows(logits, torch.zeros(logits.shape[0]), GREEDY_BELOW)


@pytest.mark.usefixtures("each_body")
def test_greedy_rows_are_torch_argmax_ties_infinities_and_nans_included() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g)
    logits[1] = 0.0  # all tied: the first
    logits[2, 7] = logits[2, 9] = 50.0  # a tie at the top: the first of them
    logits[3] = -INF  # nothing finite
    logits[4, 5] = INF
    logits[5, 11] = float("nan")  # a NaN wins, as in torch
    logits[6, 0] = float("nan")
    logits[6, 20] = float("nan")
    assert torch.equal(_greedy(logits), logits.argmax(dim=-1))


@pytest.mark.usefixtures("each_body")
@pytest.mark.parametrize("vocab", [1000, 1003])  # 1003: a partial vector of 8 at the end
def test_the_draw_is_the_inverse_cdf_at_the_given_uniforms(vocab: int) -> None:
    g = torch.Generator().manual_seed(1)
    rows = 200  # and vocab not a multiple of the op's chunk
    logits = torch.randn(rows, vocab, generator=g) * 4
    temps = torch.rand(rows, generator=g) * 1.5 + 0.2
    u = torch.rand(rows, generator=g)
    tokens = sample_rows(logits, temps, GREEDY_BELOW, u).tolist()
    # In float64: the token is where 1 - u falls in the row's cumulative distribution,
    # up to the float32 rounding of the op's sums.
    cdf = torch.softmax(logits.double() / temps.double()[:, None], dim=-1).cumsum(dim=-1)
    target = (1 - u.double()).tolist()
    for i, t in enumerate(tokens):
        before = 0.0 if t == 0 else float(cdf[i, t - 1])
        assert before - 1e-5 <= target[i] <= float(cdf[i, t]) + 1e-5, (i, t)


@pytest.mark.usefixtures("each_body")
def test_the_draw_matches_the_distribution_chi_square() -> None:
    torch.manual_seed(2)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, -INF])
    temperature = 0.8
    n = 40_000
    tokens = sample_rows(logits.expand(n, -1), torch.full((n,), temperature), GREEDY_BELOW)
    counts = torch.bincount(tokens, minlength=8).double()
    assert counts[7] == 0  # probability 0: never drawn
    expected = torch.softmax(logits / temperature, dim=-1).double()[:7] * n
    chi2 = float(((counts[:7] - expected) ** 2 / expected).sum())
    assert chi2 < 22.46  # 6 degrees of freedom, p = 0.001


@pytest.mark.usefixtures("each_body")
def test_masked_tokens_are_never_drawn_and_a_row_with_none_left_takes_the_argmax() -> None:
    torch.manual_seed(3)
    logits = torch.randn(500, 64)
    logits[:, ::2] = -INF
    logits[0] = -INF
    tokens = sample_rows(logits, torch.ones(500), GREEDY_BELOW)
    assert tokens[0] == 0
    assert (tokens[1:] % 2 == 1).all()


@pytest.mark.usefixtures("each_body")
@pytest.mark.parametrize("vocab", [1000, 1003])
def test_a_drawn_row_with_a_nan_or_an_infinity_takes_the_argmax(vocab: int) -> None:
    """The op's draw has no softmax to turn a NaN or +inf into NaN weights: it must still
    give the argmax for such rows, wherever in a 16- or 8-lane vector the value lies."""
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5))
    logits[0, vocab - 1] = float("nan")  # the tail of the last vector
    logits[1, 0] = float("nan")
    logits[2, 517] = INF
    logits[3, 3] = logits[3, 900] = INF
    logits[4, 64] = float("nan")
    logits[4, 65] = INF
    tokens = sample_rows(logits, torch.full((6,), 0.7), GREEDY_BELOW)
    assert tokens[:5].tolist() == logits[:5].argmax(dim=-1).tolist()
    assert 0 <= int(tokens[5]) < vocab


@pytest.mark.usefixtures("each_body")
def test_greedy_and_drawn_rows_mix_in_one_call() -> None:
    torch.manual_seed(4)
    logits = torch.randn(6, 50)
    temps = torch.tensor([0.0, 1.0, 0.0, 0.5, 1e-6, 2.0])
    tokens = sample_rows(logits, temps, GREEDY_BELOW)
    for i in (0, 2, 4):
        assert tokens[i] == logits[i].argmax()


def _batch(params: list[SamplingParams], vocab: int = 32) -> SamplingBatch:
    batch = SamplingBatch(vocab, torch.device("cpu"), (3,), fused=sample_rows)
    for slot, p in enumerate(params):
        batch.add(slot, SamplingState(p, [5, 6]))
    return batch


@pytest.mark.parametrize("params, fused", [
    ([SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)], True),
    ([SamplingParams(temperature=0.7, seed=9), SamplingParams(temperature=1.0)], True),
    ([SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0)], False),
    ([SamplingParams(temperature=1.0, top_k=4)], False),
    ([SamplingParams(temperature=1.0, min_p=0.1)], False),
    ([SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(temperature=1.0)], True),
])
def test_the_batch_uses_the_op_only_where_no_drawn_row_filters(
        params: list[SamplingParams], fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    batch = _batch(params)
    calls: list[int] = []

    def counting(*args: object) -> torch.Tensor:
        calls.append(1)
        return sample_rows(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(batch, "fused", counting)
    batch.sample(torch.randn(len(params), 32), np.arange(len(params)))
    assert bool(calls) == fused


def test_a_seeded_row_draws_the_same_with_and_without_the_op() -> None:
    params = [SamplingParams(temperature=0.9, seed=42), SamplingParams(temperature=1.0)]
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(5)) * 3
    plain = SamplingBatch(32, torch.device("cpu"), (3,))
    for slot, p in enumerate(params):
        plain.add(slot, SamplingState(p, [5, 6]))
    fused = _batch(params)
    for _ in range(20):
        slots = np.arange(2)
        a, la, _, _ = plain.sample(logits, slots)
        _, lb, _, _ = fused.sample(logits, slots)
        assert la[0] == lb[0]
        plain.commit(slots, a, la)
        fused.commit(slots, torch.tensor([lb[0], la[1]]), [lb[0], la[1]])


@pytest.mark.parametrize("params, op", [
    ([SamplingParams(temperature=1.0), SamplingParams(temperature=0.0, seed=3)], True),
    ([SamplingParams(temperature=0.0, top_k=2), SamplingParams(temperature=0.5)], True),
    ([SamplingParams(temperature=1.0, seed=3)], False),
    ([SamplingParams(temperature=1.0, top_p=0.9)], False),
    ([SamplingParams(temperature=1.0, logprobs=0)], False),
    ([SamplingParams(temperature=0.0, repetition_penalty=1.1)], False),
    ([SamplingParams(temperature=1.0, logit_bias=((1, 2.0),))], False),
    ([SamplingParams(temperature=1.0, min_tokens=2)], False),
])
def test_the_decode_op_draws_only_rows_nothing_else_touches(
        params: list[SamplingParams], op: bool) -> None:
    temps = _batch(params).op_temperatures(np.arange(len(params)))
    assert (temps is not None) == op
    if temps is not None:  # a greedy row's temperature is 0 whatever it asked
        assert temps.tolist() == [0.0 if p.temperature < GREEDY_BELOW else p.temperature
                                  for p in params]
    plain = SamplingBatch(32, torch.device("cpu"), (3,))
    plain.add(0, SamplingState(SamplingParams(temperature=1.0), [5]))
    assert plain.op_temperatures(np.arange(1)) is None  # no op: never


@pytest.mark.usefixtures("each_body")
def test_greedy_rows_match_argmax_at_every_lane_of_a_wide_row() -> None:
    """The vectorized argmax: a top value, a tie or a NaN in each lane position, the tail
    of a vocabulary that is not a multiple of sixteen, and zeros of both signs."""
    g = torch.Generator().manual_seed(5)
    vocab = 4099
    logits = torch.randn(40, vocab, generator=g)
    for row, j in enumerate([0, 1, 15, 16, 17, 31, 4095, 4096, 4098, 2047]):
        logits[row, j] = 9.0  # a unique top
        logits[10 + row, j] = logits[10 + row, (j + 33) % vocab] = 9.0  # a tie
        logits[20 + row, j] = float("nan")
    logits[30] = -INF
    logits[31] = 0.0
    logits[31, 5] = -0.0
    logits[32, 100] = logits[32, 50] = INF
    logits[33, 4098] = logits[33, 3] = float("nan")
    assert torch.equal(_greedy(logits), logits.argmax(dim=-1))


@pytest.mark.usefixtures("each_body")
@pytest.mark.parametrize("vocab", [64, 1000, 4096])
def test_a_draw_at_the_top_of_the_cdf_takes_a_token_of_weight_near_the_end(vocab: int) -> None:
    """1 - u = 1 puts the target at the row's total, where float rounding can leave the
    scan short of it: the op then takes the last token of positive weight, never a masked
    one."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=g) * 3
    logits[:, vocab // 2 :] = -INF  # the tail chunks weigh nothing
    logits[1, 1:] = -INF  # one token left
    tokens = sample_rows(logits, torch.ones(64), GREEDY_BELOW, torch.zeros(64))
    cdf = torch.softmax(logits.double(), dim=-1).cumsum(dim=-1)
    for i, t in enumerate(tokens.tolist()):
        assert logits[i, t] > -INF, (i, t)
        assert float(cdf[i, t]) >= 1 - 1e-5, (i, t)  # what weight lies after t is rounding's
    assert tokens[1] == 0
