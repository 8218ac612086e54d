"""The transformers path's lean fused-experts forward (``actorllm/model/hf_experts.py``).

It must give what transformers' own ``grouped_mm`` experts forward gives on the same
weights (bit for bit with two experts a token, on one intra-op thread as every test
starts: on two the logits differ by float rounding, ~4e-8), and leave alone what it
cannot reproduce.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from actorllm.model.hf_experts import lean_experts
from actorllm.model.hf_layout import transpose_weights
from actorllm.model.hf_mlp import fuse_expert_gates

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=50)


def _mixtral(top_k: int) -> MixtralForCausalLM:
    config = MixtralConfig(**SMALL, intermediate_size=48, num_local_experts=6,
                           num_experts_per_tok=top_k, experts_implementation="grouped_mm")
    return MixtralForCausalLM(config).eval()


def _qwen3_moe() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(**SMALL, intermediate_size=48, moe_intermediate_size=24,
                            num_experts=8, num_experts_per_tok=4, head_dim=8,
                            experts_implementation="grouped_mm")
    return Qwen3MoeForCausalLM(config).eval()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("prepare", ["none", "load"])  # load: as hf_loader prepares a model
def test_two_experts_a_token_give_the_same_logits_bit_for_bit(prepare: str) -> None:
    torch.manual_seed(0)
    model = _mixtral(top_k=2)
    if prepare == "load":
        transpose_weights(model)
        fuse_expert_gates(model)
    original = copy.deepcopy(model)
    ids = torch.randint(0, 50, (2, 13))
    assert lean_experts(model) == 2
    assert all("forward" in layer.mlp.experts.__dict__ for layer in model.model.layers)
    assert torch.equal(_logits(model, ids), _logits(original, ids))
    assert lean_experts(model) == 0  # idempotent


def test_more_experts_a_token_match_to_rounding() -> None:
    torch.manual_seed(1)
    model = _qwen3_moe()
    original = copy.deepcopy(model)
    ids = torch.randint(0, 50, (1, 17))
    assert lean_experts(model) == 2
    torch.testing.assert_close(_logits(model, ids), _logits(original, ids),
                               rtol=1e-5, atol=1e-5)


def test_other_experts_implementations_are_left_alone() -> None:
    torch.manual_seed(0)
    model = _mixtral(top_k=2)
    model.config._experts_implementation = "eager"
    assert lean_experts(model) == 0


def test_a_forward_that_does_not_reproduce_is_not_used(monkeypatch) -> None:
    import actorllm.model.hf_experts as hf_experts

    def wrong(mm):
        def experts(self, hidden, top_k_index, top_k_weights):
            return torch.zeros_like(hidden)
        return experts

    monkeypatch.setattr(hf_experts, "_forward", wrong)
    assert hf_experts.lean_experts(_mixtral(top_k=2)) == 0


def test_experts_off_the_cpu_are_left_alone() -> None:
    model = _mixtral(top_k=2).to("meta")
    assert lean_experts(model) == 0
