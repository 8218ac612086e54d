"""What every attention backend is (the protocol) and how one says it cannot run here.

Apart from ``actorllm.ops`` so the backends can import it without importing the package
that selects them (which imports them back).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class AttentionBackend(Protocol):
    """What the model needs from an attention backend (see ``TorchBackend`` for full docs)."""

    name: str  # "torch", "cpu" or "cuda"

    def write_kv(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
        *, slots_valid: bool = False,
    ) -> None:
        """Scatter ``[num_tokens, num_kv_heads, head_dim]`` K/V into the caches; slot -1 skips.

        ``slots_valid`` promises that no slot is -1, so a backend need not look."""
        ...

    def paged_attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
        cu_seqlens_q: Tensor, scale: float, max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None, *, sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        """Causal attention of packed queries over paged K/V; returns ``[total_q, H, D]``.

        ``sliding_window`` W: a query sees only keys within W positions back (its own
        included); ``softcap`` c: scores become ``c * tanh(score / c)`` before the softmax."""
        ...


class BackendUnavailable(RuntimeError):
    """The requested attention backend cannot run here; the message says why in one line."""
