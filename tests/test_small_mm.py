"""The decode op's own GEMM (kernels/cpu_small_mm.h), which ``actorllm::linear`` and so
both the op's linears and PackedLinear take where MKL is weak (``own_gemm``: the op's
widest vector body AVX2, or AVX-512 on a CPU that is not Intel's): at
2 to 32 fp32 rows of an ``[in, out]`` weight, and at every row count of a weight laid out
in panels ``[out / 16, in, 16]``. Against float64 arithmetic, row by row the same whatever
the rows beside it, and not taken where it does not apply."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from helpers import vector_body
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples
from torch import nn

from actorllm.ops import cpu_step
from actorllm.ops.cpu_linear import PANEL, SMALL_ROWS, PackedLinear, pack_linears

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


def _panels(w: torch.Tensor) -> torch.Tensor:
    """``w`` [in, out] laid out as PackedLinear lays an fp32 weight in panels."""
    k, n = w.shape
    return w.t().reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


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
@settings(max_examples=examples(60), deadline=None)
@given(rows=st.integers(1, 200), k=st.integers(1, 300), tiles=st.integers(1, 6),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_panels_match_float64(rows: int, k: int, tiles: int, bias: bool, seed: int) -> None:
    """Any row count (one to six rows a tile, the last tile short), any input width."""
    x, w, b = _case(rows, k, PANEL * tiles, seed)
    got = linear(x, _panels(w), b if bias else None)
    want = x.double() @ w.double() + (b.double() if bias else 0)
    assert got.shape == (rows, PANEL * tiles) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.usefixtures("avx2")
def test_panels_past_a_block_of_rows_match_float64() -> None:
    """Rows past a block (x's first MiB: 52 rows at 5,000 wide) take another pass over
    the weight."""
    x, w, b = _case(130, 5000, 48, seed=7)
    got = linear(x, _panels(w), b)
    torch.testing.assert_close(got.double(), x.double() @ w.double() + b.double(),
                               rtol=1e-5, atol=1e-5 * 5000 ** 0.5)


@pytest.mark.usefixtures("avx2")
@pytest.mark.parametrize(("k", "n"), [(256, 384), (256, 1408), (704, 256), (64, 4096)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(k: int, n: int) -> None:
    """Bit for bit: each element is the same chain of FMAs at any row count, tile and
    thread (a seeded row's logits do not move with the batch), at the embedded and the
    near-zero model's shapes; [in, out] at 2-32 rows, panels at any."""
    x, w, b = _case(96, k, n, seed=k + n)
    whole = linear(x[:32].contiguous(), w, b)
    for rows in SMALL_ROWS:
        for start in (0, 32 - rows):
            part = linear(x[start:start + rows].contiguous(), w, b)
            assert torch.equal(part, whole[start:start + rows]), (rows, start)
    p = _panels(w)
    whole = linear(x, p, b)
    assert torch.equal(whole[:32], linear(x[:32].contiguous(), w, b))  # the same chains
    before = torch.get_num_threads()
    for rows, start in [(1, 0), (1, 95), (5, 40), (33, 63), (64, 0), (95, 1)]:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                part = linear(x[start:start + rows].contiguous(), p, b)
            finally:
                torch.set_num_threads(before)
            assert torch.equal(part, whole[start:start + rows]), (rows, start, threads)


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


def _vendor() -> str:
    """The CPU's vendor as the kernel tells it (GenuineIntel, AuthenticAMD, ...)."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return ""


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs /proc/cpuinfo")
def test_the_op_runs_its_own_gemm_where_mkl_is_weak() -> None:
    """own_gemm: the AVX2 body the widest (no AVX-512, or capped), or AVX-512 on a CPU
    that is not Intel's (MKL runs its generic kernels there); never the plain loops."""
    own = torch.ops.actorllm.own_gemm
    try:
        for body in (2, 1, 0):
            isa = torch.ops.actorllm.cap_vector_isa(body)
            want = isa == 1 or (isa == 2 and _vendor() != "GenuineIntel")
            assert own() == want, (body, isa, _vendor())
    finally:
        torch.ops.actorllm.cap_vector_isa(2)


@pytest.mark.parametrize("body", [2, 1, 0])
def test_packed_linear_takes_the_ops_linear(body: int) -> None:
    """pack_linears hands its PackedLinears the op, and, where the op runs its own GEMM
    (own_gemm: the AVX2 body the widest, or AVX-512 on a CPU not Intel's), lays out in
    panels each weight whose width is a multiple of 16: such a module computes what the
    op's linear does at every row count; an ``[in, out]`` one does at 2-32 rows where
    own_gemm holds, and what mm does at others (so the op's steps and the module's agree
    bit for bit). Loaded with the plain body (a CPU without AVX2): no panels."""
    with vector_body(body):
        own = bool(torch.ops.actorllm.own_gemm())
        model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 40, bias=False))
        assert pack_linears(model) == 2
    first, second = model
    assert isinstance(first, PackedLinear) and first.op is not None
    assert isinstance(second, PackedLinear)
    assert first.panels == own and not second.panels  # 40 is no multiple of 16
    assert first.packed_weight.shape == ((6, 64, 16) if own else (64, 96))
    for rows in (1, 2, 9, 32, 33, 100):
        x = torch.randn(rows, 96)
        with vector_body(body), torch.inference_mode():
            h = first(x[:, :64])
            got = second(x)
            want_h = linear(x[:, :64], first.packed_weight, first.bias)
            if not first.panels and rows not in SMALL_ROWS:
                want_h = torch.addmm(first.bias, x[:, :64], first.packed_weight)
            want = linear(x, second.packed_weight, None) if rows in SMALL_ROWS \
                else torch.mm(x, second.packed_weight)
        assert torch.equal(h, want_h), rows
        torch.testing.assert_close(h, nn.functional.linear(
            x[:, :64], first.packed_weight.transpose(1, 2).reshape(96, 64) if first.panels
            else first.packed_weight.t(), first.bias), rtol=1e-5, atol=1e-4)
        assert torch.equal(got, want), rows


def test_panels_the_op_cannot_run_are_refused() -> None:
    """One line naming what is wrong, not a wrong result: another input width, rows in
    another dtype, a bias of another width, panels of another width."""
    x, w, _ = _case(4, 64, 32, seed=1)
    p = _panels(w)
    with pytest.raises(RuntimeError, match="panels"):
        linear(torch.randn(4, 63), p, None)
    with pytest.raises(RuntimeError, match="panels"):
        linear(x.double(), p, None)
    with pytest.raises(RuntimeError, match="panels"):
        linear(x, p, torch.randn(16))  # a bias of another width
    with pytest.raises(RuntimeError, match="panels of 16"):
        linear(x, p.reshape(1, 64, 32).contiguous(), None)
