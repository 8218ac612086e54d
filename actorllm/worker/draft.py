"""Speculative decoding's draft model (``{"method": "draft_model"}``): the Worker's second,
smaller model, which fills the draft placeholders the Scheduler planned.

The Scheduler plans a speculating row as ``[last token, 0 x k]`` (``StepPlan.num_drafts``
= k) without knowing the drafts. Before the target runs, :meth:`DraftModel.fill` runs
the draft over the same packed batch, so its own KV cache (same block ids and slots as
the target's, its own layers and heads) holds K/V for every token the target computes:
prefill chunks, decode tokens, recompute after preemption (prefix-cached blocks were
written by both when they were first computed). A speculating row's first pass feeds
only its known token, at position p, and yields d1 (the draft's argmax); pass j feeds
d_j at p + j and yields d_{j+1}; the last only writes d_k's K/V. The placeholders are
replaced by d1..dk in the batch and the plan, and the target verifies them as it does
n-gram drafts: a greedy draft is a point mass, so the rejection sampling is exact.
Positions p .. p + k are all reserved by the Scheduler; a rejected draft's K/V is
overwritten in both caches when that position is computed again.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import attrs
import numpy as np
import torch
from torch import Tensor
from transformers import PretrainedConfig

from actorllm.model import ForwardBatch, KVCache, load_config, load_model, model_impl_of
from actorllm.model.llama import allocate_kv_caches, head_dim_of
from actorllm.ops import AttentionBackend, select_backend
from actorllm.ops.cpu_linear import pack_linears
from actorllm.ops.cpu_step import load_decode_step
from actorllm.wire.steps import StepPlan

log = logging.getLogger(__name__)


def draft_block_bytes(model_dir: str | Path | None, block_size: int, dtype: torch.dtype) -> int:
    """What one KV block costs the draft at ``model_dir`` (0 for no draft): the runner
    sizes the target's cache so that both fit its budget."""
    if model_dir is None:
        return 0
    config = load_config(model_dir, "auto")
    return (2 * config.num_hidden_layers * block_size * config.num_key_value_heads
            * head_dim_of(config) * dtype.itemsize)


