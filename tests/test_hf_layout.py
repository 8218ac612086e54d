"""The transformers path's transposed weight layout (``actorllm/model/hf_layout.py``).

Re-laid weights keep their shape, identity and values, so the model gives what it gave;
only the strides change. A weight tied to the embeddings keeps its layout.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from actorllm.model.hf_layout import transpose_weights
from actorllm.model.hf_mlp import fuse_gated_mlps

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=50)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits


def _is_transposed(weight: torch.Tensor) -> bool:
    return not weight.is_contiguous() and weight.transpose(-2, -1).is_contiguous()


def test_linears_are_stored_transposed_and_give_the_same_logits() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False)).eval()
    ids = torch.randint(0, 50, (2, 7))
    want = _logits(model, ids)
    q = model.model.layers[0].self_attn.q_proj.weight
    before = q.detach().clone()
    counts = transpose_weights(model)
    # 7 linears a layer (q, k, v, o, gate, up, down) and the untied LM head.
    assert counts == {"linear": 2 * 7 + 1, "experts": 0}
    assert model.model.layers[0].self_attn.q_proj.weight is q  # the same Parameter
    assert _is_transposed(q) and torch.equal(q, before)
    assert model.model.embed_tokens.weight.is_contiguous()  # not a linear
    torch.testing.assert_close(_logits(model, ids), want, rtol=1e-5, atol=1e-5)
    assert transpose_weights(model) == {"linear": 0, "experts": 0}  # idempotent


def test_a_head_tied_to_the_embeddings_keeps_its_layout() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert transpose_weights(model)["linear"] == 2 * 7
    assert model.lm_head.weight.is_contiguous()


def test_fused_mlps_built_after_see_the_new_layout() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    ids = torch.randint(0, 50, (1, 9))
    want = _logits(model, ids)
    transpose_weights(model)
    assert fuse_gated_mlps(model)["fused"] == 2
    torch.testing.assert_close(_logits(model, ids), want, rtol=1e-5, atol=1e-5)


def test_fused_experts_are_stored_transposed_and_give_the_same_logits() -> None:
    torch.manual_seed(0)
    config = MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    model = MixtralForCausalLM(config).eval()
    ids = torch.randint(0, 50, (2, 11))
    want = _logits(model, ids)
    counts = transpose_weights(model)
    assert counts["experts"] == 2 * 2  # gate_up_proj and down_proj a layer
    experts = model.model.layers[1].mlp.experts
    assert _is_transposed(experts.gate_up_proj) and _is_transposed(experts.down_proj)
    torch.testing.assert_close(_logits(model, ids), want, rtol=1e-5, atol=1e-5)


def test_other_dtypes_keep_their_layout() -> None:
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).to(torch.bfloat16)
    assert transpose_weights(model) == {"linear": 0, "experts": 0}
