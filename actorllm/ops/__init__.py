"""Paged KV-cache ops: the KV write and the one attention op (DESIGN.md section 5).

The model calls a backend picked once at start-up by ``select_backend``:

* ``"torch"`` — ``TorchBackend``, plain torch on any device (the oracle in tests);
* ``"cpu"`` — ``CpuBackend``, the torch backend with fp32 decode attention in a C
  kernel (``actorllm/kernels/cpu_paged_decode.c``) built with the machine's C compiler;
* ``"cuda"`` — ``CudaBackend``, CuPy ``RawModule`` kernels compiled from
  ``actorllm/kernels/*.cu``, run on torch's current stream on torch's memory;
* ``"auto"`` — ``"cuda"`` when the device is a GPU and CuPy/NVRTC work; on the CPU,
  ``"cpu"`` for fp32 when the kernel builds; else ``"torch"``.

CuPy is imported only when the cuda backend is asked for.
"""

from __future__ import annotations

import logging

import torch

from actorllm.ops import checks
from actorllm.ops.base import AttentionBackend, BackendUnavailable
from actorllm.ops.torch_backend import TorchBackend

__all__ = ["AttentionBackend", "BackendUnavailable", "TorchBackend", "select_backend"]

log = logging.getLogger(__name__)


def select_backend(
    name: str = "auto",
    device: torch.device | str = "cpu",
    *,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    block_size: int | None = None,
) -> AttentionBackend:
    """Pick the attention backend for ``device`` once, at start-up, and log the choice.

    ``name`` is ``"auto"``, ``"torch"``, ``"cpu"`` or ``"cuda"``. ``"cpu"`` raises
    ``BackendUnavailable`` when the C kernel cannot be built. ``"cuda"`` raises
    ``BackendUnavailable`` when ``device`` is not a CUDA device, torch sees no GPU, CuPy /
    NVRTC cannot build the kernels, or the optional model shape (``dtype``, ``head_dim``,
    ``block_size``) has no kernel; ``"auto"`` falls back to torch in those cases. When the
    shape is given, the cuda kernels for it are compiled here rather than on first use.
    """
    device = torch.device(device)
    if name == "torch":
        log.info("attention backend: torch (%s)", device)
        return TorchBackend()
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(
            f"name: unknown attention backend {name!r} (expected auto, torch, cpu or cuda)")
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        return _load_cpu(device, dtype, required=name == "cpu")
    if name == "auto" and device.type != "cuda":
        log.info("attention backend: torch (%s)", device)
        return TorchBackend()
    try:
        backend = _load_cuda(device, dtype, head_dim, block_size)
    except BackendUnavailable as exc:
        if name == "cuda":
            raise
        log.warning("attention backend: torch (%s); cuda unavailable: %s", device, exc)
        return TorchBackend()
    log.info("attention backend: cuda (%s)", device)
    return backend


def _load_cpu(device: torch.device, dtype: torch.dtype | None, *, required: bool
              ) -> AttentionBackend:
    from actorllm.ops.cpu_backend import CpuKernelError, load_cpu_backend

    problem = None
    if device.type != "cpu":
        problem = f"the cpu attention backend runs on the CPU, got {device}"
    elif dtype not in (None, torch.float32):
        problem = f"the cpu kernel is fp32 only, got {str(dtype).removeprefix('torch.')}"
    else:
        try:
            backend = load_cpu_backend()
        except CpuKernelError as exc:
            problem = str(exc)
        else:
            log.info("attention backend: cpu (%s)", device)
            return backend
    if required:
        raise BackendUnavailable(problem)
    log.warning("attention backend: torch (%s); cpu kernel unavailable: %s", device, problem)
    return TorchBackend()


def _load_cuda(
    device: torch.device,
    dtype: torch.dtype | None,
    head_dim: int | None,
    block_size: int | None,
) -> AttentionBackend:
    if device.type != "cuda":
        raise BackendUnavailable(f"the cuda attention backend needs a CUDA device, got {device}")
    unsupported = [
        f"{what} {value}"
        for what, value, have in (
            ("dtype", dtype, checks.CUDA_DTYPES),
            ("head_dim", head_dim, checks.CUDA_HEAD_DIMS),
            ("block_size", block_size, checks.CUDA_BLOCK_SIZES),
        )
        if value is not None and value not in have
    ]
    if unsupported:
        raise BackendUnavailable(f"no cuda kernel for {', '.join(unsupported)}")
    if not torch.cuda.is_available():
        raise BackendUnavailable("the cuda attention backend needs a GPU, but torch sees none")
    from actorllm.ops.cuda_backend import CudaBackend  # imports cupy lazily

    backend = CudaBackend(device)
    if dtype is not None and head_dim is not None and block_size is not None:
        backend.warmup(dtype, head_dim, block_size)
    return backend
