"""Prompts that start in this step, attended together (the torch backend's prefill path).

A prompt's first chunk has no cached prefix: its keys are exactly its queries' tokens, so
plain causal attention holds. Several such chunks padded at the end to the longest one
make one ``[n, heads, L, D]`` problem: with ``is_causal`` a real query never sees a
padded key (padding only follows it), and padded queries are dropped. One SDPA call per
layer instead of one per prompt: at a burst's arrival (16 prompts of ~135 tokens in a
2,048-token step, the embedded model) the per-prompt calls cost ~4x the batched one on
this 2-core machine (issue 28).

Padding costs work: prompts are grouped, longest first, so that no group computes more
than ``PAD_WASTE`` times the score entries its prompts need. It pays only with several
threads: each SDPA call is a parallel region whose threads meet at its end, and on a
2-core machine shared with the server's own loop one thread is often off its core, so
16 calls a layer cost 34-76 ms of wall time there and one padded call 26-33 (2 threads).
With one thread the per-prompt calls are cheaper (5.9 against 7.7 ms a layer of CPU:
no gather, no padding), so one thread keeps them (``MIN_THREADS``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

PAD_WASTE = 2.0  # a group computes at most this many times its prompts' own work
MIN_THREADS = 2  # batch only when torch runs ops on at least this many threads (CPU)


def worth_batching(q: Tensor) -> bool:
    """Whether prompts starting in one step should share a padded call (see above)."""
    return q.device.type != "cpu" or torch.get_num_threads() >= MIN_THREADS


def fresh_groups(rows: Sequence[int], lens: Sequence[int]) -> list[list[int]]:
    """``rows`` (sequence indices, ``lens[s]`` each) in groups worth one padded call,
    longest first; singletons are groups too."""
    groups: list[list[int]] = []
    need = 0
    for s in sorted(rows, key=lambda s: -lens[s]):
        if groups:
            top = lens[groups[-1][0]]
            if (len(groups[-1]) + 1) * top * top <= PAD_WASTE * (need + lens[s] * lens[s]):
                groups[-1].append(s)
                need += lens[s] * lens[s]
                continue
        groups.append([s])
        need = lens[s] * lens[s]
    return groups


def prefill_fresh(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                  rows: Sequence[int], cu: Sequence[int], lens: Sequence[int], scale: float,
                  out: Tensor) -> None:
    """Attention of the prompts ``rows`` (each's chunk is its whole context: ``lens[s] ==
    cu[s + 1] - cu[s]``) in one causal SDPA, written into ``out`` at their rows.

    K/V come from the paged cache (written this step), gathered by slot; padding repeats
    a prompt's last position, so only slots the prompt owns are read."""
    dev = q.device
    n, longest = len(rows), max(lens[s] for s in rows)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    length = torch.tensor([lens[s] for s in rows], device=dev)
    pos = torch.arange(longest, device=dev)
    clamped = torch.minimum(pos[None, :], (length - 1)[:, None])  # [n, longest]
    at = torch.tensor([cu[s] for s in rows], device=dev)[:, None] + clamped
    tables = block_tables.index_select(0, torch.tensor(rows, device=dev)).long()
    slots = (tables.gather(1, clamped // block_size) * block_size
             + clamped % block_size).reshape(-1)
    k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
    v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
    o = F.scaled_dot_product_attention(
        q.index_select(0, at.reshape(-1)).view(n, longest, num_heads, head_dim).transpose(1, 2),
        k.view(n, longest, num_kv_heads, head_dim).transpose(1, 2),
        v.view(n, longest, num_kv_heads, head_dim).transpose(1, 2),
        is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2).reshape(n * longest, num_heads, head_dim)
    real = (pos[None, :] < length[:, None]).reshape(-1)
    out.index_copy_(0, at.reshape(-1)[real], o[real])
