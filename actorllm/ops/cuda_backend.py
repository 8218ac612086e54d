"""CUDA backend: CuPy ``RawModule`` kernels from ``actorllm/kernels/*.cu`` on torch's memory
and stream.

Each kernel source is compiled by NVRTC once per process and configuration (dtype, head
size, block size) and cached on disk by CuPy (``CUPY_CACHE_DIR``, default
``~/.cupy/kernel_cache``). ``actorllm/kernels/common.cuh`` is pasted in place of its ``#include`` so
the cache key, which is the source text, changes whenever the header does.

Kernels take raw device pointers of torch tensors (no copies, no DLPack wrappers: cheaper
per launch) and run on ``torch.cuda.current_stream()``, wrapped as a CuPy
``ExternalStream``, so they are ordered with the surrounding torch work and temporaries from
torch's caching allocator are safe to use. CuPy is imported only when this backend is built.

The pure helpers (``kernel_source``, ``decode_smem_bytes``, ``prefill_smem_bytes``,
``plan_decode_splits``) need no GPU and are unit-tested on CPU.
"""

from __future__ import annotations

import importlib.resources
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from actorllm.ops.base import BackendUnavailable
from actorllm.ops.checks import check_cuda_paged_attention_args, check_cuda_write_kv_args

log = logging.getLogger(__name__)

#: Where the CUDA sources live: ``$ACTORLLM_KERNEL_DIR``, else the ``actorllm.kernels``
#: package (``<repo>/kernels`` in a checkout, shipped inside the wheel).
KERNEL_DIR = Path(
    os.environ.get("ACTORLLM_KERNEL_DIR") or str(importlib.resources.files("actorllm.kernels"))
)

# Tile shapes baked into the kernels (actorllm/kernels/paged_decode.cu and paged_prefill.cu).
DECODE_THREADS = 128
DECODE_KEYS = 64  # keys per CTA tile
DECODE_ROWS = 16  # query heads per CTA
PREFILL_THREADS = 128
PREFILL_ROWS = 64  # (token, head) query rows per CTA
CACHE_THREADS = 128
MIN_PARTITION = 256  # fewest keys worth a split of their own in decode
LOG2E = 1.4426950408889634

_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)


def kernel_source(name: str, kernel_dir: Path = KERNEL_DIR) -> str:
    """Text of ``actorllm/kernels/<name>`` with its local ``#include "x.cuh"`` lines pasted in."""
    text = (kernel_dir / name).read_text()
    return _INCLUDE.sub(lambda m: (kernel_dir / m.group(1)).read_text(), text)


def config_defines(dtype: torch.dtype, head_dim: int, block_size: int) -> tuple[str, ...]:
    """NVRTC ``-D`` options that make a module hold a single configuration's kernels."""
    bf16 = dtype == torch.bfloat16
    return (
        "-DACTORLLM_ONE_CONFIG",
        f"-DACTORLLM_DT={'bf16' if bf16 else 'f16'}",
        f"-DACTORLLM_IS_BF16={'true' if bf16 else 'false'}",
        f"-DACTORLLM_HEAD_DIM={head_dim}",
        f"-DACTORLLM_BLOCK_SIZE={block_size}",
    )


NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17",)


def prefill_keys(head_dim: int) -> int:
    """Keys per K/V tile of the prefill kernel (``PrefillKeys`` in paged_prefill.cu)."""
    return 32 if head_dim == 256 else 64


def decode_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of paged_decode: 2 stages x (K + V) x 64 keys, plus 16 Q rows."""
    return 4 * DECODE_KEYS * head_dim * 2 + DECODE_ROWS * head_dim * 2


def prefill_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of paged_prefill: 64 Q rows plus 2 stages x (K + V) tiles."""
    return PREFILL_ROWS * head_dim * 2 + 4 * prefill_keys(head_dim) * head_dim * 2


@dataclass(frozen=True)
class DecodePlan:
    """How paged_decode splits each sequence's context: ``num_splits`` of ``partition`` keys."""

    num_splits: int
    partition: int


