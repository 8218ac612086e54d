"""Paged KV-cache ops: the KV write and the one attention op (DESIGN.md section 5).

The model calls a backend picked once at start-up by ``select_backend``:

* ``"torch"`` — ``TorchBackend``, plain torch on any device (the CPU engine's
  attention and the oracle in tests);
* ``"cuda"`` — ``CudaBackend``, CuPy ``RawModule`` kernels compiled from
  ``kernels/*.cu``, run on torch's current stream on torch's memory;
* ``"auto"`` — ``"cuda"`` when the device is a GPU and CuPy/NVRTC work, else ``"torch"``.

CuPy is imported only when the cuda backend is asked for.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import Tensor

from actorllm.ops.torch_backend import TorchBackend

__all__ = ["AttentionBackend", "BackendUnavailable", "TorchBackend", "select_backend"]

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    """What the model needs from an attention backend (see ``TorchBackend`` for full docs)."""

    name: str  # "torch" or "cuda"

    def write_kv(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
    ) -> None:
        """Scatter ``[num_tokens, num_kv_heads, head_dim]`` K/V into the caches; slot -1 skips."""
        ...

    def paged_attention(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        cu_seqlens_q: Tensor,
        scale: float,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
    ) -> Tensor:
        """Causal attention of packed queries over paged K/V; returns ``[total_q, H, D]``."""
        ...


class BackendUnavailable(RuntimeError):
    """The requested attention backend cannot run here; the message says why in one line."""


def select_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """Pick the attention backend for ``device`` once, at start-up, and log the choice.

    ``name`` is ``"auto"``, ``"torch"`` or ``"cuda"``. ``"cuda"`` raises
    ``BackendUnavailable`` when ``device`` is not a CUDA device, torch sees no GPU, or
    CuPy / NVRTC cannot load the kernels; ``"auto"`` falls back to torch in those cases.
    """
    device = torch.device(device)
    if name == "torch":
        log.info("attention backend: torch (%s)", device)
        return TorchBackend()
    if name == "cuda":
        backend = _load_cuda(device)
        log.info("attention backend: cuda (%s)", device)
        return backend
    if name == "auto":
        if device.type == "cuda":
            try:
                backend = _load_cuda(device)
            except BackendUnavailable as exc:
                log.warning("attention backend: torch (%s); cuda unavailable: %s", device, exc)
                return TorchBackend()
            log.info("attention backend: cuda (%s)", device)
            return backend
        log.info("attention backend: torch (%s)", device)
        return TorchBackend()
    raise ValueError(f"name: unknown attention backend {name!r} (expected auto, torch or cuda)")


def _load_cuda(device: torch.device) -> AttentionBackend:
    if device.type != "cuda":
        raise BackendUnavailable(f"the cuda attention backend needs a CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise BackendUnavailable("the cuda attention backend needs a GPU, but torch sees none")
    from actorllm.ops.cuda_backend import CudaBackend  # imports cupy lazily

    return CudaBackend(device)
