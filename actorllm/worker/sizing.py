"""How the ModelRunner sizes what it takes of the machine: torch's threads and the KV
cache's blocks when the caller gives no number (worker/runner.py)."""

from __future__ import annotations

import math

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
