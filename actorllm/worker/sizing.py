"""How the ModelRunner sizes what it takes of the machine: torch's threads and the KV
cache's blocks when the caller gives no number, and how much freed memory the process's
heap keeps between steps (worker/runner.py)."""

from __future__ import annotations

import ctypes
import math
import os

import torch

from actorllm.cpus import usable_cpus
from actorllm.model.parallel import TensorParallel

_CPU_KV_BYTES = 256 << 20  # default CPU cache budget
_CPU_KV_FULL_SEQS = 16  # ... but never more than this many full-length sequences need
_GPU_KV_FRACTION = 0.8  # default share of free GPU memory (after weights) for the cache


def default_num_blocks(device: torch.device, max_model_len: int, block_size: int,
                       kv_cache_bytes: int | None, block_bytes: int) -> int:
    """KV blocks of ``block_bytes`` for ``kv_cache_bytes``, else the device's default: a
    share of the GPU's free memory, or a CPU budget capped at what a few full-length
    sequences need."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes // block_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * _GPU_KV_FRACTION) // block_bytes
    full_seqs = _CPU_KV_FULL_SEQS * math.ceil(max_model_len / block_size)
    return min(_CPU_KV_BYTES // block_bytes, full_seqs)


def torch_threads(tp: TensorParallel, device: torch.device,
                  num_threads: int | None) -> int | None:
    """Set torch's intra-op threads for this process; the count the ranks get too."""
    if num_threads is None and device.type == "cpu":
        # The CPUs this process may use: its affinity (taskset counts) cut to a cgroup's
        # quota, which torch's own default does not see; the ranks share them.
        cores = usable_cpus()
        if tp.enabled:
            num_threads = max(1, cores // tp.world)
        elif cores < torch.get_num_threads():
            num_threads = cores
    if num_threads is not None:
        # Process-wide: the Worker's is the only torch work in its process.
        torch.set_num_threads(num_threads)
    return num_threads


# mallopt's parameters (malloc.h): keep freed memory at the heap's top up to this many
# bytes, and serve requests up to MMAP (glibc's maximum, 32 MiB) from the heap.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_TRIM, _MMAP = 1 << 30, 32 << 20
_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")
_heap_kept = False


def keep_heap(device: torch.device) -> bool:
    """Let glibc's malloc keep the memory of a CPU step's large tensors for the next step.

    A prefill step of the embedded model allocates activations of megabytes per op
    ([2048, 1408] floats is 11 MiB). By default glibc serves each from a fresh ``mmap``
    (or gives a freed heap top back to the system) and the next step touches every page
    again: a 2,048-token step took ~135 ms, and ~95 ms with the thresholds below, in
    interleaved runs on this 2-core machine (tcmalloc, which vLLM's CPU build
    recommends, gives the same effect; it is not always installed). The cost: the
    process keeps its peak heap rather than returning it between steps.

    Once per process, on the CPU, on glibc, and only where the user set no ``MALLOC_*``
    variable of their own, preloads no other allocator, and did not set
    ``ACTORLLM_KEEP_HEAP=0``. Returns whether the thresholds were set now.
    """
    global _heap_kept
    if _heap_kept or device.type != "cpu" or os.environ.get("ACTORLLM_KEEP_HEAP") == "0":
        return False
    preload = os.environ.get("LD_PRELOAD", "")
    if any(k.startswith("MALLOC_") for k in os.environ) or any(a in preload
                                                               for a in _ALLOCATORS):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP) == 1 and \
            libc.mallopt(_M_TRIM_THRESHOLD, _TRIM) == 1
    except (OSError, AttributeError):  # not glibc
        return False
    _heap_kept = ok
    return ok
