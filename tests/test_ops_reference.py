"""The torch reference attention backend against naive per-sequence attention.

The oracle below reads the paged cache one position at a time and computes
attention in float64 with explicit loops over heads, so it shares no code (and
no masking trick) with ``actorllm.ops.torch_backend``.
"""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples

from actorllm.ops import BackendUnavailable, TorchBackend, checks, select_backend

backend = TorchBackend()


# ---------------------------------------------------------------------------- fixtures


def make_case(
    specs: list[tuple[int, int]],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    extra_blocks: int = 3,
) -> dict:
    """A batch of sequences ``specs = [(seq_len, q_len), ...]`` over a randomly paged cache.

    Blocks are handed out in random order; the whole cache (unused slots too) holds random
    values, and block-table padding holds -1 or a random valid id, so anything read past a
    sequence's length would show in the result.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [math.ceil(L / block_size) for L, _ in specs]
    num_blocks = sum(need) + extra_blocks
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    max_blocks = max(need, default=0) + 2
    tables = []
    for n in need:
        row = [ids.pop() for _ in range(n)]
        row += [rng.choice([-1, rng.randrange(num_blocks)]) for _ in range(max_blocks - n)]
        tables.append(row)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    q_lens = [ql for _, ql in specs]
    cu = [0]
    for ql in q_lens:
        cu.append(cu[-1] + ql)
    q = torch.randn(cu[-1], num_heads, head_dim, generator=gen).to(dtype)
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=torch.tensor(tables, dtype=torch.int32).reshape(len(specs), max_blocks),
        seq_lens=torch.tensor([L for L, _ in specs], dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def naive_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale):
    """Per sequence, per head attention in float64, reading the cache slot by slot."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(seq_lens.shape[0]):
        L = int(seq_lens[s])
        start, end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        q_len = end - start
        slots = [(int(block_tables[s, j // block_size]), j % block_size) for j in range(L)]
        k = torch.stack([k_cache[b, o] for b, o in slots]).double()  # [L, Hkv, D]
        v = torch.stack([v_cache[b, o] for b, o in slots]).double()
        for h in range(q.shape[1]):
            kv = h // group
            for i in range(q_len):
                pos = L - q_len + i
                scores = (k[: pos + 1, kv] @ q[start + i, h].double()) * scale
                out[start + i, h] = torch.softmax(scores, 0) @ v[: pos + 1, kv]
    return out


def run_both(case: dict, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    got = backend.paged_attention(**case, **kwargs)
    want = naive_attention(**case)
    return got, want


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------- attention


@pytest.mark.parametrize(
    "specs",
    [
        [(1, 1)],  # a one-token sequence
        [(16, 1), (17, 1), (15, 1), (32, 1), (1, 1)],  # decode on/off block boundaries
        [(33, 33)],  # whole prompt, no prefix
        [(40, 8)],  # prefill chunk after a cached prefix
        [(32, 16), (5, 1), (48, 48), (17, 1), (20, 3)],  # mixed prefill chunks + decode
    ],
)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
def test_matches_naive(specs, heads):
    case = make_case(specs, num_heads=heads[0], num_kv_heads=heads[1])
    got, want = run_both(case)
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    case = make_case([(40, 8), (9, 1), (16, 1), (16, 16)], dtype=dtype, seed=3)
    got, want = run_both(case)
    assert_close(got, want, dtype)


def test_block_size_32_and_large_head():
    case = make_case([(70, 1), (64, 1), (90, 30)], head_dim=128, block_size=32, seed=5)
    got, want = run_both(case)
    assert_close(got, want, torch.float32)


def test_empty_batch():
    case = make_case([])
    out = backend.paged_attention(**case)
    assert out.shape == (0, 4, 16)


def test_decode_hints_skip_host_reads():
    """max_seqlen_q == 1 with max_seqlen_k (an upper bound) takes the sync-free decode path."""
    case = make_case([(16, 1), (3, 1), (40, 1)], seed=7)
    want = naive_attention(**case)
    got = backend.paged_attention(**case, max_seqlen_q=1, max_seqlen_k=64)
    assert_close(got, want, torch.float32)


def test_host_metadata_is_used():
    case = make_case([(20, 4), (7, 1)], seed=8)
    want = naive_attention(**case)
    got = backend.paged_attention(**case, seq_lens_host=[20, 7], cu_seqlens_q_host=[0, 4, 5])
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("specs", [[(5, 1), (18, 2)], [(5, 1), (18, 1), (1, 1)]])
def test_no_nan_from_garbage_cache(specs):
    """Slots no live position maps to hold NaN/inf (like torch.empty memory): no leak."""
    case = make_case(specs, seed=9, extra_blocks=4)
    block_size = case["k_cache"].shape[1]
    live = {
        (int(case["block_tables"][s, j // block_size]), j % block_size)
        for s, (seq_len, _) in enumerate(specs)
        for j in range(seq_len)
    }
    for b in range(case["k_cache"].shape[0]):
        for o in range(block_size):
            if (b, o) not in live:
                case["k_cache"][b, o] = float("nan")
                case["v_cache"][b, o] = float("inf")
    got, want = run_both(case)
    assert not got.isnan().any()
    assert_close(got, want, torch.float32)


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([16, 32]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 16, 64]))
    num_seqs = draw(st.integers(0, 5))
    boundary = st.sampled_from([1, block_size - 1, block_size, block_size + 1, 2 * block_size])
    specs = []
    for _ in range(num_seqs):
        seq_len = draw(st.one_of(boundary, st.integers(1, 3 * block_size + 5)))
        q_len = draw(st.one_of(st.just(1), st.just(seq_len), st.integers(1, seq_len)))
        specs.append((seq_len, q_len))
    seed = draw(st.integers(0, 2**16))
    return make_case(specs, group * num_kv_heads, num_kv_heads, head_dim, block_size, seed=seed)


@settings(max_examples=examples(40), deadline=None)
@given(batches())
def test_hypothesis_shapes(case):
    got, want = run_both(case)
    assert_close(got, want, torch.float32)


# ---------------------------------------------------------------------------- write_kv


def test_write_kv_skips_minus_one():
    num_blocks, block_size, heads, dim = 4, 16, 2, 8
    k_cache = torch.zeros(num_blocks, block_size, heads, dim)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, -1, 16 * 3 + 15, -1, 17], dtype=torch.int64)
    key = torch.randn(5, heads, dim)
    value = torch.randn(5, heads, dim)
    backend.write_kv(key, value, k_cache, v_cache, slots)

    want_k = torch.zeros_like(k_cache)
    want_v = torch.zeros_like(v_cache)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // block_size, slot % block_size] = key[i]
            want_v[slot // block_size, slot % block_size] = value[i]
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


def test_write_kv_with_valid_slots_promised_writes_the_same():
    """``slots_valid=True`` (the engine's batches) skips the look for -1, nothing else."""
    caches = [torch.zeros(4, 16, 2, 8) for _ in range(4)]  # k, v checked; k, v promised
    slots = torch.tensor([5, 63, 17, 0])
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    backend.write_kv(key, value, caches[0], caches[1], slots)
    backend.write_kv(key, value, caches[2], caches[3], slots, slots_valid=True)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[2].view(-1, 2, 8)[63].equal(key[1])


def test_write_kv_all_skipped_and_empty():
    k_cache = torch.zeros(2, 16, 1, 8)
    v_cache = torch.zeros_like(k_cache)
    backend.write_kv(
        torch.ones(2, 1, 8), torch.ones(2, 1, 8), k_cache, v_cache, torch.tensor([-1, -1])
    )
    backend.write_kv(
        torch.ones(0, 1, 8),
        torch.ones(0, 1, 8),
        k_cache,
        v_cache,
        torch.zeros(0, dtype=torch.int64),
    )
    assert not k_cache.any() and not v_cache.any()


def test_write_then_attend_equals_dense_attention():
    """Prefill a prompt through write_kv, then decode: matches dense causal SDPA."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, block_size, length = 4, 2, 16, 16, 37
    k_cache = torch.zeros(8, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    table = [6, 2, 7]
    slots = torch.tensor(
        [table[j // block_size] * block_size + j % block_size for j in range(length)]
    )
    q = torch.randn(length, heads, dim, generator=gen)
    k = torch.randn(length, kv_heads, dim, generator=gen)
    v = torch.randn(length, kv_heads, dim, generator=gen)
    backend.write_kv(k, v, k_cache, v_cache, slots)
    meta = dict(
        block_tables=torch.tensor([table], dtype=torch.int32),
        seq_lens=torch.tensor([length], dtype=torch.int32),
        scale=dim**-0.5,
    )
    prefill = backend.paged_attention(
        q, k_cache, v_cache, **meta, cu_seqlens_q=torch.tensor([0, length], dtype=torch.int32)
    )
    decode = backend.paged_attention(
        q[-1:], k_cache, v_cache, **meta, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32)
    )
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(prefill, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode, want[-1:], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- arg checks


def _good_attention_args() -> dict:
    case = make_case([(20, 4), (7, 1)])
    case.pop("scale")
    return case


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("q", lambda a: a["q"][:, :, :8], "head_dim"),
        ("q", lambda a: a["q"][:, :3], "not a multiple of num_kv_heads"),
        ("q", lambda a: a["q"].double(), "dtype"),
        ("k_cache", lambda a: a["k_cache"][0], "4 dims"),
        ("v_cache", lambda a: a["v_cache"][:1], "shape"),
        (
            "v_cache",
            lambda a: a["v_cache"].transpose(2, 3).contiguous().transpose(2, 3),
            "contiguous",
        ),
        ("block_tables", lambda a: a["block_tables"].long(), "int32"),
        ("block_tables", lambda a: a["block_tables"][:1], "rows"),
        ("seq_lens", lambda a: a["seq_lens"].long(), "int32"),
        ("cu_seqlens_q", lambda a: a["cu_seqlens_q"][:2], r"num_seqs \+ 1"),
    ],
)
def test_attention_arg_checks(name, bad, message):
    args = _good_attention_args()
    checks.check_paged_attention_args(**args)
    args[name] = bad(args)
    with pytest.raises(ValueError, match=rf"^{name}: .*{message}"):
        checks.check_paged_attention_args(**args)
    with pytest.raises(ValueError, match=rf"^{name}: "):
        backend.paged_attention(**args, scale=1.0)


def _good_write_args() -> dict:
    k_cache = torch.zeros(4, 16, 2, 8)
    return dict(
        key=torch.randn(3, 2, 8),
        value=torch.randn(3, 2, 8),
        k_cache=k_cache,
        v_cache=torch.zeros_like(k_cache),
        slot_mapping=torch.tensor([0, -1, 9]),
    )


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("key", lambda a: a["key"][:, :1], "num_kv_heads"),
        ("key", lambda a: a["key"].half(), "dtype"),
        ("value", lambda a: a["value"][:2], "tokens"),
        ("slot_mapping", lambda a: a["slot_mapping"].int(), "int64"),
        ("slot_mapping", lambda a: a["slot_mapping"][:2], "entries"),
        ("v_cache", lambda a: a["v_cache"].half(), "dtype"),
    ],
)
def test_write_kv_arg_checks(name, bad, message):
    args = _good_write_args()
    checks.check_write_kv_args(**args)
    args[name] = bad(args)
    with pytest.raises(ValueError, match=rf"^{name}: .*{message}"):
        checks.check_write_kv_args(**args)
    with pytest.raises(ValueError, match=rf"^{name}: "):
        backend.write_kv(**args)


# ---------------------------------------------------------------------------- selection


def test_select_backend(caplog):
    with caplog.at_level(logging.INFO, logger="actorllm.ops"):
        assert select_backend("torch").name == "torch"
        assert select_backend("auto", "cpu", dtype=torch.bfloat16).name == "torch"
    assert "attention backend: torch" in caplog.text
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("triton")
    with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
        select_backend("cuda", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_select_cuda_without_gpu():
    with pytest.raises(BackendUnavailable, match="torch sees none"):
        select_backend("cuda", "cuda")
    assert select_backend("auto", "cuda").name == "torch"
