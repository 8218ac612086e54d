"""Torch reference backend for the paged KV cache (DESIGN.md section 5).

Runs on any torch device; it is the CPU engine's attention and the oracle the
CUDA kernels are tested against. Two paths, both free of per-token Python loops:

* decode (every sequence has one query token): gather every sequence's K/V
  with one ``index_select`` into a padded ``[num_seqs, max_len, ...]`` tensor,
  then one masked, batched ``scaled_dot_product_attention``;
* prefill chunks (q_len > 1, possibly with a cached prefix): one
  ``scaled_dot_product_attention`` call per sequence with the causal mask
  shifted by the cached-prefix length (``is_causal`` when there is no prefix).

A batch that mixes the two sends its decode sequences down the batched path and
loops over the prefill sequences only.

Two model features narrow or bend the scores, both as transformers' eager attention
defines them (the oracle): a ``sliding_window`` W lets the query at position p see keys
at positions ``> p - W`` only (Mistral, Gemma's local layers), and a ``softcap`` c maps
each scaled score s to ``c * tanh(s / c)`` before the mask and softmax (Gemma 2). SDPA
has no soft-cap, so a soft-capped call computes scores and softmax explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from actorllm.ops.checks import check_paged_attention_args, check_write_kv_args


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Features:
    """The optional score features of one attention call (None: off)."""

    sliding_window: int | None = None
    softcap: float | None = None

    @property
    def any(self) -> bool:
        """Whether any feature is on."""
        return self.sliding_window is not None or self.softcap is not None


NO_FEATURES = Features()


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float,
            softcap: float | None) -> Tensor:
    """Masked attention ``[..., Lq, D]`` x ``[..., Lk, D]``; soft-capped scores when asked.

    The soft-capped path follows transformers' eager attention op for op (scale, cap,
    mask, fp32 softmax, cast back), since that is what the oracle computes.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class TorchBackend:
    """Reference implementation of the ``AttentionBackend`` protocol in plain torch."""

    name = "torch"

    def write_kv(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
        *, slots_valid: bool = False,
    ) -> None:
        """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the caches.

        Token ``i`` goes to flat slot ``slot_mapping[i]`` (``block_id * block_size + offset``);
        a slot of ``-1`` is skipped. ``slots_valid`` promises there is none (the engine's
        batches: ``ForwardBatch.slots_valid``), which saves two ops and a read back a layer.
        """
        check_write_kv_args(key, value, k_cache, v_cache, slot_mapping)
        if key.shape[0] == 0:
            return
        if not slots_valid:
            keep = slot_mapping >= 0
            if not bool(keep.all()):
                slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)

    def paged_attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
        cu_seqlens_q: Tensor, scale: float, max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None, *, seq_lens_host: Sequence[int] | None = None,
        cu_seqlens_q_host: Sequence[int] | None = None, sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        """Causal attention of packed queries over paged K/V; returns ``[total_q, num_heads, D]``.

        Args:
            q: ``[total_q_tokens, num_heads, head_dim]``, sequences packed by ``cu_seqlens_q``.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
            block_tables: int32 ``[num_seqs, max_blocks]``; entries past a sequence's last
                block are ignored (they may hold any value).
            seq_lens: int32 ``[num_seqs]``, context length including the new tokens.
            cu_seqlens_q: int32 ``[num_seqs + 1]``, prefix sums of the query lengths.
            scale: softmax scale, usually ``head_dim ** -0.5``.
            max_seqlen_q, max_seqlen_k: optional upper bounds on the query / context
                lengths. With ``max_seqlen_q == 1`` and ``max_seqlen_k`` given, the decode
                path reads no tensor values on the host (no device sync).
            seq_lens_host, cu_seqlens_q_host: optional host copies (lists) of ``seq_lens``
                and ``cu_seqlens_q``; when given, they are used instead of ``.tolist()``.
            sliding_window: when set, a query sees only the last ``sliding_window`` keys
                up to its own position.
            softcap: when set, scores are soft-capped: ``softcap * tanh(score / softcap)``.

        Query token ``i`` of sequence ``s`` is at position ``seq_lens[s] - q_len[s] + i`` and
        attends to keys at positions ``<=`` its own. Softmax accumulates in fp32 (torch's SDPA
        kernels do so for fp16/bf16 inputs).
        """
        check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
        num_seqs = seq_lens.shape[0]
        if q.shape[0] == 0 or num_seqs == 0:
            return torch.empty_like(q)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        if sliding_window is not None and max_seqlen_k is not None \
                and max_seqlen_k <= sliding_window:
            sliding_window = None  # no context reaches past the window: full attention
        extra = Features(sliding_window, softcap)
        if max_seqlen_q == 1 and max_seqlen_k is not None and q.shape[0] == num_seqs:
            return self.decode(q, k_cache, v_cache, block_tables, seq_lens, max_seqlen_k, scale,
                               extra)

        lens = list(seq_lens_host) if seq_lens_host is not None else seq_lens.tolist()
        cu = list(cu_seqlens_q_host) if cu_seqlens_q_host is not None else cu_seqlens_q.tolist()
        decode = [s for s in range(num_seqs) if cu[s + 1] - cu[s] == 1]
        if len(decode) == num_seqs:
            return self.decode(q, k_cache, v_cache, block_tables, seq_lens, max(lens), scale,
                               extra)

        out = torch.empty_like(q)
        if decode:
            rows = torch.tensor([cu[s] for s in decode], device=q.device)
            seqs = torch.tensor(decode, device=q.device)
            max_len = max(lens[s] for s in decode)
            o = self.decode(q.index_select(0, rows), k_cache, v_cache,
                            block_tables.index_select(0, seqs), seq_lens.index_select(0, seqs),
                            max_len, scale, extra)
            out.index_copy_(0, rows, o)
        for s in range(num_seqs):
            q_len = cu[s + 1] - cu[s]
            if q_len > 1:
                out[cu[s] : cu[s + 1]] = _prefill_one(
                    q[cu[s] : cu[s + 1]], k_cache, v_cache, block_tables[s], lens[s], scale,
                    extra,
                )
        return out

    def decode(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
        max_len: int, scale: float, extra: Features = NO_FEATURES,
    ) -> Tensor:
        """The decode rows: one query ``[num_seqs, H, D]`` per sequence; ``max_len`` bounds
        ``seq_lens``. A subclass may replace this path alone (``CpuBackend`` does)."""
        return _decode(q, k_cache, v_cache, block_tables, seq_lens, max_len, scale, extra)


