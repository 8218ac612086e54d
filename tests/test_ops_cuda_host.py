"""Host-side parts of the cuda backend, on CPU: argument checks, launch planning, sources.

The kernels themselves run only in tests/gpu/; everything here needs neither a GPU nor CuPy.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples

from actorllm.ops import BackendUnavailable, checks, select_backend
from actorllm.ops.cuda_backend import (
    DECODE_KEYS,
    KERNEL_DIR,
    MIN_PARTITION,
    config_defines,
    decode_smem_bytes,
    kernel_source,
    plan_decode_splits,
    prefill_smem_bytes,
    score_features,
)

# ---------------------------------------------------------------------------- arg checks


def attention_args(dtype=torch.float16, head_dim=64, block_size=16) -> dict:
    """Attention arguments the CUDA kernels accept, except that they live on the CPU."""
    return dict(
        q=torch.zeros(5, 4, head_dim, dtype=dtype),
        k_cache=torch.zeros(4, block_size, 2, head_dim, dtype=dtype),
        v_cache=torch.zeros(4, block_size, 2, head_dim, dtype=dtype),
        block_tables=torch.zeros(2, 3, dtype=torch.int32),
        seq_lens=torch.tensor([20, 7], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 4, 5], dtype=torch.int32),
    )


def write_args(dtype=torch.float16, head_dim=64) -> dict:
    k_cache = torch.zeros(4, 16, 2, head_dim, dtype=dtype)
    return dict(
        key=torch.zeros(3, 2, head_dim, dtype=dtype),
        value=torch.zeros(3, 2, head_dim, dtype=dtype),
        k_cache=k_cache,
        v_cache=torch.zeros_like(k_cache),
        slot_mapping=torch.tensor([0, -1, 9]),
    )


def test_cuda_checks_accept_good_args():
    checks.check_cuda_paged_attention_args(**attention_args(), device_type="cpu")
    checks.check_cuda_write_kv_args(**write_args(), device_type="cpu")
    # A slice of a fused QKV projection: token stride > heads * head_dim is fine.
    qkv = torch.zeros(5, (4 + 2 + 2) * 64, dtype=torch.float16)
    args = attention_args()
    args["q"] = qkv[:, : 4 * 64].view(5, 4, 64)
    checks.check_cuda_paged_attention_args(**args, device_type="cpu")
    wargs = write_args()
    wargs["key"] = qkv[:3, 4 * 64 : 6 * 64].view(3, 2, 64)
    checks.check_cuda_write_kv_args(**wargs, device_type="cpu")


def test_cuda_checks_want_a_cuda_device():
    with pytest.raises(ValueError, match=r"^k_cache: must be on a cuda device, got cpu"):
        checks.check_cuda_paged_attention_args(**attention_args())
    with pytest.raises(ValueError, match=r"^k_cache: must be on a cuda device, got cpu"):
        checks.check_cuda_write_kv_args(**write_args())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dtype=torch.float32), r"^k_cache: dtype must be float16, bfloat16"),
        (dict(head_dim=96), r"^k_cache: head_dim 96 has no CUDA kernel"),
        (dict(block_size=8), r"^k_cache: block_size 8 has no CUDA kernel"),
    ],
)
def test_cuda_checks_reject_unsupported_shapes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        checks.check_cuda_paged_attention_args(**attention_args(**kwargs), device_type="cpu")


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("q", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "must be contiguous"),
        ("q", lambda t: torch.zeros(5, 4 * 64 + 4, dtype=t.dtype)[:, : 4 * 64].view(5, 4, 64),
         "multiple of 8"),
        ("q", lambda t: torch.zeros(5 * 4 * 64 + 1, dtype=t.dtype)[1:].view(5, 4, 64),
         "16-byte boundary"),
        ("block_tables", lambda t: t.t().contiguous().t(), "rows must be contiguous"),
        ("seq_lens", lambda t: torch.zeros(4, dtype=t.dtype)[::2], "must be contiguous"),
    ],
)  # fmt: skip
def test_cuda_attention_layout_checks(name, bad, message):
    args = attention_args()
    args[name] = bad(args[name])
    with pytest.raises(ValueError, match=rf"^{name}: .*{message}"):
        checks.check_cuda_paged_attention_args(**args, device_type="cpu")


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("key", lambda t: torch.zeros(3 * 2 * 64 + 1, dtype=t.dtype)[1:].view(3, 2, 64),
         "16-byte boundary"),
        ("value", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "must be contiguous"),
        ("slot_mapping", lambda t: torch.zeros(6, dtype=t.dtype)[::2], "must be contiguous"),
        ("k_cache", lambda t: torch.zeros(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape),
         "16-byte boundary"),
    ],
)  # fmt: skip
def test_cuda_write_kv_layout_checks(name, bad, message):
    args = write_args()
    args[name] = bad(args[name])
    if name == "k_cache":
        args["v_cache"] = torch.zeros_like(args["k_cache"])
    with pytest.raises(ValueError, match=rf"^{name}: .*{message}"):
        checks.check_cuda_write_kv_args(**args, device_type="cpu")


# ---------------------------------------------------------------------------- planning


@settings(max_examples=examples(200), deadline=None)
@given(
    num_seqs=st.integers(1, 512),
    num_kv_heads=st.sampled_from([1, 2, 4, 8, 32]),
    group=st.sampled_from([1, 2, 4, 7, 8, 16, 32]),
    max_seqlen_k=st.integers(0, 131072),
    num_sms=st.sampled_from([1, 80, 108, 132]),
)
def test_decode_plan_covers_every_key_once(num_seqs, num_kv_heads, group, max_seqlen_k, num_sms):
    plan = plan_decode_splits(num_seqs, num_kv_heads, group, max_seqlen_k, num_sms)
    assert plan.partition % DECODE_KEYS == 0  # the kernel's tiles never straddle two splits
    assert plan.num_splits * plan.partition >= max_seqlen_k  # every key has a split
    assert (plan.num_splits - 1) * plan.partition < max(max_seqlen_k, 1)  # no idle split
    assert plan.num_splits == 1 or plan.partition >= MIN_PARTITION  # splits are worth it
    assert plan.num_splits <= 65535  # grid z limit


def test_decode_plan_splits_only_when_the_gpu_is_underfilled():
    long_single = plan_decode_splits(1, 8, 4, 32768, num_sms=132)
    assert long_single.num_splits >= 16
    assert plan_decode_splits(256, 8, 4, 32768, num_sms=132).num_splits == 1
    assert plan_decode_splits(1, 8, 4, 200, num_sms=132).num_splits == 1


def test_shared_memory_fits_an_a100():
    """Dynamic + static (512 B) shared memory within sm_80's 163 KiB per-block opt-in."""
    for head_dim in checks.CUDA_HEAD_DIMS:
        assert decode_smem_bytes(head_dim) + 512 <= 163 * 1024
        assert prefill_smem_bytes(head_dim) <= 163 * 1024


