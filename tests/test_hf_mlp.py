"""The transformers path's one-forward gated MLPs (``actorllm/model/hf_mlp.py``).

Each swapped MLP must give what the module's own forward gives, on its own weights
(none copied); a module the swapped forward does not reproduce keeps its own.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import Gemma2Config, LlamaConfig, MixtralConfig, Phi3Config
from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.phi3.modeling_phi3 import Phi3MLP

from actorllm.model.hf_mlp import fuse_expert_gates, fuse_gated_mlps

HIDDEN, INTER = 32, 48


def _mlps(make: type[nn.Module], config: object, dtype: torch.dtype) -> nn.ModuleDict:
    """Two MLPs with random weights (and biases where the config has them)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": make(config), "b": make(config)})
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.to(dtype)


def _out(model: nn.ModuleDict, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model["a"](x), model["b"](x)]


CASES = {
    "llama": (LlamaMLP, LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER)),
    "llama_bias": (LlamaMLP, LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER,
                                         mlp_bias=True)),
    "gemma2_gelu": (Gemma2MLP, Gemma2Config(hidden_size=HIDDEN, intermediate_size=INTER)),
    "phi3_gate_up": (Phi3MLP, Phi3Config(hidden_size=HIDDEN, intermediate_size=INTER)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_mlps_give_what_the_module_gives(case: str, dtype: torch.dtype) -> None:
    make, config = CASES[case]
    model = _mlps(make, config, dtype)
    original = copy.deepcopy(model)
    assert fuse_gated_mlps(model) == {"fused": 2, "kept": 0}
    assert all("forward" in m.__dict__ for m in model.values())  # swapped per instance
    x = torch.randn(3, 5, HIDDEN, dtype=dtype) * 2
    for got, want in zip(_out(model, x), _out(original, x), strict=True):
        assert got.dtype == want.dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    # The module's own parameters are unchanged in value (the state dict still loads).
    for name, tensor in original.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_no_weight_is_copied() -> None:
    make, config = CASES["phi3_gate_up"]
    model = _mlps(make, config, torch.float32)
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    fuse_gated_mlps(model)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == before


def test_fusing_twice_changes_nothing() -> None:
    make, config = CASES["llama"]
    model = _mlps(make, config, torch.float32)
    fuse_gated_mlps(model)
    forwards = [m.__dict__["forward"] for m in model.values()]
    assert fuse_gated_mlps(model) == {"fused": 0, "kept": 0}
    assert [m.__dict__["forward"] for m in model.values()] == forwards


class UpGatedMLP(LlamaMLP):
    """Llama's attributes, another formula: the activation on ``up``, not ``gate``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))


class ScaledMLP(LlamaMLP):
    """Llama's formula plus a child of its own (a norm the fused forward would skip)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))


@pytest.mark.parametrize("make", [UpGatedMLP, ScaledMLP])
def test_an_mlp_the_fused_forward_does_not_reproduce_keeps_its_own(make: type) -> None:
    model = _mlps(make, CASES["llama"][1], torch.float32)
    original = copy.deepcopy(model)
    assert fuse_gated_mlps(model) == {"fused": 0, "kept": 2}
    assert not any("forward" in m.__dict__ for m in model.values())
    x = torch.randn(2, HIDDEN)
    for got, want in zip(_out(model, x), _out(original, x), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_gates_give_what_the_default_gate_gives(dtype: torch.dtype) -> None:
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=4)
    config._experts_implementation = "grouped_mm"  # as from_pretrained sets it here
    torch.manual_seed(0)
    experts = MixtralExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.3)
    experts = experts.to(dtype)
    original = copy.deepcopy(experts)
    assert fuse_expert_gates(experts) == 1
    assert "_apply_gate" in experts.__dict__ and fuse_expert_gates(experts) == 0
    x = torch.randn(7, HIDDEN, dtype=dtype)
    index = torch.randint(0, 4, (7, 2))
    weights = torch.rand(7, 2, dtype=dtype)
    with torch.inference_mode():
        assert torch.equal(experts(x, index, weights), original(x, index, weights))


@pytest.mark.parametrize(("family", "mlps", "gates", "experts"), [
    ("phi3", 2, 0, 0), ("olmo2", 2, 0, 0), ("gemma2", 2, 0, 0), ("mixtral", 0, 2, 2),
])
def test_the_loader_swaps_every_mlp_and_expert_gate(family: str, mlps: int, gates: int,
                                                    experts: int, tmp_path: Path,
                                                    tokenizer_dir: Path) -> None:
    from test_models_families import build_family

    from actorllm.model.hf_loader import load_hf_config, load_hf_model

    model_dir = build_family(tmp_path / family, family, tokenizer_dir)
    config = load_hf_config(model_dir, None)
    model = load_hf_model(model_dir, config, dtype=torch.float32, device="cpu")
    assert config.num_hidden_layers == 2
    swapped = [m for m in model.modules() if "forward" in m.__dict__
               and hasattr(m, "down_proj")]
    lean = [m for m in swapped if getattr(m, "_actorllm_lean_experts", False)]
    assert len(swapped) - len(lean) == mlps
    assert len(lean) == experts  # model/hf_experts.py's forward
    assert sum("_apply_gate" in m.__dict__ for m in model.modules()) == gates
