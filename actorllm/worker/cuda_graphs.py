"""Decode steps replayed from CUDA graphs (issue 28, ``--cuda-graphs``). Owned by the Worker.

Why: on a GPU a decode step of a small model is a hundred or so kernel launches, each
a few microseconds of Python and driver work on the host, while the device's share of
the step is about a millisecond; the host is the step. A CUDA graph records the
launches of one forward pass once and replays them with one call, as vLLM and SGLang
do for decode.

A graph fixes its shapes and the addresses it reads, so (as in those engines):

- Steps are bucketed by row count (``graph_sizes``: 1, 2, 4, then every multiple of 8
  up to ``max_rows``); a step of ``n`` rows runs in the smallest bucket that holds it,
  its rows first and the rest padding.
- The inputs live in static buffers sized for the largest bucket. ``run`` copies a
  step's ``ForwardBatch`` into their first ``n`` rows and replays. A padding row writes
  no K/V (its slot is -1, which every backend skips) and its output is cut off; its
  other inputs are whatever a real row left there on an earlier step, which reads only
  blocks that exist. The slots are the one input that must be reset every step: a
  stale slot there would write into a block that may by now belong to someone else
  (tests/test_cuda_graphs.py plants that bug).
- The attention kernels' split of each context (``plan_decode_splits``) is planned at
  capture for ``max_seqlen_k``, the longest context the engine allows, instead of the
  step's longest; the kernels stop at each row's own length.
- Only decode steps are captured (one token per row, ``max_seqlen_q == 1``); prefill
  chunks and speculative verify steps run eagerly.

Capture happens once, when the runner is built, largest bucket first so the smaller
ones reuse its memory pool. ``capture=False`` runs the padded batch eagerly instead of
replaying it, which is what the graph would replay: it lets a machine without a GPU
test the padding and the buffers (the capture itself is tested in tests/gpu).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable

import torch
from torch import Tensor

from actorllm.model import ForwardBatch

log = logging.getLogger(__name__)

Forward = Callable[[ForwardBatch], Tensor]


def graph_sizes(max_rows: int) -> tuple[int, ...]:
    """The row counts a graph is captured for: 1, 2, 4, the multiples of 8 below
    ``max_rows``, and ``max_rows`` itself."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be positive, got {max_rows}")
    sizes = {s for s in (1, 2, 4) if s < max_rows} | set(range(8, max_rows, 8)) | {max_rows}
    return tuple(sorted(sizes))


def check_graphs(rows: int, device: torch.device, tensor_parallel: bool, impl: str) -> None:
    """ValueError (one line, naming the flag) where ``rows`` > 0 asks for graphs that this
    runner cannot capture: not on a GPU, with tensor parallelism (whose ranks run the
    forward), or on the transformers path (its modules are not known to be capturable)."""
    if rows <= 0:
        return
    if device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a CUDA device, got {device}")
    if tensor_parallel:
        raise ValueError("--cuda-graphs does not run with --tensor-parallel-size > 1 yet")
    if impl != "native":
        raise ValueError("--cuda-graphs needs the native model path (--model-impl native: "
                         "Llama, Mistral, Qwen2, Qwen3), got the transformers path")


class DecodeGraphs:
    """The captured forward passes of decode steps, one per bucket of row counts.

    ``forward`` is the model's forward pass over a ``ForwardBatch`` (hidden states of its
    rows); ``max_seqlen_k`` is the longest context the engine allows, in blocks of
    ``block_size`` tokens.
    """

    def __init__(self, forward: Forward, max_rows: int, max_seqlen_k: int, block_size: int,
                 device: torch.device, *, capture: bool = True) -> None:
        self.forward = forward
        self.sizes = graph_sizes(max_rows)
        self.max_seqlen_k = max_seqlen_k
        self.max_blocks = max_blocks = math.ceil(max_seqlen_k / block_size)
        top = self.sizes[-1]
        on = {"device": device}
        self.input_ids = torch.zeros(top, dtype=torch.int64, **on)
        self.positions = torch.zeros(top, dtype=torch.int64, **on)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, **on)
        # A padding row that no real row has used yet sees one key, in block 0.
        self.seq_lens = torch.ones(top, dtype=torch.int32, **on)
        self.block_tables = torch.zeros((top, max_blocks), dtype=torch.int32, **on)
        self.ordinal = torch.arange(top + 1, dtype=torch.int32, **on)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.replays = 0  # steps run from a graph (or, without capture, as one would)
        if capture:
            self._capture()

    def static_batch(self, size: int) -> ForwardBatch:
        """The batch a graph of ``size`` rows reads: views of the static buffers."""
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], cu_seqlens_q=self.ordinal[:size + 1],
            sample_indices=self.ordinal[:size].long(), max_seqlen_q=1,
            max_seqlen_k=self.max_seqlen_k)

    @torch.inference_mode()  # as the steps run: no autograd records in the graphs
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.input_ids.device)
        for size in reversed(self.sizes):  # the largest first: the rest reuse its pool
            batch = self.static_batch(size)
            # Warm up outside the graph (cuBLAS picks its kernels and workspaces on the
            # first call; nothing may allocate that way during capture). The slots are
            # all -1 here, so neither pass writes the cache.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.forward(batch)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize(self.input_ids.device)
        log.info("captured decode steps of %s rows in CUDA graphs", ", ".join(
            map(str, self.sizes)))

    def applies(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is a decode step a graph can run: one token per row, no more
        rows than the largest bucket, contexts within the bounds captured for."""
        rows = batch.seq_lens.shape[0]
        return (batch.max_seqlen_q == 1 and batch.input_ids.shape[0] == rows
                and 0 < rows <= self.sizes[-1] and batch.max_seqlen_k <= self.max_seqlen_k
                and batch.block_tables.shape[1] <= self.max_blocks)

    def run(self, batch: ForwardBatch) -> Tensor:
        """The hidden states of ``batch``'s rows (``applies`` must hold), from the graph
        of the smallest bucket that holds them. The result is a view of the graph's
        output: the next ``run`` overwrites it."""
        rows = batch.seq_lens.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, rows)]
        self.input_ids[:rows].copy_(batch.input_ids, non_blocking=True)
        self.positions[:rows].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:rows].copy_(batch.slot_mapping, non_blocking=True)
        self.slot_mapping[rows:size].fill_(-1)  # padding writes no K/V (see the module)
        self.seq_lens[:rows].copy_(batch.seq_lens, non_blocking=True)
        width = batch.block_tables.shape[1]
        self.block_tables[:rows, :width].copy_(batch.block_tables, non_blocking=True)
        self.replays += 1
        if self._graphs:
            graph, out = self._graphs[size]
            graph.replay()
        else:
            out = self.forward(self.static_batch(size))
        return out[:rows]