# ---------------------------------------------------------------------------- sources


def test_kernel_source_pastes_the_header():
    for path in KERNEL_DIR.glob("*.cu"):
        text = kernel_source(path.name)
        assert not re.search(r"^#include", text, re.MULTILINE), path.name
        assert "ACTORLLM_DEVICE float neg_inf()" in text


def test_config_defines_name_real_kernels():
    """The names cuda_backend.py builds are the names the sources instantiate."""
    decode = (KERNEL_DIR / "paged_decode.cu").read_text()
    prefill = (KERNEL_DIR / "paged_prefill.cu").read_text()
    assert "paged_decode_##DT##_d##D##_b##BS" in decode
    assert "paged_decode_reduce_##DT##_d##D" in decode
    assert "paged_prefill_##DT##_d##D##_b##BS" in prefill
    defines = dict(
        d.removeprefix("-D").split("=") for d in config_defines(torch.bfloat16, 128, 32)[1:]
    )
    assert defines == {
        "ACTORLLM_DT": "bf16",
        "ACTORLLM_IS_BF16": "true",
        "ACTORLLM_HEAD_DIM": "128",
        "ACTORLLM_BLOCK_SIZE": "32",
    }
    # The tile constants mirrored in Python match the sources.
    assert re.search(rf"#define DECODE_KEYS {DECODE_KEYS}\b", decode)


# ---------------------------------------------------------------------------- selection


def test_select_cuda_rejects_shapes_without_kernels():
    with pytest.raises(BackendUnavailable, match="no cuda kernel for head_dim 96"):
        select_backend("cuda", "cuda", head_dim=96)
    with pytest.raises(BackendUnavailable, match=r"dtype torch\.float32"):
        select_backend("cuda", "cuda", dtype=torch.float32, block_size=16)
    assert select_backend("auto", "cuda", head_dim=96).name == "torch"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_select_auto_without_gpu_logs_why(caplog):
    with caplog.at_level("WARNING", logger="actorllm.ops"):
        assert select_backend("auto", "cuda", head_dim=128).name == "torch"
    assert "cuda unavailable" in caplog.text and "torch sees none" in caplog.text


# ---------------------------------------------------------------------------- score features


def test_score_features_are_zero_when_off():
    assert [float(x) for x in score_features(0.125, None, None)] == [0.0, 0.0, 0.0]
    assert int(score_features(0.125, 4096, None)[0]) == 4096
    assert int(score_features(0.125, 2**40, None)[0]) == 2**31 - 1  # an int32 argument


@pytest.mark.parametrize("window, cap", [(0, None), (-3, None), (None, 0.0), (None, -1.0)])
def test_score_features_reject_nonsense(window, cap):
    with pytest.raises(ValueError):
        score_features(0.125, window, cap)


@pytest.mark.parametrize("cap", [0.5, 10.0, 50.0])
def test_softcap_in_base_two_is_the_reference_cap(cap):
    """common.cuh's score2 written out in float32 (2^x and 1/x exact here, approximate on
    the GPU) against the reference's ``cap * tanh(s * scale / cap)``, times log2(e): the
    kernels keep scores in base 2, so the two must agree for raw dots from tiny to huge
    (where 2^x overflows to inf and the tanh must still come out as 1)."""
    scale = 64**-0.5
    _, cap_in, cap_out = score_features(scale, None, cap)
    dots = torch.cat([torch.linspace(-5000, 5000, 2001), torch.linspace(-1, 1, 201)])
    e = torch.exp2(dots * float(cap_in))
    got = float(cap_out) * (1 - 2 * (1 / (e + 1)))
    want = cap * torch.tanh(dots.double() * scale / cap) * 1.4426950408889634
    torch.testing.assert_close(got.double(), want, atol=2e-5 * cap, rtol=1e-5)
