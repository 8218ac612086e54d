"""Bring your own model: each family, built tiny with random weights, against transformers.

The oracle is transformers' own greedy ``generate`` in float32 with eager attention (the
one implementation that applies every feature: soft-caps, sliding windows, per-layer
attention types). Each family runs through ``LLM.generate`` under forced preemption (a
KV cache too small for every sequence at once), chunked prefill (a small token budget)
and prefix caching (the prompts share a prefix), and must give the same tokens, with
logprobs within 1e-4. Windowed families get prompts longer than their window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import BOS_ID, EOS_ID, hf_greedy

from actorllm.llm import LLM
from actorllm.wire.messages import SamplingParams

WINDOW = 8  # shorter than every prompt below
MAX_NEW = 10
MAX_MODEL_LEN = 64

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=BOS_ID,
    eos_token_id=EOS_ID, pad_token_id=EOS_ID, initializer_range=0.2, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def _family(name: str) -> tuple[Any, Any, dict[str, Any]]:
    """(config class, model class, config overrides) of a family."""
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {}),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(
            query_pre_attn_scalar=16, sliding_window=WINDOW, attn_logit_softcapping=4.0,
            final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh")),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(
            query_pre_attn_scalar=16, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"])),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(sliding_window=None)),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, {}),
        # Every multiplier away from 1, logits_scaling included (HFCausalLM applies it).
        "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, dict(
            embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
            logits_scaling=4.0)),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(
            num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=WINDOW)),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[])),
    }[name]


def build_family(save_dir: Path, name: str, tokenizer_dir: Path, seed: int = 0,
                 **shape: Any) -> Path:
    """A random-weight checkpoint of family ``name`` with the shared tiny tokenizer;
    ``shape`` overrides the config (sizes, for benchmarks/models.py)."""
    from transformers import AutoTokenizer, GenerationConfig

    config_cls, model_cls, overrides = _family(name)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    save_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(save_dir))
    kwargs = {**_COMMON, "vocab_size": len(tokenizer), **overrides, **shape}
    if "layer_types" in kwargs:  # the pattern repeats over however many layers there are
        pattern = kwargs["layer_types"]
        kwargs["layer_types"] = [pattern[i % len(pattern)]
                                 for i in range(kwargs["num_hidden_layers"])]
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # random biases and norm weights, so that every path matters
        for pname, p in model.named_parameters():
            if pname.endswith(".bias") or "norm" in pname:
                p.normal_(0.0 if pname.endswith(".bias") else 1.0, 0.2)
    model.save_pretrained(str(save_dir), safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                     pad_token_id=EOS_ID).save_pretrained(str(save_dir))
    return save_dir


def prompts(tokenizer_dir: Path) -> list[list[int]]:
    """Prompts of 12 to 30 tokens sharing a prefix (prefix caching), all past WINDOW."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    head = "the farmer walks to the market in the morning"
    tails = ["", " and buys bread", " with his dog and a basket of apples for the children",
             " where people read newspapers"]
    out = [tok(head + t).input_ids for t in tails]
    assert all(len(p) > WINDOW for p in out)
    return out


def oracle(model_dir: Path, prompt_ids: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy continuation and logprobs, eager attention, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    return [hf_greedy(model, p, MAX_NEW) for p in prompt_ids]


def check_generate(model_dir: Path, prompt_ids: list[list[int]], model_impl: str,
                   **engine: Any) -> None:
    """LLM.generate equals the oracle token for token, logprobs within 1e-4."""
    want = oracle(model_dir, prompt_ids)
    args = dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=8,
                enable_prefix_caching=True, max_model_len=MAX_MODEL_LEN)
    llm = LLM(str(model_dir), model_impl=model_impl, **{**args, **engine})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    results = llm.generate(prompt_ids, params)
    for result, (ids, lps) in zip(results, want, strict=True):
        assert result.error is None, result.error
        out = result.outputs[0]
        assert list(out.token_ids) == ids, (result.rid, list(out.token_ids), ids)
        got = [lp.logprob for lp in out.logprobs]
        assert max(abs(a - b) for a, b in zip(got, lps, strict=True)) < 1e-4