def plan_decode_splits(
    num_seqs: int, num_kv_heads: int, group: int, max_seqlen_k: int, num_sms: int
) -> DecodePlan:
    """Split long contexts so that a small batch still gives every SM about two CTAs.

    A split covers at least ``MIN_PARTITION`` keys (and a whole number of 64-key tiles), so
    short contexts or big batches run unsplit and skip the reduction kernel.
    """
    ctas = num_seqs * num_kv_heads * math.ceil(group / DECODE_ROWS)
    want = max(1, math.ceil(2 * num_sms / max(ctas, 1)))
    splits = max(1, min(want, max_seqlen_k // MIN_PARTITION))
    tiles = math.ceil(max(max_seqlen_k, 1) / DECODE_KEYS)
    partition = math.ceil(tiles / splits) * DECODE_KEYS
    return DecodePlan(num_splits=math.ceil(max(max_seqlen_k, 1) / partition), partition=partition)


def score_features(scale: float, sliding_window: int | None,
                   softcap: float | None) -> tuple[np.int32, np.float32, np.float32]:
    """The kernels' ``ScoreFeatures`` arguments (common.cuh): ``(window, cap_in, cap_out)``,
    zeros for a feature that is off. The cap works in base 2 on raw dot products:
    ``cap_in = 2 log2(e) scale / softcap`` and ``cap_out = softcap log2(e)``."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    window = np.int32(min(sliding_window or 0, 2**31 - 1))
    if softcap is None:
        return window, np.float32(0.0), np.float32(0.0)
    return window, np.float32(2 * LOG2E * scale / softcap), np.float32(softcap * LOG2E)


def _ptr(t: Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


class _Kernels:
    """The compiled kernels of one (dtype, head_dim, block_size) configuration."""

    def __init__(self, cupy: Any, dtype: torch.dtype, head_dim: int, block_size: int) -> None:
        options = NVRTC_OPTIONS + config_defines(dtype, head_dim, block_size)
        dt = "bf16" if dtype == torch.bfloat16 else "f16"
        decode = cupy.RawModule(code=kernel_source("paged_decode.cu"), options=options)
        prefill = cupy.RawModule(code=kernel_source("paged_prefill.cu"), options=options)
        self.decode = decode.get_function(f"paged_decode_{dt}_d{head_dim}_b{block_size}")
        self.reduce = decode.get_function(f"paged_decode_reduce_{dt}_d{head_dim}")
        self.prefill = prefill.get_function(f"paged_prefill_{dt}_d{head_dim}_b{block_size}")
        # Above 48 KiB, dynamic shared memory must be opted into per kernel.
        self.decode_smem = decode_smem_bytes(head_dim)
        self.prefill_smem = prefill_smem_bytes(head_dim)
        self.decode.max_dynamic_shared_size_bytes = self.decode_smem
        self.prefill.max_dynamic_shared_size_bytes = self.prefill_smem


class CudaBackend:
    """``AttentionBackend`` on CuPy RawModule kernels; see ``TorchBackend`` for the semantics."""

    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda") -> None:
        """Import CuPy and compile the KV-write kernel on ``device``.

        Raises ``BackendUnavailable`` (one line) when CuPy is missing or broken, the GPU is
        older than sm_80, or NVRTC cannot compile the kernels.
        """
        device = torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device_index = index
        major, minor = torch.cuda.get_device_capability(index)
        if major < 8:
            raise BackendUnavailable(f"the cuda kernels need sm_80+, GPU is sm_{major}{minor}")
        try:
            import cupy
        except Exception as exc:  # ImportError, or a CuPy that cannot find its CUDA libraries
            raise BackendUnavailable(f"cupy is not importable: {_one_line(exc)}") from exc
        self._cupy = cupy
        self._device = cupy.cuda.Device(index)
        self._streams: dict[int, Any] = {}
        self._configs: dict[tuple[torch.dtype, int, int], _Kernels] = {}
        self.num_sms = torch.cuda.get_device_properties(index).multi_processor_count
        try:
            with cupy.cuda.Device(index):
                module = cupy.RawModule(
                    code=kernel_source("reshape_and_cache.cu"), options=NVRTC_OPTIONS
                )
                self._write_kv = module.get_function("reshape_and_cache")
        except Exception as exc:
            raise BackendUnavailable(f"cannot build the cuda kernels: {_one_line(exc)}") from exc

    # ---------------------------------------------------------------- plumbing

    def warmup(self, dtype: torch.dtype, head_dim: int, block_size: int) -> None:
        """Compile (or load from CuPy's disk cache) the kernels of one configuration now.

        Raises ``BackendUnavailable`` if NVRTC or the driver rejects them.
        """
        try:
            self._kernels(dtype, head_dim, block_size)
        except Exception as exc:
            raise BackendUnavailable(f"cannot build the cuda kernels: {_one_line(exc)}") from exc

    def _kernels(self, dtype: torch.dtype, head_dim: int, block_size: int) -> _Kernels:
        key = (dtype, head_dim, block_size)
        kernels = self._configs.get(key)
        if kernels is None:
            log.info("compiling attention kernels: %s head_dim=%d block_size=%d", *key)
            with self._cupy.cuda.Device(self.device_index):
                kernels = _Kernels(self._cupy, dtype, head_dim, block_size)
            self._configs[key] = kernels
        return kernels

    def _stream(self) -> Any:
        """torch's current stream on our device, as a CuPy stream (a context manager)."""
        ptr = torch.cuda.current_stream(self.device_index).cuda_stream
        stream = self._streams.get(ptr)
        if stream is None:
            stream = self._cupy.cuda.ExternalStream(ptr, self.device_index)
            self._streams[ptr] = stream
        return stream

    def _launch(self, kernel: Any, grid: tuple[int, ...], block: int, args: tuple, smem: int = 0):
        # The stream goes to the launch itself: entering it as a context manager on every
        # launch costs host time that a one-token decode step can see.
        with self._device:
            kernel(grid, (block,), args, shared_mem=smem, stream=self._stream())

    def _check_device(self, t: Tensor) -> None:
        if t.device.index != self.device_index:
            raise ValueError(
                f"k_cache: is on {t.device} but this backend runs on cuda:{self.device_index}"
            )

    # ---------------------------------------------------------------- ops

    def write_kv(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
        *, slots_valid: bool = False,
    ) -> None:
        """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the caches.

        Slot ``-1`` is skipped by the kernel itself (``slots_valid`` changes nothing). Slots
        are not range-checked (that would need a device sync): every other slot must be
        below ``num_blocks * block_size``.
        """
        check_cuda_write_kv_args(key, value, k_cache, v_cache, slot_mapping)
        self._check_device(k_cache)
        if key.shape[0] == 0:
            return
        row_elems = k_cache.shape[2] * k_cache.shape[3]
        args = (
            _ptr(key),
            _ptr(value),
            _ptr(k_cache),
            _ptr(v_cache),
            _ptr(slot_mapping),
            np.int64(key.stride(0)),
            np.int64(value.stride(0)),
            np.int32(row_elems),
        )
        self._launch(self._write_kv, (key.shape[0],), CACHE_THREADS, args)

    def paged_attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
        cu_seqlens_q: Tensor, scale: float, max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None, *, sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        """The protocol's paged attention (ops/base.py) through the CUDA kernels:
        ``[total_q, H, D]``.

        ``sliding_window`` and ``softcap`` are the kernels' own work (see ``TorchBackend``
        for their meaning): decode partitions only the window's keys, prefill skips the
        tiles before a row's window and masks the ones across its edge.

        ``max_seqlen_q`` / ``max_seqlen_k`` (upper bounds on the query and context lengths)
        size the grids; pass them to avoid a device-to-host sync each. With
        ``max_seqlen_q == 1`` only the split-K decode kernel runs; otherwise the prefill
        kernel serves every sequence with more than one query token and the decode kernel
        the rest.
        """
        check_cuda_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
        features = score_features(scale, sliding_window, softcap)
        self._check_device(k_cache)
        num_tokens, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        num_seqs = seq_lens.shape[0]
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if num_tokens == 0 or num_seqs == 0:
            return out
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        if max_seqlen_k is None:
            max_seqlen_k = int(seq_lens.max())
        if features[0] > 0:
            max_seqlen_k = min(max_seqlen_k, int(features[0]))  # decode splits the window only
        kernels = self._kernels(q.dtype, head_dim, block_size)
        group = num_heads // num_kv_heads
        scale_log2 = np.float32(scale * LOG2E)
        common = (
            _ptr(q),
            np.int64(q.stride(0)),
            _ptr(k_cache),
            _ptr(v_cache),
            _ptr(block_tables),
            np.int32(block_tables.stride(0)),
            _ptr(seq_lens),
            _ptr(cu_seqlens_q),
            _ptr(out),
        )

        if max_seqlen_q > 1:
            row_tiles = math.ceil(max_seqlen_q * group / PREFILL_ROWS)
            args = (*common, np.int32(num_heads), np.int32(num_kv_heads), scale_log2, *features)
            self._launch(
                kernels.prefill,
                (row_tiles, num_kv_heads, num_seqs),
                PREFILL_THREADS,
                args,
                kernels.prefill_smem,
            )
            if num_tokens == num_seqs * max_seqlen_q:
                return out  # every sequence has max_seqlen_q > 1 query tokens: no decode rows

        self._decode(kernels, common, scale_log2, features, out, num_seqs, num_kv_heads,
                     max_seqlen_k)
        return out

    def _decode(self, kernels: _Kernels, common: tuple, scale_log2: np.float32,
                features: tuple[np.int32, np.float32, np.float32], out: Tensor, num_seqs: int,
                num_kv_heads: int, max_seqlen_k: int) -> None:
        """Launch the split-K decode kernel (and its reduce, when split) for the decode rows;
        ``common`` is the argument head both kernels share (``paged_attention``'s), and
        ``max_seqlen_k`` bounds the keys each sequence attends to (its window, if shorter)."""
        num_heads, head_dim = out.shape[1], out.shape[2]
        group = num_heads // num_kv_heads
        plan = plan_decode_splits(num_seqs, num_kv_heads, group, max_seqlen_k, self.num_sms)
        tmp_out = tmp_m = tmp_l = None
        if plan.num_splits > 1:
            f32 = dict(dtype=torch.float32, device=out.device)
            tmp_out = torch.empty((num_seqs, num_heads, plan.num_splits, head_dim), **f32)
            tmp_m = torch.empty((num_seqs, num_heads, plan.num_splits), **f32)
            tmp_l = torch.empty((num_seqs, num_heads, plan.num_splits), **f32)
        args = (
            *common,
            _ptr(tmp_out),
            _ptr(tmp_m),
            _ptr(tmp_l),
            np.int32(num_heads),
            np.int32(num_kv_heads),
            np.int32(plan.partition),
            np.int32(plan.num_splits),
            scale_log2,
            *features,
        )
        grid = (num_kv_heads * math.ceil(group / DECODE_ROWS), num_seqs, plan.num_splits)
        self._launch(kernels.decode, grid, DECODE_THREADS, args, kernels.decode_smem)
        if plan.num_splits > 1:
            seq_lens_ptr, cu_seqlens_q_ptr = common[6], common[7]
            args = (
                _ptr(tmp_out),
                _ptr(tmp_m),
                _ptr(tmp_l),
                seq_lens_ptr,
                cu_seqlens_q_ptr,
                _ptr(out),
                np.int32(num_heads),
                np.int32(plan.partition),
                np.int32(plan.num_splits),
                features[0],
            )
            self._launch(kernels.reduce, (num_heads, num_seqs), head_dim, args)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"
