"""The transformers path's one-op RMSNorm forwards (``actorllm/model/hf_kernels.py``).

Each must give what the module's own forward gives, or leave the module alone.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from actorllm.model.hf_kernels import fuse_rms_norms

DIM = 64


def _norms(cls: type[nn.Module], dtype: torch.dtype) -> nn.Module:
    """Two norms of ``cls`` with random weights, in a container as in a model."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": cls(DIM, eps=1e-6), "b": cls(DIM, eps=1e-5)})
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.5, 0.3)
    return model.to(dtype)


def _outputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model["a"](x), model["b"](x)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("cls", "kind"), [(LlamaRMSNorm, "llama"), (Gemma2RMSNorm, "gemma")])
def test_fused_norms_give_what_the_module_gives(cls: type[nn.Module], kind: str,
                                                dtype: torch.dtype) -> None:
    model = _norms(cls, dtype)
    original = copy.deepcopy(model)
    counts = fuse_rms_norms(model)
    assert counts[kind] == 2 and counts["kept"] == 0
    assert all("forward" in m.__dict__ for m in model.values())  # swapped per instance
    x = torch.randn(3, 5, DIM, dtype=dtype) * 4
    for got, want in zip(_outputs(model, x), _outputs(original, x), strict=True):
        assert got.dtype == want.dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got, want)


def test_fusing_twice_changes_nothing() -> None:
    model = _norms(LlamaRMSNorm, torch.float32)
    fuse_rms_norms(model)
    forwards = [m.__dict__["forward"] for m in model.values()]
    assert fuse_rms_norms(model) == {"llama": 0, "gemma": 0, "kept": 0}
    assert [m.__dict__["forward"] for m in model.values()] == forwards


class HalvedRMSNorm(LlamaRMSNorm):
    """Looks like Llama's norm (same attributes), computes something else."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states) * 0.5


@pytest.mark.parametrize(("cls", "dtype"), [
    (HalvedRMSNorm, torch.float32),
    # OLMo 2 scales before the cast back: in bfloat16 that rounds differently from
    # Llama's order, so the probe must refuse it (in float32 the two agree).
    (Olmo2RMSNorm, torch.bfloat16),
])
def test_a_norm_no_candidate_reproduces_keeps_its_forward(cls: type[nn.Module],
                                                          dtype: torch.dtype) -> None:
    model = _norms(cls, dtype)
    original = copy.deepcopy(model)
    assert fuse_rms_norms(model) == {"llama": 0, "gemma": 0, "kept": 2}
    assert all("forward" not in m.__dict__ for m in model.values())
    x = torch.randn(3, DIM, dtype=dtype)
    for got, want in zip(_outputs(model, x), _outputs(original, x), strict=True):
        assert torch.equal(got, want)


def test_a_norm_with_another_signature_keeps_its_forward() -> None:
    class GatedRMSNorm(LlamaRMSNorm):
        def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            return super().forward(hidden_states) * gate

    model = _norms(GatedRMSNorm, torch.float32)
    assert fuse_rms_norms(model)["kept"] == 2
