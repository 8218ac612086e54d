"""oneDNN linears with packed weights (actorllm/ops/cpu_linear.py) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actorllm.ops.cpu_linear import PackedLinear, bucket_rows, pack_linears, packing_available

pytestmark = pytest.mark.skipif(
    not packing_available(torch.empty(1, 1)), reason="this torch has no oneDNN linear")


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 63, 65, 300, 513, 2049])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_for_any_row_count(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        want = F.linear(x, linear.weight, linear.bias)
        got = PackedLinear(linear)(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(8, 96), (3, 8, 96), (2, 5, 96)])
def test_packed_linear_keeps_leading_dims(shape: tuple[int, ...]) -> None:
    """2-D inputs of a bucket's size skip the reshape and slice; other shapes take them."""
    torch.manual_seed(1)
    linear = nn.Linear(96, 40)
    x = torch.randn(shape)
    with torch.inference_mode():
        want = F.linear(x, linear.weight, linear.bias)
        got = PackedLinear(linear)(x)
    assert got.shape == want.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_buckets_cover_and_bound_the_row_counts() -> None:
    sizes = {bucket_rows(r) for r in range(1, 4097)}
    assert all(r <= bucket_rows(r) <= r + max(7, r // 8) for r in range(1, 4097))
    assert len(sizes) == 8 + 6 * 8  # to 64 by 8, then 8 per doubling: oneDNN's kernel cache
    assert [bucket_rows(r) for r in (1, 64, 65, 71, 128, 129, 500, 2048, 2049)] == [
        8, 64, 72, 72, 128, 144, 512, 2048, 2304]


def test_pack_linears_swaps_every_linear_and_keeps_the_output() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 16, bias=False))
    x = torch.randn(5, 32)
    with torch.inference_mode():
        want = model(x)
        assert pack_linears(model) == 2
        got = model(x)
    assert not any(type(m) is nn.Linear for m in model.modules())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
