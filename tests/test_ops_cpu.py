"""The CPU backend's C decode kernel against the naive reference and the torch backend.

The kernel is built with the machine's C compiler (gcc is part of the project's
machines); a machine without one keeps the torch backend, which the
``select_backend`` test below checks by hiding the compiler.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sim.profiles import examples

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


# ---------------------------------------------------------------------------- window, soft-cap


@st.composite
def featured_decode_batches(draw):
    """Decode batches with a window (or none) and a soft-cap (or none), around block edges."""
    block_size = draw(st.sampled_from([8, 16, 32]))
    edge = st.sampled_from([1, block_size - 1, block_size, block_size + 1, 3 * block_size])
    lens = draw(st.lists(st.one_of(edge, st.integers(1, 130)), min_size=1, max_size=5))
    window = draw(st.one_of(st.none(), st.sampled_from([1, 2, block_size - 1, block_size,
                                                        block_size + 3]),
                            st.integers(1, 140)))
    cap = draw(st.one_of(st.none(), st.sampled_from([0.5, 3.0, 30.0, 50.0])))
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    head_dim = draw(st.sampled_from([8, 32, 64, 128]))
    case = make_case([(n, 1) for n in lens], num_heads=group * kv_heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, block_size=block_size, seed=draw(st.integers(0, 2**16)))
    case["q"] = case["q"] * draw(st.sampled_from([0.1, 1.0, 6.0]))  # flat to peaked scores
    return case, window, cap, draw(st.sampled_from([1, 2]))


@settings(max_examples=examples(60), deadline=None)
@given(featured_decode_batches())
def test_decode_kernel_window_and_softcap_match_torch(example):
    """The kernel's window and soft-cap against the torch reference (their oracle), over
    shapes, windows that start mid-block, wider than the context, of one key, and caps
    from binding to loose."""
    case, window, cap, threads = example
    backend = CpuBackend(build_kernel(), num_threads=threads)
    max_len = int(case["seq_lens"].max())
    got = backend.paged_attention(**case, max_seqlen_q=1, max_seqlen_k=max_len,
                                  sliding_window=window, softcap=cap)
    want = TorchBackend().paged_attention(**case, max_seqlen_q=1, max_seqlen_k=max_len,
                                          sliding_window=window, softcap=cap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_decode_kernel_runs_windowed_and_capped_calls_itself(monkeypatch):
    """A window or a soft-cap is the kernel's work now, not the torch fallback's: the torch
    decode path is made to fail and the call still answers (as the naive oracle does)."""
    from tests.test_models_attention import naive

    def refuse(*args, **kwargs):
        raise AssertionError("took the torch decode path")

    monkeypatch.setattr(TorchBackend, "decode", refuse)
    case = make_case([(45, 1), (7, 1), (33, 1)], num_heads=8, num_kv_heads=2, head_dim=32,
                     block_size=16, seed=11)
    for window, cap in ((10, None), (None, 2.5), (17, 4.0)):
        got = cpu.paged_attention(**case, max_seqlen_q=1, max_seqlen_k=45,
                                  sliding_window=window, softcap=cap)
        want = naive(**case, window=window, cap=cap)
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


def test_decode_kernel_block_size_not_a_multiple_of_its_chunk():
    """A block of 96 slots is read in chunks that stop at the block's end (a chunk of 64
    from slot 64 would run past it into whatever lies beyond)."""
    case = make_case([(200, 1), (97, 1)], num_heads=4, num_kv_heads=2, head_dim=16,
                     block_size=96, seed=6)
    for window in (None, 150):
        got = cpu.paged_attention(**case, max_seqlen_q=1, max_seqlen_k=200,
                                  sliding_window=window)
        want = TorchBackend().paged_attention(**case, max_seqlen_q=1, max_seqlen_k=200,
                                              sliding_window=window)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


# The kernel's AVX-512 steps (where the machine has them) take four query heads a vector
# for the scores (groups of 4 and 8; groups of 2 take two heads of eight dimensions a
# vector, head dims a multiple of 8), eight keys a tile, 64 keys a chunk across blocks,
# and sixteen lanes of the head dimension for the softmax and the values (head dims 32 to
# 128); the others take the portable loops. Lengths around each of those edges.
ODD_LENGTHS = [(1, 1), (7, 1), (8, 1), (9, 1), (63, 1), (64, 1), (65, 1), (129, 1), (203, 1)]


@pytest.mark.parametrize(("group", "head_dim"),
                         [(1, 32), (2, 64), (4, 32), (4, 128), (8, 64), (8, 128), (3, 32),
                          (2, 32), (2, 8), (2, 128), (2, 12)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_kernel_vector_paths_around_tile_and_chunk_edges(group, head_dim, block_size):
    case = make_case(ODD_LENGTHS, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                     block_size=block_size, seed=group * head_dim + block_size)
    got = CpuBackend(build_kernel(), num_threads=2).paged_attention(
        **case, max_seqlen_q=1, max_seqlen_k=203)
    want = naive_attention(**case)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("group", "head_dim"), [(4, 32), (8, 64), (1, 128), (2, 32)])
def test_decode_kernel_vector_paths_with_window_and_softcap(group, head_dim):
    """Windows that start mid-chunk and mid-block, and soft-caps, on the vector steps."""
    case = make_case(ODD_LENGTHS, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                     block_size=16, seed=head_dim)
    case["q"] = case["q"] * 4.0
    for window, cap in ((70, None), (9, None), (None, 3.0), (100, 30.0)):
        got = cpu.paged_attention(**case, max_seqlen_q=1, max_seqlen_k=203,
                                  sliding_window=window, softcap=cap)
        want = TorchBackend().paged_attention(**case, max_seqlen_q=1, max_seqlen_k=203,
                                              sliding_window=window, softcap=cap)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
