"""Gated MLPs of a transformers model in one gate/up GEMM, checked before use.

Most decoder MLPs are ``down(act(gate(x)) * up(x))`` (Llama and the families copied from
it: Mistral, Qwen2/3, OLMo 2, Granite, Gemma with a GELU) or the same with ``gate`` and
``up`` already one linear (Phi-3's ``gate_up_proj``). Module by module that is four
module calls, three GEMM calls and a fresh tensor for the product each layer; the native
model runs one ``gate_up`` GEMM, the activation, an in-place product and ``down``.

:func:`fuse_gated_mlps` gives each such MLP instance that forward, as
:mod:`.hf_kernels` does for RMSNorms: ``gate_proj`` and ``up_proj`` keep their
``nn.Linear`` modules, but their weights (and biases) become the two halves of one
tensor, so the fused GEMM costs no second copy of them, and the modeling code is
untouched. A swapped forward is kept only if it reproduces the module's own output on a
random probe (float rounding: one GEMM may sum in another order than two); a module
that does not match (another formula, extra children, another signature) keeps its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import MethodType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

_FUSED = "_actorllm_fused_mlp"
_ACTIVATIONS = ("act_fn", "activation_fn")
# The activation modules that are one functional call: called directly, no module call.
_DIRECT: dict[str, Callable[[Tensor], Tensor]] = {
    "SiLUActivation": F.silu, "SiLU": F.silu,
}


def _activation(module: nn.Module) -> tuple[str, nn.Module] | None:
    for name in _ACTIVATIONS:
        act = getattr(module, name, None)
        if isinstance(act, nn.Module):
            return name, act
    return None


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    child = getattr(module, name, None)
    return child if type(child) is nn.Linear else None


def _gate_up(module: nn.Module) -> tuple[Tensor, Tensor | None, list[str]] | None:
    """The fused gate/up weight and bias of ``module`` (gate rows first), and the names
    of its linears; None if it has neither layout."""
    fused = _linear(module, "gate_up_proj")
    if fused is not None:
        return fused.weight, fused.bias, ["gate_up_proj"]
    gate, up = _linear(module, "gate_proj"), _linear(module, "up_proj")
    if gate is None or up is None or gate.weight.shape != up.weight.shape \
            or (gate.bias is None) != (up.bias is None):
        return None
    with torch.no_grad():
        weight = torch.cat([gate.weight, up.weight])
        bias = torch.cat([gate.bias, up.bias]) if gate.bias is not None else None
    return weight, bias, ["gate_proj", "up_proj"]


def _forward(weight: Tensor, bias: Tensor | None, down: nn.Linear,
             act: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    down_weight, down_bias = down.weight, down.bias

    def gated(self: nn.Module, x: Tensor) -> Tensor:
        gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
        # The activation's output is a fresh tensor: multiplied in place, no third one.
        return F.linear(act(gate).mul_(up), down_weight, down_bias)

    return gated


def _reproduces(module: nn.Module, forward: Callable[..., Tensor], width: int) -> bool:
    weight = module.down_proj.weight
    probe = torch.randn(2, 3, width, dtype=weight.dtype, device=weight.device)
    try:
        with torch.inference_mode():
            want = module(probe)
            got = MethodType(forward, module)(probe)
    except Exception:  # another signature: not ours to replace
        return False
    if not isinstance(want, Tensor) or want.shape != got.shape or want.dtype != got.dtype:
        return False
    tol = 1e-5 if weight.dtype == torch.float32 else 2e-2
    scale = want.abs().max().item() or 1.0
    return torch.allclose(got, want, rtol=tol, atol=tol * scale)


def _share(module: nn.Module, names: list[str], weight: Tensor, bias: Tensor | None) -> None:
    """Point ``gate_proj``/``up_proj`` at the halves of the fused tensors."""
    if len(names) == 1:
        return  # gate_up_proj already is the fused tensor
    rows = weight.shape[0] // 2
    for i, name in enumerate(names):
        linear = getattr(module, name)
        linear.weight = nn.Parameter(weight[i * rows:(i + 1) * rows], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[i * rows:(i + 1) * rows], requires_grad=False)


def fuse_gated_mlps(model: nn.Module) -> dict[str, int]:
    """Swap the forward of every gated MLP in ``model`` for one with a single gate/up GEMM.

    Returns ``{"fused": n, "kept": m}``: ``kept`` counts the modules that looked like a
    gated MLP but whose output the fused forward did not reproduce. Idempotent.
    """
    counts = {"fused": 0, "kept": 0}
    for name, module in model.named_modules():
        down, found = _linear(module, "down_proj"), _activation(module)
        if down is None or found is None or getattr(module, _FUSED, False):
            continue
        gate_up = _gate_up(module)
        act_name, act = found
        if gate_up is None or {n for n, _ in module.named_children()} != \
                {*gate_up[2], "down_proj", act_name} \
                or gate_up[0].shape[0] != 2 * down.in_features:
            counts["kept"] += 1
            continue
        weight, bias, names = gate_up
        call = _DIRECT.get(type(act).__name__, act)
        forward = _forward(weight, bias, down, call)
        if not _reproduces(module, forward, weight.shape[1]):
            log.debug("%s (%s) keeps its own forward", name, type(module).__name__)
            counts["kept"] += 1
            continue
        _share(module, names, weight, bias)
        module.forward = MethodType(forward, module)
        setattr(module, _FUSED, True)
        counts["fused"] += 1
    return counts