def _decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    max_len: int, scale: float, extra: Features = NO_FEATURES,
) -> Tensor:
    """One query token per sequence: gather padded K/V for all sequences, one masked SDPA."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = min(max_len, block_tables.shape[1] * block_size)  # max_len may be a loose bound

    # Gather by slot, not by block: positions past a sequence's end read the sequence's
    # own position 0 instead of the unwritten tail of its last block (or a garbage table
    # entry), so no NaN/inf from uninitialised cache memory can reach the masked SDPA.
    pos = torch.arange(max_len, device=q.device)
    live = pos[None, :] < seq_lens[:, None]  # [S, L]
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size
    slots = torch.where(live, slots, slots[:, :1]).reshape(-1)
    k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
    v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
    k = k.view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)  # [S, Hkv, L, D]
    v = v.view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)

    # GQA without repeating K/V: the `group` query heads sharing a KV head become `group`
    # query rows of one attention problem (they share its mask too). Measured ~2x faster on
    # CPU than enable_gqa with a [S, H, 1, D] query.
    group = num_heads // num_kv_heads
    if extra.sliding_window is not None:
        live = live & (pos[None, :] >= seq_lens[:, None] - extra.sliding_window)
    out = _attend(q.view(num_seqs, num_kv_heads, group, head_dim), k, v,
                  live[:, None, None, :], scale, extra.softcap)
    return out.reshape(num_seqs, num_heads, head_dim)


# Queries a windowed prefill attends per call (at least the window): each block reads
# only the keys its window reaches (block + window - 1 of them) instead of the whole
# context under a mask. One thread, the benchmark's Mistral (window 32, 4 layers): a
# 512-token prompt's forward 63-64 ms in one masked call a layer, 55-56 ms in blocks of
# 128 (64 gave the same; at 128 tokens blocks of 64 cost 1-4 % more than one call).
WINDOW_BLOCK = 128


def _prefill_one(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_len: int, scale: float,
    extra: Features = NO_FEATURES,
) -> Tensor:
    """One sequence's query chunk ``[q_len, H, D]`` against its first ``seq_len`` cached keys."""
    q_len, _, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    blocks = block_table[: _cdiv(seq_len, block_size)].long()
    k = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
    v = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
    first = seq_len - q_len  # the first query's position: the cached prefix's length
    window = extra.sliding_window
    step = max(WINDOW_BLOCK, window or 0)
    if window is None or seq_len <= window + step:
        return _attend_span(q, k, v, first, 0, scale, extra)
    out = torch.empty_like(q)
    for a in range(0, q_len, step):
        b = min(a + step, q_len)
        lo = max(0, first + a - window + 1)  # the oldest key the block's first query sees
        out[a:b] = _attend_span(q[a:b], k[lo : first + b], v[lo : first + b], first + a, lo,
                                scale, extra)
    return out


def _attend_span(q: Tensor, k: Tensor, v: Tensor, q_start: int, k_start: int, scale: float,
                 extra: Features) -> Tensor:
    """Queries ``[Lq, H, D]`` at positions ``q_start...`` against the keys ``[Lk, Hkv, D]``
    at positions ``k_start...``: causal, with the window and soft-cap of ``extra``."""
    q_len, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    mask = None
    window = extra.sliding_window
    if q_start != k_start or q_len != k.shape[0] or extra.any:
        # The causal diagonal is shifted by the keys before the first query.
        q_pos = torch.arange(q_start, q_start + q_len, device=q.device)[:, None]
        k_pos = torch.arange(k_start, k_start + k.shape[0], device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask = mask & (k_pos > q_pos - window)
    if extra.softcap is not None:
        group = num_heads // num_kv_heads
        out = _attend(q.transpose(0, 1).unsqueeze(0),
                      k.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0),
                      v.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0),
                      mask, scale, extra.softcap)
        return out[0].transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out[0].transpose(0, 1)
