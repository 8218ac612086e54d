"""Shorter forwards for a transformers model's RMSNorm modules, checked before use.

A transformers RMSNorm (Llama's and the many copied from it, Gemma's ``1 + weight``
kind) is eight small tensor ops and a module call: upcast, square, mean, add, rsqrt,
multiply, downcast, scale. Two run in every decoder layer (four with Qwen3's or OLMo 2's
q/k norms), so at a decode step's few rows they cost as much as a layer's attention op
(``docs/architecture.md``, "What each path costs"). ``torch.nn.functional.rms_norm``
does the same in one op call (on the CPU still a composite, so the gain is the Python
dispatch and the dtype round trip: about 15 to 12 us a norm at decode sizes).

:func:`fuse_rms_norms` gives each such module instance a forward built on it, the way
transformers' kernel hub (``kernels.kernelize``) swaps a layer's forward: the module,
its weight and the modeling code stay as they are. A candidate forward is used only if
it reproduces the module's own output on a random probe (to float rounding in float32,
bit for bit in half precision); a norm that matches neither kind (another formula,
another signature) keeps its forward.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actorllm.model.hf_mlp import swap_or_keep

_FUSED = "_actorllm_fused_norm"  # marks a module whose forward was swapped


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _candidates(module: nn.Module, eps: float) -> list[tuple[str, Callable[..., Tensor]]]:
    """The forwards that might reproduce ``module``: Llama's kind, then Gemma's."""
    weight: Tensor = module.weight
    shape = (weight.shape[0],)
    def llama(self: nn.Module, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, eps)
        # The module normalises in float32 and scales after the cast back, as here.
        return self.weight * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)

    # Gemma scales by ``1 + weight`` in float32: computed once here, not each step.
    plus_one = (1.0 + weight.detach().float())

    def gemma(self: nn.Module, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), shape, plus_one, eps).to(x.dtype)

    return [("llama", llama), ("gemma", gemma)]


def _reproduces(module: nn.Module, forward: Callable[..., Tensor]) -> bool:
    weight = module.weight
    probe = torch.randn(2, 3, weight.shape[0], dtype=weight.dtype, device=weight.device) * 3
    try:
        with torch.inference_mode():
            want = module(probe)
            got = MethodType(forward, module)(probe)
    except Exception:  # a norm with another signature: not ours to replace
        return False
    if not isinstance(want, Tensor) or want.shape != got.shape or want.dtype != got.dtype:
        return False
    if weight.dtype == torch.float32:
        return torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    return torch.equal(got, want)


def fuse_rms_norms(model: nn.Module) -> dict[str, int]:
    """Swap the forward of every RMSNorm in ``model`` that a one-op forward reproduces.

    Returns how many modules got each kind (``{"llama": n, "gemma": m}``) and how many
    RMSNorm modules kept their own (``"kept"``). Idempotent.
    """
    counts = {"llama": 0, "gemma": 0, "kept": 0}
    checked: dict[tuple[type, str], bool] = {}  # a kind that failed once fails for its class
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not type(module).__name__.endswith("RMSNorm") or getattr(module, _FUSED, False):
            continue
        eps = _eps(module)
        if eps is None or not isinstance(weight, Tensor) or weight.dim() != 1 \
                or any(True for _ in module.children()):
            counts["kept"] += 1
            continue
        kind, forward = _first_reproducing(module, eps, checked)
        swap_or_keep(counts, kind, name, module, forward, _FUSED)
    return counts


def _first_reproducing(module: nn.Module, eps: float,
                       checked: dict[tuple[type, str], bool]
                       ) -> tuple[str, Callable[..., Tensor] | None]:
    """The first kind of forward that reproduces ``module`` and that forward, or
    ``("kept", None)``; a kind that failed once for the class is not probed again."""
    for kind, forward in _candidates(module, eps):
        key = (type(module), kind)
        if checked.get(key) is False:
            continue
        if _reproduces(module, forward):
            return kind, forward
        checked[key] = False
    return "kept", None
