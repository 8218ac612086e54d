"""The cuda backend's kernels against the torch reference, on a GPU.

Skipped, with the reason shown, where torch sees no GPU or CuPy cannot be imported. The
caches start as NaN and only live slots are written (with the cuda ``write_kv``), so a
kernel that reads an unwritten slot or a padded block-table entry fails loudly.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples

from actorllm.ops import TorchBackend


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    if torch.cuda.get_device_capability() < (8, 0):
        return "the cuda kernels need sm_80 or newer"
    try:
        import cupy  # noqa: F401
    except Exception as exc:
        return f"cupy is not importable: {type(exc).__name__}: {exc}"
    return None


WHY_NOT = _why_not()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

reference = TorchBackend()
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


@pytest.fixture(scope="module")
def cuda():
    from actorllm.ops.cuda_backend import CudaBackend

    return CudaBackend("cuda")


def build_case(
    backend,
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> dict:
    """Sequences ``[(seq_len, q_len), ...]`` in randomly ordered blocks of a NaN-filled cache."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    need = [math.ceil(seq_len / block_size) for seq_len, _ in specs]
    num_blocks = sum(need) + 2
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(need, default=0) + 1
    tables, slots = [], []
    for (seq_len, _), n in zip(specs, need, strict=True):
        row = [ids.pop() for _ in range(n)]
        slots += [row[j // block_size] * block_size + j % block_size for j in range(seq_len)]
        tables.append(row + [rng.choice([-1, 0, num_blocks - 1]) for _ in range(width - n)])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    total = len(slots)
    keys = torch.randn(total, num_kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    values = torch.randn(total, num_kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    backend.write_kv(
        keys, values, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64, device="cuda")
    )
    cu = [0]
    for _, q_len in specs:
        cu.append(cu[-1] + q_len)
    q = torch.randn(cu[-1], num_heads, head_dim, generator=gen, device="cuda").to(dtype)
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=torch.tensor(tables, dtype=torch.int32, device="cuda").view(len(specs), width),
        seq_lens=torch.tensor([s for s, _ in specs], dtype=torch.int32, device="cuda"),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device="cuda"),
        scale=head_dim**-0.5,
    )


def check_against_reference(cuda, case: dict, hints: bool = True, **features) -> None:
    """The kernels against the fp32 torch reference; ``features`` are ``sliding_window``
    and ``softcap``, passed to both."""
    kwargs = {}
    if hints and case["seq_lens"].numel():
        q_lens = case["cu_seqlens_q"][1:] - case["cu_seqlens_q"][:-1]
        kwargs = dict(max_seqlen_q=int(q_lens.max()), max_seqlen_k=int(case["seq_lens"].max()))
    got = cuda.paged_attention(**case, **kwargs, **features)
    fp32 = dict(case, q=case["q"].float(), k_cache=case["k_cache"].float(),
                v_cache=case["v_cache"].float())  # fmt: skip
    want = reference.paged_attention(**fp32, **features)
    assert got.shape == case["q"].shape and got.dtype == case["q"].dtype
    assert not got.isnan().any(), "NaN in the cuda output"
    tol = TOLERANCE[case["q"].dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------- fixed cases


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "specs",
    [
        [(1, 1)],  # one token
        [(16, 1), (17, 1), (15, 1), (32, 1), (33, 1), (1, 1)],  # decode around block edges
        [(64, 64), (65, 65), (1, 1), (100, 37)],  # prompts, a chunk, and a decode row
        [(300, 1), (1, 1), (4000, 1)],  # decode: very different lengths in one batch
        [(20000, 1)],  # one long sequence: split-K and the reduction
        [(20000, 1), (3000, 1), (129, 1)] * 3,  # split-K with sequences ending early
        [(1030, 250), (512, 1), (70, 70)],  # long prefill chunk after a cached prefix
    ],
)
def test_fixed_batches(cuda, dtype, specs):
    for head_dim, block_size, heads in [(128, 16, (32, 8)), (64, 32, (8, 8)), (256, 16, (8, 1))]:
        case = build_case(cuda, specs, *heads, head_dim, block_size, dtype, seed=len(specs))
        check_against_reference(cuda, case)


def test_empty_batch(cuda):
    case = build_case(cuda, [], 4, 2, 64, 16, torch.float16, seed=0)
    assert cuda.paged_attention(**case).shape == (0, 4, 64)
    cuda.write_kv(
        torch.zeros(0, 2, 64, dtype=torch.float16, device="cuda"),
        torch.zeros(0, 2, 64, dtype=torch.float16, device="cuda"),
        case["k_cache"], case["v_cache"], torch.zeros(0, dtype=torch.int64, device="cuda"),
    )  # fmt: skip


@pytest.mark.parametrize("group", [7, 16, 20, 32])
def test_wide_gqa_groups(cuda, group):
    """Groups that are not a multiple of 16, or span several head tiles, in both kernels."""
    case = build_case(cuda, [(700, 1), (90, 45), (33, 33)], 2 * group, 2, 128, 16,
                      torch.bfloat16, seed=group)  # fmt: skip
    check_against_reference(cuda, case)


def test_without_length_hints(cuda):
    case = build_case(cuda, [(50, 10), (5000, 1)], 16, 4, 128, 32, torch.float16, seed=3)
    check_against_reference(cuda, case, hints=False)


def test_query_slice_of_fused_qkv(cuda):
    """q with a token stride wider than its heads (a view into a QKV projection)."""
    case = build_case(cuda, [(40, 40), (77, 1)], 8, 2, 64, 16, torch.float16, seed=4)
    qkv = torch.randn(case["q"].shape[0], (8 + 4) * 64, device="cuda").half()
    qkv[:, : 8 * 64] = case["q"].reshape(-1, 8 * 64)
    strided = dict(case, q=qkv[:, : 8 * 64].view(-1, 8, 64))
    got = cuda.paged_attention(**strided)
    torch.testing.assert_close(got, cuda.paged_attention(**case), atol=0, rtol=0)


# ---------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_write_kv_matches_reference(cuda, dtype):
    heads, dim, block_size, tokens = 4, 128, 16, 50
    gen = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(tokens, (8 + 2 * heads) * dim, generator=gen, device="cuda").to(dtype)
    key = qkv[:, 8 * dim : (8 + heads) * dim].view(tokens, heads, dim)  # strided views
    value = qkv[:, (8 + heads) * dim :].view(tokens, heads, dim)
    slots = torch.randperm(10 * block_size, generator=gen, device="cuda")[:tokens]
    slots[::7] = -1
    caches = [torch.zeros(10, block_size, heads, dim, dtype=dtype, device="cuda") for _ in "kvKV"]
    cuda.write_kv(key, value, caches[0], caches[1], slots)
    reference.write_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


# ---------------------------------------------------------------------------- hypothesis


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([16, 32]))
    edge = st.sampled_from([1, block_size - 1, block_size, block_size + 1, 4 * block_size])
    specs = []
    for _ in range(draw(st.integers(1, 6))):
        seq_len = draw(st.one_of(edge, st.integers(1, 3000)))
        q_len = draw(st.one_of(st.just(1), st.just(seq_len), st.integers(1, seq_len)))
        specs.append((seq_len, q_len))
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4, 5, 8, 16]))
    return dict(
        specs=specs,
        num_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from([64, 128, 256])),
        block_size=block_size,
        dtype=draw(st.sampled_from([torch.float16, torch.bfloat16])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=examples(60), deadline=None)
