"""The transformers path's lean attention forwards (``actorllm/model/hf_attention.py``).

Every benchmark family's attention modules take the lean forward; inside a step it gives
what the module's own forward gives (hidden states and the K/V it writes), over a packed
prefill of two prompts longer than the window and a decode step after it; a forward
that does not reproduce the module's own on the probe is not used; outside a step the
module's own forward runs. And a whole slice of a base model's layers is the list itself;
dropouts return their input unless training; decoder layers skip their inert wrappers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_models_families import build_family

from actorllm.model import hf_attention
from actorllm.model.hf_attention import lean_attention
from actorllm.model.hf_backend import HFCausalLM
from actorllm.model.hf_loader import load_hf_config, load_hf_model
from actorllm.model.llama import ForwardBatch, allocate_kv_caches
from actorllm.ops import TorchBackend

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "olmo2",
            "granite", "mixtral", "qwen3_moe"]
BLOCK = 4


def _load(family: str, tmp_path: Path, tokenizer_dir: Path) -> HFCausalLM:
    model_dir = build_family(tmp_path / family, family, tokenizer_dir)
    return load_hf_model(model_dir, load_hf_config(model_dir, None), dtype=torch.float32,
                         device="cpu")


def _lean_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if getattr(m, "_actorllm_lean_attention", False)]


def _batches(vocab: int) -> list[ForwardBatch]:
    """A packed prefill of prompts of 13 and 9 tokens, then one decode token each."""
    gen = torch.Generator().manual_seed(1)
    lens = [13, 9]
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)

    def slot(seq: int, pos: int) -> int:
        return int(tables[seq, pos // BLOCK]) * BLOCK + pos % BLOCK

    prefill = ForwardBatch(
        input_ids=torch.randint(3, vocab, (sum(lens),), generator=gen),
        positions=torch.cat([torch.arange(n) for n in lens]),
        slot_mapping=torch.tensor([slot(s, p) for s, n in enumerate(lens) for p in range(n)]),
        block_tables=tables, seq_lens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 13, 22], dtype=torch.int32),
        sample_indices=torch.tensor([12, 21]), max_seqlen_q=13, max_seqlen_k=13,
        slots_valid=True)
    decode = ForwardBatch(
        input_ids=torch.randint(3, vocab, (2,), generator=gen),
        positions=torch.tensor(lens), slot_mapping=torch.tensor([slot(0, 13), slot(1, 9)]),
        block_tables=tables, seq_lens=torch.tensor([14, 10], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
        sample_indices=torch.tensor([0, 1]), max_seqlen_q=1, max_seqlen_k=14, slots_valid=True)
    return [prefill, decode]


def _run(model: HFCausalLM) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    caches = allocate_kv_caches(model.config, 8, BLOCK, torch.float32, torch.device("cpu"))
    backend = TorchBackend()
    with torch.inference_mode():
        logits = [model.compute_logits(model(b, caches, backend)[b.sample_indices])
                  for b in _batches(model.config.vocab_size)]
    return logits, [t for pair in caches for t in pair]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_takes_the_lean_forward(family: str, tmp_path: Path,
                                             tokenizer_dir: Path) -> None:
    model = _load(family, tmp_path, tokenizer_dir)
    assert len(_lean_modules(model)) == model.config.num_hidden_layers
    assert lean_attention(model.hf) == {"lean": 0, "kept": 0}  # idempotent


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite"])
def test_the_lean_forward_gives_what_the_module_gives(family: str, tmp_path: Path,
                                                      tokenizer_dir: Path) -> None:
    model = _load(family, tmp_path, tokenizer_dir)
    lean = _lean_modules(model)
    got_logits, got_caches = _run(model)
    for module in lean:  # back to the class's own forward
        del module.__dict__["forward"]
    want_logits, want_caches = _run(model)
    for got, want in zip(got_logits + got_caches, want_logits + want_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_forward_that_does_not_reproduce_is_not_used(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path,
                                                       tokenizer_dir: Path) -> None:
    model_dir = build_family(tmp_path / "llama", "llama", tokenizer_dir)
    # rotate_half's sign dropped: the probe must see it.
    monkeypatch.setattr(hf_attention, "_rotate",
                        lambda x, cos, sin: x * cos + x.roll(x.shape[-1] // 2, -1) * sin.abs())
    model = load_hf_model(model_dir, load_hf_config(model_dir, None), dtype=torch.float32,
                          device="cpu")
    assert _lean_modules(model) == []


def test_outside_a_step_the_module_runs_its_own_forward(tmp_path: Path,
                                                        tokenizer_dir: Path) -> None:
    model = _load("llama", tmp_path, tokenizer_dir)
    ids = torch.tensor([[3, 4, 5]])
    # The module's own forward reaches the paged attention function, which needs a step.
    with pytest.raises(RuntimeError, match="outside a step"), torch.inference_mode():
        model.hf(input_ids=ids)


def _tiny_llama(layers: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A seeded tiny transformers Llama, a prompt, and its logits before any change."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=50)).eval()
    ids = torch.randint(0, 50, (1, 7))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    return model, ids, want


def test_a_whole_slice_of_the_layers_is_the_list_itself() -> None:
    from actorllm.model.hf_backend import whole_layer_slices

    model, ids, want = _tiny_llama(3)
    assert whole_layer_slices(model.model)
    layers = model.model.layers
    assert layers[:3] is layers and layers[:8] is layers  # what the base model's forward takes
    assert [*layers[:2]] == [*layers][:2] and layers[1] is [*layers][1]
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, want)


def test_dropouts_return_their_input_unless_training(tmp_path: Path,
                                                     tokenizer_dir: Path) -> None:
    from actorllm.model.hf_backend import skip_eval_dropouts

    model = _load("phi3", tmp_path, tokenizer_dir)
    dropouts = [m for m in model.modules() if type(m) is torch.nn.Dropout]
    assert dropouts and all("forward" in m.__dict__ for m in dropouts)  # Phi-3's residual ones
    assert skip_eval_dropouts(model) == 0  # idempotent
    dropout = torch.nn.Dropout(0.5)
    assert skip_eval_dropouts(dropout) == 1
    x = torch.ones(1000)
    assert dropout.eval()(x) is x
    assert (dropout.train()(x) == 0).any()  # training still drops


def test_decoder_layers_run_their_own_forward_without_the_inert_wrappers() -> None:
    from actorllm.model.hf_backend import direct_layer_forwards

    model, ids, want = _tiny_llama(2)
    assert direct_layer_forwards(model) == 2
    assert direct_layer_forwards(model) == 0  # idempotent
    layer = model.model.layers[0]
    assert layer.forward.__func__.__code__.co_qualname == "LlamaDecoderLayer.forward"
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, want)
    training = type(model)(model.config).train()
    assert direct_layer_forwards(training) == 0  # checkpointing may apply: left wrapped
