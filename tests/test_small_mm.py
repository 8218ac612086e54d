"""The decode op's GEMM for a few rows (kernels/cpu_small_mm.h), which ``actorllm::linear``
and so both the op's linears and PackedLinear take at 2 to 32 fp32 rows where the op's
widest vector body is AVX2: against float64 arithmetic, row by row the same whatever the
rows beside it, and not taken where it does not apply."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers import vector_body
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples
from torch import nn

from actorllm.ops import cpu_step
from actorllm.ops.cpu_linear import SMALL_ROWS, PackedLinear, pack_linears

cpu_step.load_op_library()  # raises, saying why, where the op cannot be built here
linear = torch.ops.actorllm.linear


@pytest.fixture
def avx2() -> Iterator[None]:
    """The op capped at its AVX2 body (where small_mm runs); skipped on a CPU without it."""
    with vector_body(1):
        yield


def _case(rows: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g), torch.randn(k, n, generator=g),
            torch.randn(n, generator=g))


@pytest.mark.usefixtures("avx2")
@settings(max_examples=examples(60), deadline=None)
@given(rows=st.integers(2, 32), k=st.integers(1, 300), n=st.integers(1, 80),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_small_rows_match_float64(rows: int, k: int, n: int, bias: bool, seed: int) -> None:
    """Every tile shape (1-4 rows, 1-3 vectors, a column tail of 1-7 lanes or none)."""
    x, w, b = _case(rows, k, n, seed)
    got = linear(x, w, b if bias else None)
    want = x.double() @ w.double() + (b.double() if bias else 0)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.usefixtures("avx2")
@pytest.mark.parametrize(("k", "n"), [(256, 384), (256, 1408), (704, 256), (64, 4096)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(k: int, n: int) -> None:
    """Bit for bit: each element is the same chain of FMAs at any row count, tile and
    thread (a seeded row's logits do not move with the batch), at the embedded and the
    near-zero model's shapes."""
    x, w, b = _case(32, k, n, seed=k + n)
    whole = linear(x, w, b)
    for rows in SMALL_ROWS:
        for start in (0, 32 - rows):
            part = linear(x[start:start + rows].contiguous(), w, b)
            assert torch.equal(part, whole[start:start + rows]), (rows, start)


@pytest.mark.parametrize("rows", [1, 2, 32, 33, 64])
def test_elsewhere_the_op_makes_the_modules_mm_call(rows: int) -> None:
    """One row, more than 32, or the plain body (as on a CPU without AVX2): MKL's mm and
    addmm, bit for bit."""
    x, w, b = _case(rows, 96, 200, seed=rows)
    with vector_body(0):
        assert torch.equal(linear(x, w, None), torch.mm(x, w))
        assert torch.equal(linear(x, w, b), torch.addmm(b, x, w))
    if rows not in SMALL_ROWS:
        assert torch.equal(linear(x, w, b), torch.addmm(b, x, w))


@pytest.mark.usefixtures("avx2")
def test_packed_linear_takes_the_ops_linear_at_a_few_rows() -> None:
    """pack_linears hands its PackedLinears the op: at 2-32 rows the module computes what
    the op's linear does (so the op's steps and the module's agree bit for bit), at other
    row counts what mm does."""
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 40, bias=False))
    assert pack_linears(model) == 2
    first = model[0]
    assert isinstance(first, PackedLinear) and first.op is not None
    for rows in (1, 2, 9, 32, 33):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            got = first(x)
        want = linear(x, first.packed_weight, first.bias) if rows in SMALL_ROWS \
            else torch.addmm(first.bias, x, first.packed_weight)
        assert torch.equal(got, want), rows