@given(params=batches())
def test_hypothesis_batches(cuda, params):
    check_against_reference(cuda, build_case(cuda, **params))


# ---------------------------------------------------------------------------- window, soft-cap


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "window, cap",
    [(1, None), (100, None), (4096, None), (None, 50.0), (None, 2.0), (700, 30.0)],
)
def test_window_and_softcap_fixed_batches(cuda, dtype, window, cap):
    """Windows of one key, mid-tile, and wider than some contexts; caps loose and binding;
    decode rows (split-K included), whole prompts and chunks over a cached prefix."""
    specs = [(20000, 1), (300, 1), (1, 1), (64, 64), (1030, 250), (100, 37), (5000, 1)]
    for head_dim, block_size, heads in [(128, 16, (32, 8)), (256, 32, (8, 1)), (64, 16, (4, 4))]:
        case = build_case(cuda, specs, *heads, head_dim, block_size, dtype, seed=7)
        check_against_reference(cuda, case, sliding_window=window, softcap=cap)
        check_against_reference(cuda, case, hints=False, sliding_window=window, softcap=cap)


@st.composite
def featured_batches(draw):
    params = draw(batches())
    window = draw(st.one_of(st.none(), st.integers(1, 3200),
                            st.sampled_from([1, 15, 16, 17, 63, 64, 65])))
    cap = draw(st.one_of(st.none(), st.sampled_from([1.0, 10.0, 30.0, 50.0])))
    return params, window, cap


@settings(max_examples=examples(60), deadline=None)
@given(example=featured_batches())
def test_hypothesis_window_and_softcap(cuda, example):
    params, window, cap = example
    check_against_reference(cuda, build_case(cuda, **params), sliding_window=window,
                            softcap=cap)
