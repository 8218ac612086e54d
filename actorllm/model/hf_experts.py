"""A leaner forward for transformers' fused experts (Mixtral, Qwen2/3-MoE), checked before use.

transformers' ``grouped_mm`` experts forward sorts the token-expert pairs by expert, runs
one grouped GEMM for gate/up and one for down, and then restores the pairs' order and sums
each token's ``top_k`` rows. Around the two GEMMs it builds the group offsets through a
float ``histc``, multiplies the routing weights into a fresh tensor, builds the inverse
permutation (``empty_like``, ``arange``, an index write), gathers by it and sums: at the
benchmark's Mixtral those steps, the router and the gate were 22 % of a MoE block's time
(thread CPU time, 32 and 256 tokens), the GEMMs the rest.

:func:`lean_experts` gives each such module instance a forward with the same sort and the
same GEMMs (``torch._grouped_mm`` over the same weights) but offsets from ``bincount``,
the routing weights multiplied in place and the rows added back with one ``index_add_``
into the output: no inverse permutation, no gather, no ``[tokens, top_k, hidden]`` sum.
The gate stays the module's own ``_apply_gate`` (:func:`.hf_mlp.fuse_expert_gates`'s, where
it took). Per token the ``top_k`` rows are added in expert order rather than in routing
order; with two experts a token (Mixtral) that is the same sum bit for bit on one
intra-op thread, with more experts or threads it differs by float rounding. A forward
is kept only if it reproduces the module's own output on a random probe.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from actorllm.model.hf_mlp import same_output, swap_or_keep

_LEAN = "_actorllm_lean_experts"


def _grouped_mm() -> Callable[..., Tensor] | None:
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn if callable(fn) else None


def _forward(mm: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def experts(self: nn.Module, hidden: Tensor, top_k_index: Tensor,
                top_k_weights: Tensor) -> Tensor:
        top_k = top_k_index.shape[-1]
        expert_ids = top_k_index.reshape(-1)
        # Stable, so that a token's rows within one expert keep the routing order.
        sorted_ids, order = torch.sort(expert_ids, stable=True)
        tokens = order // top_k
        offsets = torch.bincount(sorted_ids, minlength=self.num_experts).cumsum(
            0, dtype=torch.int32)
        # On the CPU in float32 the weights are stored transposed (hf_layout), so these
        # views are contiguous.
        gate_up = mm(hidden.index_select(0, tokens), self.gate_up_proj.transpose(-2, -1),
                     offs=offsets)
        down = mm(self._apply_gate(gate_up), self.down_proj.transpose(-2, -1), offs=offsets)
        down.mul_(top_k_weights.reshape(-1)[order].unsqueeze(-1).to(down.dtype))
        out = torch.zeros_like(hidden)
        return out.index_add_(0, tokens, down.to(hidden.dtype))

    return experts


def _eligible(module: nn.Module) -> bool:
    weights = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
    return (getattr(module, "has_gate", False) and not getattr(module, "has_bias", True)
            and not getattr(module, "has_post_expert_norm", True)
            and not getattr(module, "is_transposed", True)
            and not getattr(module, "_is_expert_parallel", True)
            and isinstance(getattr(module, "num_experts", None), int)
            # Measured on the CPU only; on a GPU transformers' own checks choose the kernel
            # (grouped_mm's dtype and alignment needs there).
            and all(isinstance(w, Tensor) and w.dim() == 3 and w.device.type == "cpu"
                    for w in weights)
            and callable(getattr(module, "_apply_gate", None)))


def _reproduces(module: nn.Module, forward: Callable[..., Tensor], top_k: int) -> bool:
    weight: Tensor = module.gate_up_proj
    gen = torch.Generator().manual_seed(0)
    tokens, hidden_dim = 13, weight.shape[-1]
    hidden = torch.randn(tokens, hidden_dim, generator=gen).to(weight.device, weight.dtype)
    index = torch.stack([torch.randperm(module.num_experts, generator=gen)[:top_k]
                         for _ in range(tokens)]).to(weight.device)
    scores = torch.rand(tokens, top_k, generator=gen).to(weight.device)
    return same_output(module, forward, (hidden, index, scores), weight.dtype)


def lean_experts(model: nn.Module) -> int:
    """Give every fused-experts module of ``model`` on the CPU that routes through
    transformers' ``grouped_mm`` forward the lean one; returns how many took it.
    Idempotent."""
    mm = _grouped_mm()
    config = getattr(model, "config", None)
    if mm is None or getattr(config, "_experts_implementation", None) != "grouped_mm":
        return 0
    top_k = getattr(config, "num_experts_per_tok", None) or 2
    counts = {"lean": 0, "kept": 0}
    for name, module in model.named_modules():
        if getattr(module, _LEAN, False) or not _eligible(module):
            continue
        forward = _forward(mm)
        swap_or_keep(counts, "lean", name, module,
                     forward if _reproduces(module, forward, min(top_k, module.num_experts))
                     else None, _LEAN)
    return counts["lean"]
