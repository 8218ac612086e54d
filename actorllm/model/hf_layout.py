"""Weights of a transformers model laid out the way the CPU's GEMM reads them fastest.

``nn.Linear`` keeps its weight as ``[out, in]`` and ``F.linear`` multiplies by its
transpose; transformers' fused experts keep ``[experts, out, in]`` and hand
``grouped_mm`` the transposed view. On the CPU in float32 (MKL through ``F.linear``,
torch's own ``_grouped_mm``) the same product reads a weight stored ``[in, out]`` faster
at few rows: thread CPU time, one thread, best fifth of 200 calls, a ``[256, 1024]``
linear at 8 rows 41 against 28 us, at 32 rows 133 against 102 us, at 64 rows 251
against 209 us, level from 256 rows on (1718 against 1701 us at 512); Mixtral's
experts (8 of 1024 by 256) at 64 token-expert pairs 1.55 against 0.95 ms for gate/up
and 0.62 against 0.44 ms for down, at 512 pairs 4.8 against 3.7 ms and 2.5 against
1.9 ms. A decode step is all few-row products, and linears are about half of it.

:func:`transpose_weights` therefore re-lays each such parameter in place: the parameter
keeps its shape and identity (the modeling code, ``state_dict`` keys and any code that
holds it see the same tensor), only its strides become those of a transpose, so
``weight.T`` and ``weight.transpose(-2, -1)`` are contiguous. Nothing is copied twice:
the old storage is freed. A weight that another module shares (an LM head tied to the
embeddings, which gathers rows) keeps its layout.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# Fused experts' 3-D weights as transformers names them ([experts, out, in] unless the
# module says ``is_transposed``).
_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


def _relay(param: nn.Parameter) -> None:
    # ``.data`` swaps the tensor under the same Parameter object, so every holder of it
    # (fused forwards built later, tied references) sees the new strides.
    param.data = param.data.transpose(-2, -1).contiguous().transpose(-2, -1)


def _worth_it(weight: Tensor) -> bool:
    # Measured on the CPU in float32 only; on a GPU cuBLAS reads either layout.
    return weight.device.type == "cpu" and weight.dtype == torch.float32 \
        and weight.is_contiguous()


def transpose_weights(model: nn.Module) -> dict[str, int]:
    """Store every ``nn.Linear`` weight and fused-expert weight of ``model`` as the
    transpose of a contiguous tensor (CPU, float32); returns ``{"linear": n, "experts": m}``.

    Call before anything takes views of the weights (``hf_mlp``'s Phi-3 halves). Idempotent:
    a weight already laid out so is not contiguous and is skipped.
    """
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    linear_weights = {id(m.weight) for m in linears}
    # A weight also held by a module other than a linear (tied embeddings) keeps its layout.
    shared = {id(p) for m in model.modules() if type(m) is not nn.Linear
              for p in m.parameters(recurse=False) if id(p) in linear_weights}
    counts = {"linear": 0, "experts": 0}
    for module in linears:
        weight = module.weight
        if id(weight) not in shared and _worth_it(weight):
            _relay(weight)
            counts["linear"] += 1
    for module in model.modules():
        if getattr(module, "is_transposed", False) or not hasattr(module, "num_experts"):
            continue
        for name in _EXPERT_WEIGHTS:
            weight = module._parameters.get(name)
            if weight is not None and weight.dim() == 3 and _worth_it(weight):
                _relay(weight)
                counts["experts"] += 1
    return counts
