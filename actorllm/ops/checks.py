"""Argument checks for the paged KV-cache ops (DESIGN.md section 5).

Plain functions that take tensors and raise ``ValueError`` naming the offending
argument. They read only metadata (shape, dtype, stride, device), never tensor
values, so they cost no device synchronisation and run on CPU in unit tests.

``check_write_kv_args`` and ``check_paged_attention_args`` state the contract
every backend shares; ``check_cuda_kernel_args`` adds what the CUDA kernels
need on top (device, dtype, head size, block size, strides).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

#: What the CUDA kernels are instantiated for (actorllm/kernels/*.cu).
CUDA_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
CUDA_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
CUDA_BLOCK_SIZES: tuple[int, ...] = (16, 32)


def _fail(name: str, what: str) -> None:
    raise ValueError(f"{name}: {what}")


def _check_ndim(name: str, t: Tensor, ndim: int, layout: str) -> None:
    if not isinstance(t, Tensor):
        _fail(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(name, f"expected {ndim} dims {layout}, got shape {tuple(t.shape)}")


def _check_dtype(name: str, t: Tensor, dtypes: Iterable[torch.dtype]) -> None:
    dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        _fail(name, f"dtype must be {allowed}, got {str(t.dtype).removeprefix('torch.')}")


def _check_same_device(tensors: dict[str, Tensor]) -> None:
    names = list(tensors)
    first = tensors[names[0]].device
    for n in names[1:]:
        if tensors[n].device != first:
            _fail(n, f"is on {tensors[n].device} but {names[0]} is on {first}")


def _check_caches(k_cache: Tensor, v_cache: Tensor) -> None:
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    _check_ndim("k_cache", k_cache, 4, layout)
    _check_ndim("v_cache", v_cache, 4, layout)
    if v_cache.shape != k_cache.shape:
        _fail("v_cache", f"shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        _fail("v_cache", f"dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            _fail(name, "must be contiguous")


def check_write_kv_args(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Check ``write_kv`` arguments against the contract.

    Raises ValueError whose message starts with the offending argument's name.
    """
    _check_caches(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        _check_ndim(name, t, 3, "[num_tokens, num_kv_heads, head_dim]")
        if tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            _fail(
                name,
                f"shape {tuple(t.shape)} does not match the cache's "
                f"(num_kv_heads, head_dim) = ({num_kv_heads}, {head_dim})",
            )
        if t.dtype != k_cache.dtype:
            _fail(name, f"dtype {t.dtype} != cache dtype {k_cache.dtype}")
    _check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    _check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    if value.shape[0] != key.shape[0]:
        _fail("value", f"has {value.shape[0]} tokens but key has {key.shape[0]}")
    if slot_mapping.shape[0] != key.shape[0]:
        n = slot_mapping.shape[0]
        _fail("slot_mapping", f"has {n} entries but key has {key.shape[0]} tokens")
    _check_same_device(
        {
            "k_cache": k_cache,
            "v_cache": v_cache,
            "key": key,
            "value": value,
            "slot_mapping": slot_mapping,
        }
    )


def check_paged_attention_args(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    cu_seqlens_q: Tensor,
) -> None:
    """Check ``paged_attention`` arguments against the contract.

    Raises ValueError whose message starts with the offending argument's name.
    """
    _check_caches(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    _check_ndim("q", q, 3, "[total_q_tokens, num_heads, head_dim]")
    if q.shape[2] != head_dim:
        _fail("q", f"head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if q.shape[1] % num_kv_heads != 0 or q.shape[1] == 0:
        _fail("q", f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.dtype != k_cache.dtype:
        _fail("q", f"dtype {q.dtype} != cache dtype {k_cache.dtype}")
    _check_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks]")
    _check_dtype("block_tables", block_tables, (torch.int32,))
    _check_ndim("seq_lens", seq_lens, 1, "[num_seqs]")
    _check_dtype("seq_lens", seq_lens, (torch.int32,))
    _check_ndim("cu_seqlens_q", cu_seqlens_q, 1, "[num_seqs + 1]")
    _check_dtype("cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        rows = block_tables.shape[0]
        _fail("block_tables", f"has {rows} rows but seq_lens has {num_seqs} entries")
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        n = cu_seqlens_q.shape[0]
        _fail("cu_seqlens_q", f"has {n} entries, expected num_seqs + 1 = {num_seqs + 1}")
    _check_same_device(
        {
            "q": q,
            "k_cache": k_cache,
            "v_cache": v_cache,
            "block_tables": block_tables,
            "seq_lens": seq_lens,
            "cu_seqlens_q": cu_seqlens_q,
        }
    )


def _check_kernel_caches(k_cache: Tensor, v_cache: Tensor, device_type: str) -> None:
    if k_cache.device.type != device_type:
        _fail("k_cache", f"must be on a {device_type} device, got {k_cache.device}")
    _check_dtype("k_cache", k_cache, CUDA_DTYPES)
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    if head_dim not in CUDA_HEAD_DIMS:
        _fail("k_cache", f"head_dim {head_dim} has no CUDA kernel (have {CUDA_HEAD_DIMS})")
    if block_size not in CUDA_BLOCK_SIZES:
        _fail("k_cache", f"block_size {block_size} has no CUDA kernel (have {CUDA_BLOCK_SIZES})")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.data_ptr() % 16 != 0:
            _fail(name, "data must start on a 16-byte boundary")


def _check_rows(name: str, t: Tensor) -> None:
    # Each token's [heads, head_dim] must be dense; the token stride may be anything
    # (e.g. a slice of a fused QKV projection) that keeps rows 16-byte aligned, since the
    # kernels move 16-byte vectors.
    heads, head_dim = t.shape[1], t.shape[2]
    if t.shape[0] == 0:
        return
    if t.stride(2) != 1 or (heads > 1 and t.stride(1) != head_dim):
        _fail(name, f"each token's [heads, head_dim] must be contiguous, got strides {t.stride()}")
    if t.shape[0] > 1 and t.stride(0) % 8 != 0:
        _fail(name, f"token stride {t.stride(0)} must be a multiple of 8 elements (16 bytes)")
    if t.data_ptr() % 16 != 0:
        _fail(name, "data must start on a 16-byte boundary")


def check_cuda_write_kv_args(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, *,
    device_type: str = "cuda",
) -> None:
    """``check_write_kv_args`` plus what the CUDA ``reshape_and_cache`` kernel needs.

    ``device_type`` exists so tests can run every other rule on CPU tensors.
    """
    check_write_kv_args(key, value, k_cache, v_cache, slot_mapping)
    _check_kernel_caches(k_cache, v_cache, device_type)
    _check_rows("key", key)
    _check_rows("value", value)
    if not slot_mapping.is_contiguous():
        _fail("slot_mapping", "must be contiguous")


def check_cuda_paged_attention_args(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    cu_seqlens_q: Tensor, *, device_type: str = "cuda",
) -> None:
    """``check_paged_attention_args`` plus what the CUDA attention kernels need.

    ``device_type`` exists so tests can run every other rule on CPU tensors.
    """
    check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    _check_kernel_caches(k_cache, v_cache, device_type)
    _check_rows("q", q)
    if block_tables.shape[0] > 0 and block_tables.stride(1) != 1:
        _fail("block_tables", f"rows must be contiguous, got strides {block_tables.stride()}")
    for name, t in (("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)):
        if not t.is_contiguous():
            _fail(name, "must be contiguous")
