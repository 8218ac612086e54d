"""Gated MLPs of a transformers model in one forward, checked before use.

Most decoder MLPs are ``down(act(gate(x)) * up(x))`` (Llama and the families copied from
it: Mistral, Qwen2/3, OLMo 2, Granite, Gemma with a GELU) or the same with ``gate`` and
``up`` as one linear (Phi-3's ``gate_up_proj``, whose output it chunks). Module by module
that is four module calls around the three GEMMs and a fresh tensor for the product each
layer. Phi-3's kind also runs its activation and product on strided halves of one GEMM's
output: standalone, at a prefill's 256 rows, its MLP took 4.0-4.6 ms as the module and
2.8-3.4 ms as below (Llama's kind 2-7 % less at 8 to 256 rows; thread CPU time, shared
machine), the output bit for bit the same in float32. Inside the whole forward the gain
is smaller: docs/architecture.md, "What each path costs".

:func:`fuse_gated_mlps` gives each such MLP instance a forward of three ``F.linear``
calls (gate and up on contiguous weights, Phi-3's as the two halves of its own), the
activation (``F.silu`` itself for SiLU) and an in-place product, as :mod:`.hf_kernels`
does for RMSNorms: modules, weights and the modeling code stay as they are. A swapped
forward is kept only if it reproduces the module's own output on a random probe (float
rounding: Phi-3's one GEMM may sum in another order than two); a module that does not
match (another formula, extra children, another signature) keeps its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import MethodType
from typing import Any

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


Halves = tuple[Tensor, Tensor | None, Tensor, Tensor | None]  # gate W, b; up W, b


def _gate_up(module: nn.Module) -> tuple[Halves, list[str]] | None:
    """``module``'s gate and up weights and biases (views of Phi-3's fused linear), and
    the names of its linears; None if it has neither layout."""
    fused = _linear(module, "gate_up_proj")
    if fused is not None:
        rows = fused.out_features // 2
        bias = fused.bias
        return (fused.weight[:rows], None if bias is None else bias[:rows],
                fused.weight[rows:], None if bias is None else bias[rows:]), ["gate_up_proj"]
    gate, up = _linear(module, "gate_proj"), _linear(module, "up_proj")
    if gate is None or up is None or gate.weight.shape != up.weight.shape:
        return None
    return (gate.weight, gate.bias, up.weight, up.bias), ["gate_proj", "up_proj"]


def _forward(halves: Halves, down: nn.Linear,
             act: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    gate_w, gate_b, up_w, up_b = halves
    down_w, down_b = down.weight, down.bias

    def gated(self: nn.Module, x: Tensor) -> Tensor:
        # Two GEMMs, not one of twice the width: at a decode step's 8 rows MKL took 20 %
        # longer for the wide one, and its halves would be strided for the activation.
        # The activation's output is a fresh tensor: multiplied in place, no third one.
        return F.linear(act(F.linear(x, gate_w, gate_b)).mul_(F.linear(x, up_w, up_b)),
                        down_w, down_b)

    return gated


def _reproduces(module: nn.Module, forward: Callable[..., Tensor], width: int) -> bool:
    weight = module.down_proj.weight
    probe = torch.randn(2, 3, width, dtype=weight.dtype, device=weight.device)
    return same_output(module, forward, (probe,), weight.dtype)


def same_output(module: nn.Module, forward: Callable[..., Tensor], args: tuple[Tensor, ...],
                dtype: torch.dtype) -> bool:
    """Whether ``forward``, bound to ``module``, gives the module's own output on ``args``
    (within float rounding for ``dtype``): the check every swapped forward passes before
    it is used. False where either raises (another signature or layout)."""
    try:
        with torch.inference_mode():
            want = module(*args)
            got = MethodType(forward, module)(*args)
    except Exception:  # another signature or layout: not ours to replace
        return False
    return isinstance(want, Tensor) and close(got, want, dtype)


def close(got: Tensor, want: Tensor, dtype: torch.dtype) -> bool:
    """Whether ``got`` is ``want`` within float rounding for ``dtype`` (relative to
    ``want``'s largest magnitude): how every swapped forward is judged on its probe."""
    if want.shape != got.shape or want.dtype != got.dtype:
        return False
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = want.abs().max().item() or 1.0
    return torch.allclose(got, want, rtol=tol, atol=tol * scale)


def swap_forward(module: nn.Module, forward: Callable[..., Any], marker: str) -> None:
    """Bind ``forward`` as ``module``'s own, and mark the module (``marker``) so that a
    second pass leaves it alone."""
    module.forward = MethodType(forward, module)
    setattr(module, marker, True)


def swap_or_keep(counts: dict[str, int], key: str, name: str, module: nn.Module,
                 forward: Callable[..., Any] | None, marker: str) -> None:
    """Swap in ``forward`` (counted under ``key``) or, where its probe failed (``None``),
    keep the module's own (counted under ``"kept"``): the end of every swapping pass."""
    if forward is None:
        log.debug("%s (%s) keeps its own forward", name, type(module).__name__)
        counts["kept"] += 1
        return
    swap_forward(module, forward, marker)
    counts[key] += 1


def fuse_gated_mlps(model: nn.Module) -> dict[str, int]:
    """Swap the forward of every gated MLP in ``model`` for one of direct functional calls.

    Returns ``{"fused": n, "kept": m}``: ``kept`` counts the modules that looked like a
    gated MLP but whose output the swapped forward did not reproduce. Idempotent.
    """
    counts = {"fused": 0, "kept": 0}
    for name, module in model.named_modules():
        down, found = _linear(module, "down_proj"), _activation(module)
        if down is None or found is None or getattr(module, _FUSED, False):
            continue
        gate_up = _gate_up(module)
        act_name, act = found
        if gate_up is None or {n for n, _ in module.named_children()} != \
                {*gate_up[1], "down_proj", act_name} \
                or gate_up[0][0].shape[0] != down.in_features:
            counts["kept"] += 1
            continue
        halves, _ = gate_up
        forward = _forward(halves, down, _DIRECT.get(type(act).__name__, act))
        swap_or_keep(counts, "fused", name, module,
                     forward if _reproduces(module, forward, down.out_features) else None,
                     _FUSED)
    return counts


def _gate(act: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    def apply_gate(self: nn.Module, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate).mul_(up)  # in place on the activation's fresh output

    return apply_gate


def fuse_expert_gates(model: nn.Module) -> int:
    """Give every mixture-of-experts block that gates with transformers' default
    ``_apply_gate`` (``act(gate) * up`` over the token-expert pairs' gate/up output) one
    that multiplies in place and calls ``F.silu`` directly; returns how many took it.

    At a 256-token prefill of the benchmark's Mixtral the default gate was about a tenth
    of the forward (the product a fresh ``[512, 1024]`` tensor a layer). Checked on a
    random probe like the MLPs; idempotent.
    """
    from transformers.integrations.moe import _default_apply_gate

    count = 0
    for module in model.modules():
        act = getattr(module, "act_fn", None)
        if getattr(type(module), "_apply_gate", None) is not _default_apply_gate \
                or "_apply_gate" in module.__dict__ or not isinstance(act, nn.Module):
            continue
        gate = MethodType(_gate(_DIRECT.get(type(act).__name__, act)), module)
        dtype = next(module.parameters()).dtype
        probe = torch.randn(5, 8, dtype=dtype)
        with torch.inference_mode():
            if not torch.equal(gate(probe), module._apply_gate(probe)):
                continue
        module._apply_gate = gate
        count += 1
    return count
