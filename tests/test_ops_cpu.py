"""The CPU backend's C decode kernel against the naive reference and the torch backend.

The kernel is built with the machine's C compiler (gcc is part of the project's
machines); a machine without one keeps the torch backend, which the
``select_backend`` test below checks by hiding the compiler.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actorllm.ops import BackendUnavailable, TorchBackend, select_backend
from actorllm.ops.cpu_backend import CpuBackend, build_kernel, load_cpu_backend
from tests.test_ops_reference import make_case, naive_attention

cpu = load_cpu_backend()


@pytest.mark.parametrize(
    ("specs", "heads", "kv_heads", "head_dim", "block_size"),
    [
        ([(1, 1)], 4, 2, 16, 16),
        ([(17, 1), (5, 1), (48, 1), (33, 1)], 4, 2, 16, 16),  # block boundaries, +-1
        ([(200, 1), (3, 1), (64, 1)], 8, 2, 32, 16),  # the embedded model's shape
        ([(31, 1), (9, 1)], 8, 8, 64, 8),  # no GQA
        ([(100, 1), (1, 1)], 16, 1, 128, 32),  # one KV head for all (MQA)
    ],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_decode_kernel_matches_naive(specs, heads, kv_heads, head_dim, block_size, threads):
    case = make_case(specs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                     block_size=block_size, seed=len(specs) + head_dim)
    backend = CpuBackend(build_kernel(), num_threads=threads)
    got = backend.paged_attention(**case, max_seqlen_q=1, max_seqlen_k=max(L for L, _ in specs))
    want = naive_attention(**case)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("sharpness", [0.05, 8.0, 40.0])
def test_decode_kernel_exp_holds_for_flat_and_peaked_scores(sharpness):
    """The kernel's own exp against the reference where scores are nearly equal, and where
    they differ by hundreds (every exp but the maximum's underflows to 0)."""
    case = make_case([(200, 1), (37, 1), (16, 1)], num_heads=8, num_kv_heads=2, head_dim=32,
                     block_size=16, seed=7)
    case["q"] = case["q"] * sharpness
    got = cpu.paged_attention(**case, max_seqlen_q=1, max_seqlen_k=200)
    want = naive_attention(**case)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


def test_mixed_batch_uses_kernel_for_decode_rows_and_matches_torch():
    case = make_case([(40, 1), (30, 7), (70, 1), (16, 16)], num_heads=8, num_kv_heads=2,
                     head_dim=32, seed=3)
    got = cpu.paged_attention(**case)
    want = TorchBackend().paged_attention(**case)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_other_dtypes_take_the_torch_path():
    case = make_case([(20, 1), (9, 1)], dtype=torch.bfloat16, seed=1)
    got = cpu.paged_attention(**case, max_seqlen_q=1, max_seqlen_k=20)
    want = TorchBackend().paged_attention(**case, max_seqlen_q=1, max_seqlen_k=20)
    assert torch.equal(got, want)


def test_kernel_is_cached_by_content(tmp_path):
    first = build_kernel(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert build_kernel(tmp_path) == first and first.stat().st_mtime_ns == mtime


def test_select_backend_cpu_and_fallback(monkeypatch, caplog, tmp_path):
    assert select_backend("auto", "cpu").name == "cpu"
    assert select_backend("cpu", "cpu").name == "cpu"
    assert select_backend("auto", "cpu", dtype=torch.bfloat16).name == "torch"
    # No compiler and nothing cached: auto falls back, an explicit "cpu" says why.
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ACTORLLM_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level("WARNING"):
        assert select_backend("auto", "cpu").name == "torch"
    assert "cpu kernel unavailable" in caplog.text
    with pytest.raises(BackendUnavailable, match="no-such-cc"):
        select_backend("cpu", "cpu")


def test_the_kernel_runs_on_torchs_openmp_runtime_not_a_second_one():
    """The kernel's threads are the calling thread's OpenMP team, the one torch's ops
    use (cpu_paged_decode.c says why): one libgomp in the process, not two."""
    case = make_case([(64, 1), (9, 1)], num_heads=8, num_kv_heads=2, head_dim=32, seed=5)
    CpuBackend(build_kernel(), num_threads=2).paged_attention(**case, max_seqlen_q=1,
                                                              max_seqlen_k=64)
    maps = Path("/proc/self/maps").read_text().splitlines()
    names = ("libgomp", "libiomp", "libomp")
    runtimes = {line.split()[-1] for line in maps if any(n in line for n in names)}
    assert len(runtimes) == 1, runtimes