class DraftModel:
    """The draft's weights and KV cache; owned by the ``ModelRunner`` (worker/runner.py),
    made beside the target's cache ``target_caches``: as many blocks of the same size,
    the same dtype and device. The target's attention ``backend`` when the head size is
    the same, else one chosen the same way for the draft's."""

    def __init__(self, model_dir: str | Path, target: PretrainedConfig,
                 target_caches: list[KVCache], backend: AttentionBackend) -> None:
        self.model_dir = str(model_dir)
        self.config = load_config(model_dir, "auto")
        if self.config.vocab_size != target.vocab_size:  # (EngineConfig checked it too)
            raise ValueError(f"--speculative-config: the draft model's vocab_size "
                             f"{self.config.vocab_size} is not the model's {target.vocab_size}")
        k_cache = target_caches[0][0]
        num_blocks, block_size = k_cache.shape[:2]
        self.device = k_cache.device
        self.model = load_model(self.model_dir, dtype=k_cache.dtype, device=self.device,
                                config=self.config)
        self.kv_caches: list[KVCache] = allocate_kv_caches(
            self.config, num_blocks, block_size, k_cache.dtype, self.device)
        mine = head_dim_of(self.config)
        self.backend = backend if mine == head_dim_of(target) else select_backend(
            backend.name, self.device, dtype=k_cache.dtype, head_dim=mine,
            block_size=block_size)
        # On the CPU its passes are mostly one token a row: one op call each, as the
        # target's decode steps (ops/cpu_step.py), and packed linears for the others.
        cpu_native = self.device.type == "cpu" and model_impl_of(self.config) == "native"
        packed = pack_linears(self.model) if cpu_native else 0
        self.decode_step = load_decode_step(self.model, self.backend) if packed else None
        log.info("draft model: %s, %d layers, %d KV blocks%s", self.model_dir,
                 self.config.num_hidden_layers, num_blocks,
                 ", passes of one token a row in one op" if self.decode_step else "")

    def fill(self, plan: StepPlan, batch: ForwardBatch) -> tuple[StepPlan, ForwardBatch]:
        """Run the draft over ``batch`` (``plan`` packed) and put its drafts where the
        plan has placeholders: the plan and the batch the target is to run."""
        q = np.asarray(plan.num_tokens, dtype=np.int64)
        d = np.zeros(len(q), dtype=np.int64)
        d[:len(plan.num_drafts)] = plan.num_drafts
        if not d.any():  # nothing to propose: the cache follows the target's tokens
            self._forward(batch)
            return plan, batch
        start = np.asarray(plan.start_pos, dtype=np.int64)
        known = q - d  # each row's tokens before its drafts
        cu = np.concatenate(([0], np.cumsum(q)))
        spec = np.flatnonzero(d)
        draft_at = cu[spec + 1] - d[spec]  # where each speculating row's d1 goes
        drafts = self._first_drafts(batch, q, known, start, spec)
        for j in range(1, int(d.max()) + 1):
            live = d[spec] >= j  # rows that feed d_j at p + j
            at = self._dev(draft_at[live] + j - 1)
            batch.input_ids[at] = drafts[self._dev(np.flatnonzero(live))]
            rows = spec[live]
            lens = start[rows] + known[rows] + j
            hidden = self._forward(ForwardBatch(
                input_ids=batch.input_ids[at], positions=batch.positions[at],
                slot_mapping=batch.slot_mapping[at],
                block_tables=batch.block_tables[self._dev(rows)],
                seq_lens=self._dev(lens, torch.int32),
                cu_seqlens_q=self._dev(np.arange(len(rows) + 1), torch.int32),
                sample_indices=self._dev(np.arange(len(rows))), max_seqlen_q=1,
                max_seqlen_k=int(lens.max()), slots_valid=batch.slots_valid))
            more = d[rows] > j  # rows that still want d_{j+1}
            if more.any():
                drafts[self._dev(np.flatnonzero(live)[more])] = self._argmax(
                    hidden[self._dev(np.flatnonzero(more))])
        where = np.concatenate([np.arange(a, a + n) for a, n in zip(draft_at, d[spec],
                                                                     strict=True)])
        token_ids = list(plan.token_ids)
        for i, t in zip(where.tolist(), batch.input_ids[self._dev(where)].tolist(),
                        strict=True):
            token_ids[i] = t
        return attrs.evolve(plan, token_ids=tuple(token_ids)), batch

    def _first_drafts(self, batch: ForwardBatch, q: np.ndarray, known: np.ndarray,
                      start: np.ndarray, spec: np.ndarray) -> Tensor:
        """The pass over the whole batch without the placeholders: K/V for every known
        token, and each speculating row's d1 (one per row of ``spec``)."""
        row_of = np.repeat(np.arange(len(q)), q)
        cu = np.concatenate(([0], np.cumsum(q)))
        keep = np.flatnonzero(np.arange(len(row_of)) - cu[row_of] < known[row_of])
        cu_known = np.concatenate(([0], np.cumsum(known)))
        lens = start + known
        at = self._dev(keep)
        hidden = self._forward(dataclasses.replace(
            batch, input_ids=batch.input_ids[at], positions=batch.positions[at],
            slot_mapping=batch.slot_mapping[at], seq_lens=self._dev(lens, torch.int32),
            cu_seqlens_q=self._dev(cu_known, torch.int32),
            sample_indices=self._dev(cu_known[spec + 1] - 1),
            max_seqlen_q=int(known.max()), max_seqlen_k=int(lens.max())))
        return self._argmax(hidden[self._dev(cu_known[spec + 1] - 1)])

    def _forward(self, batch: ForwardBatch) -> Tensor:
        if self.decode_step is not None and self.decode_step.applies(batch):
            return self.decode_step(batch, self.kv_caches)
        return self.model(batch, self.kv_caches, self.backend)

    def _argmax(self, hidden: Tensor) -> Tensor:
        """The draft's greedy tokens for these rows of its output."""
        return self.model.compute_logits(hidden).argmax(dim=-1)

    def _dev(self, a: np.ndarray, dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype)