TRANSFORMERS_ONLY = ["gemma2", "gemma3", "phi3", "olmo2", "granite", "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("family", TRANSFORMERS_ONLY)
def test_transformers_path_matches_generate(family: str, tmp_path: Path,
                                            tokenizer_dir: Path) -> None:
    model_dir = build_family(tmp_path / family, family, tokenizer_dir)
    check_generate(model_dir, prompts(tokenizer_dir), "auto")  # auto: transformers here


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_both_paths_match_generate(family: str, impl: str, tmp_path: Path,
                                   tokenizer_dir: Path) -> None:
    """Llama, Qwen2 (qkv biases), Qwen3 and windowed Mistral (prompts past the window) on
    either path."""
    model_dir = build_family(tmp_path / family, family, tokenizer_dir, seed=3)
    check_generate(model_dir, prompts(tokenizer_dir), impl)


def test_the_two_paths_agree(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Native against transformers-backed directly, on a larger cache (no preemption)."""
    model_dir = build_family(tmp_path / "llama", "llama", tokenizer_dir, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outs = {}
    for impl in ("native", "transformers"):
        llm = LLM(str(model_dir), model_impl=impl, num_kv_blocks=64)
        outs[impl] = llm.generate(prompts(tokenizer_dir), params)
    for a, b in zip(outs["native"], outs["transformers"], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert abs(x.logprob - y.logprob) < 1e-4


@pytest.mark.parametrize(("family", "impl", "chosen"), [
    ("llama", "auto", "native"), ("qwen3", "auto", "native"), ("olmo2", "auto", "transformers"),
    ("llama", "transformers", "transformers"), ("qwen2", "native", "native")])
def test_model_impl_chooses(family: str, impl: str, chosen: str, tmp_path: Path,
                            tokenizer_dir: Path) -> None:
    """auto is the native model where it has the architecture, else transformers'."""
    from actorllm.model.hf_backend import HFCausalLM
    from actorllm.model.llama import LlamaForCausalLM

    model_dir = build_family(tmp_path / family, family, tokenizer_dir)
    llm = LLM(str(model_dir), model_impl=impl, num_kv_blocks=16)
    want = LlamaForCausalLM if chosen == "native" else HFCausalLM
    assert isinstance(llm.resources.runner.model, want)


def test_native_refuses_what_it_lacks(tmp_path: Path, tokenizer_dir: Path) -> None:
    model_dir = build_family(tmp_path / "olmo2", "olmo2", tokenizer_dir)
    with pytest.raises(ValueError, match="architecture 'Olmo2ForCausalLM' for the native"):
        LLM(str(model_dir), model_impl="native", num_kv_blocks=64)


def _edit_config(model_dir: Path, **changes: Any) -> None:
    import json

    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_auto_falls_back_to_transformers_where_native_lacks_a_feature(
        tmp_path: Path, tokenizer_dir: Path) -> None:
    """A Llama with an activation the native model lacks: native refuses, auto runs
    transformers' own code (and it still matches transformers' generate)."""
    from actorllm.model.hf_backend import HFCausalLM

    model_dir = build_family(tmp_path / "llama", "llama", tokenizer_dir)
    _edit_config(model_dir, hidden_act="gelu")
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        LLM(str(model_dir), model_impl="native", num_kv_blocks=16)
    llm = LLM(str(model_dir), model_impl="auto", num_kv_blocks=16)
    assert isinstance(llm.resources.runner.model, HFCausalLM)
    check_generate(model_dir, prompts(tokenizer_dir)[:2], "auto")


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_is_refused_on_every_path(
        rope_type: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    """transformers recomputes these frequencies from the batch's longest position, which
    in a packed batch is another sequence's: refused with one line, never served wrong."""
    model_dir = build_family(tmp_path / "llama", "llama", tokenizer_dir)
    extra: dict[str, Any] = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    if rope_type == "longrope":
        half = _COMMON["head_dim"] // 2
        extra = {"rope_type": "longrope", "short_factor": [1.0] * half,
                 "long_factor": [2.0] * half, "rope_theta": 10000.0,
                 "original_max_position_embeddings": 64}
    _edit_config(model_dir, rope_parameters=extra)
    for impl in ("auto", "transformers"):
        with pytest.raises(ValueError, match=f"rope type '{rope_type}'"):
            LLM(str(model_dir), model_impl=impl, num_kv_blocks=16)
