"""Megatron-style tensor parallelism for the Llama-family model: which rank holds what.

:class:`TensorParallel` is one rank's view of a group of ``world`` processes. The model
asks it for its local head counts and for the all-reduce after each row-parallel
matmul; the loader asks it which slice of each checkpoint tensor this rank reads.

- **Column-parallel** (split the output features): ``q_proj`` by query heads,
  ``k_proj``/``v_proj`` by KV heads, ``gate_proj``/``up_proj`` by intermediate rows.
  Each rank computes its heads' attention on its own share of the KV cache.
- **Row-parallel** (split the input features): ``o_proj`` and ``down_proj``; each rank
  has a partial sum of the full output, and one all-reduce per matmul (two per layer)
  completes it. A row-parallel bias is loaded on rank 0 only (zeros elsewhere), so the
  all-reduce adds it exactly once.
- **KV heads.** With at least as many KV heads as ranks, each rank holds
  ``num_kv_heads / world``. With fewer, each KV head is replicated on
  ``world / num_kv_heads`` consecutive ranks: the ones whose query heads use it.
- **Replicated:** the embedding, the norms and the LM head. The embedding of the
  default model is 4 MiB; a vocabulary-parallel embedding and head would save memory
  on big vocabularies at the cost of one more all-reduce (or gather) per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PretrainedConfig

from actorllm.config import tensor_parallel_problem

# Checkpoint leaf module -> the dimension of its weight that is split across ranks.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split dim 0 (rows)
_ROW = ("o_proj", "down_proj")  # split dim 1 (columns); bias on rank 0 only


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``world``; collectives go over torch.distributed's default group."""

    rank: int = 0
    world: int = 1

    @property
    def enabled(self) -> bool:
        """More than one rank."""
        return self.world > 1

    def kv_heads(self, total: int) -> int:
        """KV heads this rank holds (one when they are replicated)."""
        return total // self.world if total >= self.world else 1

    def kv_head_start(self, total: int) -> int:
        """The first KV head this rank holds."""
        if total >= self.world:
            return self.rank * (total // self.world)
        return self.rank // (self.world // total)

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum ``x`` over the ranks in place (identity on one rank)."""
        if self.world > 1:
            torch.distributed.all_reduce(x)
        return x

    def shard(self, name: str, shape: tuple[int, ...], config: PretrainedConfig
              ) -> tuple[int, int, int] | None:
        """``(dim, start, length)`` of checkpoint tensor ``name`` that this rank reads, or
        None when it reads all of it (replicated tensors, and every tensor on one rank)."""
        if self.world == 1:
            return None
        module, _, leaf = name.rpartition(".")
        module = module.rpartition(".")[2]
        if module in _ROW:
            return None if leaf == "bias" else (1, *self._span(module, shape[1], config))
        if module in _COLUMN:
            return (0, *self._span(module, shape[0], config))
        return None

    def zero_on_this_rank(self, name: str) -> bool:
        """A row-parallel bias: read whole on rank 0, zeros on the others (added once)."""
        module, _, leaf = name.rpartition(".")
        return self.rank > 0 and leaf == "bias" and module.rpartition(".")[2] in _ROW

    def _span(self, module: str, size: int, config: PretrainedConfig) -> tuple[int, int]:
        if module in ("k_proj", "v_proj"):
            per_head = size // config.num_key_value_heads
            total = config.num_key_value_heads
            return self.kv_head_start(total) * per_head, self.kv_heads(total) * per_head
        part = size // self.world  # q heads, intermediate rows, o/down input columns
        return self.rank * part, part


# The attribute model.loader.load_config sets on a config to record the implementation.
IMPL_ATTR = "actorllm_model_impl"


def check_tensor_parallel(config: PretrainedConfig, world: int) -> None:
    """Raise a one-line ``ValueError`` unless the model splits evenly over ``world`` ranks
    (only the native model is sharded)."""
    if world > 1 and getattr(config, IMPL_ATTR, "native") != "native":
        raise ValueError(f"--tensor-parallel-size {world} needs the native model; "
                         f"{config.architectures[0]} runs through transformers "
                         "(--model-impl transformers)")
    problem = tensor_parallel_problem(world, config.num_attention_heads,
                                      config.num_key_value_heads, config.intermediate_size)
    if problem is not None:
        raise ValueError(problem)
