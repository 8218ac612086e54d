"""Sliding-window and soft-capped paged attention against a naive oracle.

The oracle reads the cache slot by slot and computes each query's scores in float64 with
the window and the cap written out as transformers' eager attention defines them (key
``k`` is visible to the query at ``p`` iff ``p - window < k <= p``; a score ``s`` becomes
``cap * tanh(s / cap)``); it shares no code with ``actorllm.ops``.
"""

from __future__ import annotations

import pytest
import torch

from actorllm.ops import TorchBackend, select_backend, torch_backend
from tests.test_ops_reference import make_case


def naive(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, window, cap):
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(seq_lens.shape[0]):
        length = int(seq_lens[s])
        start, end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        slots = [(int(block_tables[s, j // block_size]), j % block_size) for j in range(length)]
        k = torch.stack([k_cache[b, o] for b, o in slots]).double()
        v = torch.stack([v_cache[b, o] for b, o in slots]).double()
        for h in range(q.shape[1]):
            for i in range(end - start):
                pos = length - (end - start) + i
                first = 0 if window is None else max(0, pos - window + 1)
                scores = (k[first: pos + 1, h // group] @ q[start + i, h].double()) * scale
                if cap is not None:
                    scores = cap * torch.tanh(scores / cap)
                out[start + i, h] = torch.softmax(scores, 0) @ v[first: pos + 1, h // group]
    return out


SPECS = [
    [(40, 1), (5, 1), (33, 1)],  # decode only, some past the window
    [(40, 8), (20, 20), (9, 1)],  # prefill chunk over a prefix, a whole prompt, a decode row
    [(50, 50)],  # one long prompt
]


@pytest.mark.parametrize("specs", SPECS)
@pytest.mark.parametrize("window,cap", [(7, None), (None, 5.0), (16, 3.0), (1, None)])
def test_torch_reference(specs, window, cap):
    case = make_case(specs, num_heads=4, num_kv_heads=2, seed=len(specs))
    got = TorchBackend().paged_attention(**case, sliding_window=window, softcap=cap)
    want = naive(**case, window=window, cap=cap)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window,cap", [(7, None), (40, None), (16, 3.0)])
def test_long_windowed_prefill_in_blocks(window, cap, monkeypatch):
    # Past window + WINDOW_BLOCK keys a windowed prefill runs in query blocks that read
    # only their window's keys; a small block makes these prompts take several, with
    # blocks whose keys start at 0 and past it, over a cached prefix and without one.
    monkeypatch.setattr(torch_backend, "WINDOW_BLOCK", 16)
    case = make_case([(90, 90), (100, 37), (70, 1)], num_heads=4, num_kv_heads=2, seed=5)
    got = TorchBackend().paged_attention(**case, sliding_window=window, softcap=cap)
    want = naive(**case, window=window, cap=cap)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_window_wider_than_context_is_full_attention():
    case = make_case([(12, 1), (12, 12)], seed=9)
    full = TorchBackend().paged_attention(**case)
    got = TorchBackend().paged_attention(**case, max_seqlen_q=12, max_seqlen_k=12,
                                         sliding_window=12)
    torch.testing.assert_close(got, full)


def test_decode_fast_path_honours_window():
    case = make_case([(40, 1), (3, 1)], seed=4)
    got = TorchBackend().paged_attention(**case, max_seqlen_q=1, max_seqlen_k=40,
                                         sliding_window=10, softcap=2.0)
    want = naive(**case, window=10, cap=2.0)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_cpu_backend_matches_reference_with_features():
    backend = select_backend("auto", "cpu", dtype=torch.float32)
    case = make_case([(40, 1), (17, 1), (30, 6)], seed=2)
    for window, cap in ((8, None), (None, 4.0), (None, None)):
        got = backend.paged_attention(**case, sliding_window=window, softcap=cap)
        want = naive(**case, window=window, cap=cap)
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_bad_window():
    case = make_case([(4, 1)])
    with pytest.raises(ValueError, match="sliding_window"):
        TorchBackend().paged_attention(**case, sliding_window=0)
