"""The paged-cache model against transformers' logits, and the loader's error messages.

Each case runs a token sequence through our model in pieces (one prefill chunk, or
several, then single-token decode steps) with the KV cache spread over a scrambled
block table, and compares the logits of every position with one full-sequence
transformers forward in fp32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_model, hf_model
from safetensors.torch import load_file, save_file

from actorllm.model import (
    ForwardBatch,
    LlamaForCausalLM,
    load_config,
    load_model,
)
from actorllm.model.llama import RMSNorm, RotaryEmbedding, _apply_rope, head_dim_of
from actorllm.ops import select_backend

BLOCK_SIZE = 4
NUM_BLOCKS = 32
BACKEND = select_backend("torch")


def make_caches(model: LlamaForCausalLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    c = model.config
    shape = (NUM_BLOCKS, BLOCK_SIZE, c.num_key_value_heads, head_dim_of(c))
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_hidden_layers)]


def make_batch(pieces: list[tuple[list[int], int, list[int]]]) -> ForwardBatch:
    """A batch from ``(token_ids, start_pos, block_table)`` per sequence; samples every row."""
    ids, pos, slots, lens, cu = [], [], [], [], [0]
    for tokens, start, table in pieces:
        for i, tok in enumerate(tokens):
            p = start + i
            ids.append(tok)
            pos.append(p)
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        lens.append(start + len(tokens))
        cu.append(cu[-1] + len(tokens))
    width = max(len(t) for _, _, t in pieces)
    tables = [t + [0] * (width - len(t)) for _, _, t in pieces]
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        sample_indices=torch.arange(len(ids)),
        max_seqlen_q=max(len(t) for t, _, _ in pieces),
        max_seqlen_k=max(lens),
    )


def run_pieces(model: LlamaForCausalLM, tokens: list[int], cuts: list[int]) -> torch.Tensor:
    """Logits of every position of ``tokens``, run as chunks ending at ``cuts``."""
    table = [int(b) for b in torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3))]
    caches = make_caches(model)
    out, start = [], 0
    with torch.inference_mode():
        for end in [*cuts, len(tokens)]:
            batch = make_batch([(tokens[start:end], start, table)])
            out.append(model.compute_logits(model(batch, caches, BACKEND)))
            start = end
    return torch.cat(out)


def hf_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([tokens])).logits[0].float()


TOKENS = [0, *range(7, 7 + 45)]  # 46 tokens: 12 blocks of 4, the last one partly filled
SCHEDULES = {
    "one-prefill": [],
    "prefill-then-decode": [38, 39, 40, 41, 42, 43, 44, 45],
    "chunked": [5, 13, 30, 31, 32],
}


@pytest.fixture(scope="module", params=["linear", "llama3"])
def rope_scaled_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama with scaled rope (the test sequence runs past the original length)."""
    rope = {"rope_type": request.param, "factor": 4.0, "rope_theta": 10000.0}
    if request.param == "llama3":
        rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
        rope["original_max_position_embeddings"] = 16
    path = tmp_path_factory.mktemp(f"rope-{request.param}")
    return build_tiny_model(path, "llama", seed=2, rope_parameters=rope)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("which", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_logits_match_transformers(which: str, schedule: str, request: pytest.FixtureRequest):
    assert_matches_transformers(request.getfixturevalue(which), SCHEDULES[schedule])


@pytest.mark.parametrize("schedule", ["one-prefill", "chunked"])
def test_rope_scaled_logits_match_transformers(rope_scaled_dir: Path, schedule: str):
    model = load_model(rope_scaled_dir)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    assert not torch.allclose(model.rotary.inv_freq, plain)  # the scaling is really in play
    assert_matches_transformers(rope_scaled_dir, SCHEDULES[schedule])


def test_mistral_logits_match_transformers(tmp_path: Path, tokenizer_dir: Path):
    model_dir = build_tiny_model(tmp_path, "mistral", tokenizer_dir=tokenizer_dir, seed=4)
    assert load_config(model_dir).sliding_window == 4096  # longer than max_model_len: moot
    assert_matches_transformers(model_dir, SCHEDULES["chunked"])


def assert_matches_transformers(model_dir: Path, cuts: list[int]) -> None:
    model = load_model(model_dir)
    ours = run_pieces(model, TOKENS, cuts)
    ref = hf_logits(model_dir, TOKENS)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_mixed_batch_matches_transformers(tiny_qwen2_dir: Path):
    """Two sequences in one forward: one decoding after a cached prefix, one prefilling."""
    model = load_model(tiny_qwen2_dir)
    a, b = TOKENS[:21], [0, 99, 98, 97, 96, 95, 94]
    table_a, table_b = [9, 2, 17, 5, 30, 11], [4, 22]
    caches = make_caches(model)
    with torch.inference_mode():
        model(make_batch([(a[:20], 0, table_a)]), caches, BACKEND)
        both = make_batch([(a[20:], 20, table_a), (b, 0, table_b)])
        logits = model.compute_logits(model(both, caches, BACKEND))
    torch.testing.assert_close(logits[0], hf_logits(tiny_qwen2_dir, a)[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1:], hf_logits(tiny_qwen2_dir, b), atol=1e-4, rtol=0)


def test_tied_and_fused_weights(tiny_llama_dir: Path, tiny_qwen2_dir: Path):
    qwen = load_model(tiny_qwen2_dir)
    assert qwen.lm_head.weight.data_ptr() == qwen.model.embed_tokens.weight.data_ptr()
    assert qwen.model.layers[0].self_attn.qkv_proj.bias is not None
    llama = load_model(tiny_llama_dir)
    assert llama.lm_head.weight.data_ptr() != llama.model.embed_tokens.weight.data_ptr()
    assert llama.model.layers[0].self_attn.qkv_proj.bias is None


def test_sharded_checkpoint(tmp_path: Path, tiny_llama_dir: Path):
    hf = hf_model(tiny_llama_dir)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = run_pieces(load_model(tmp_path), TOKENS[:10], [])
    torch.testing.assert_close(ours, hf_logits(tiny_llama_dir, TOKENS[:10]), atol=1e-4, rtol=0)


def test_bf16_load_runs(tiny_llama_dir: Path):
    model = load_model(tiny_llama_dir, dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert model.rotary.inv_freq.dtype == torch.float32
    c = model.config
    shape = (NUM_BLOCKS, BLOCK_SIZE, c.num_key_value_heads, head_dim_of(c))
    zeros = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2 * c.num_hidden_layers)]
    caches = list(zip(zeros[::2], zeros[1::2], strict=True))
    with torch.inference_mode():
        logits = model.compute_logits(
            model(make_batch([(TOKENS[:9], 0, [1, 2, 3])]), caches, BACKEND)
        )
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize("rows", [1, 7, 64, 2048])
@pytest.mark.parametrize("dim", [256, 4096])
def test_fp32_rms_norm_is_bit_equal_to_transformers(rows: int, dim: int):
    """The fp32 fast path (one ``torch.rms_norm``) against transformers' own module."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(rows + dim)
    ours, theirs = RMSNorm(dim, 1e-5), LlamaRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(dim))
        theirs.weight.copy_(ours.weight)
    for scale in (1e-3, 1.0, 50.0):
        x = torch.randn(rows, dim) * scale
        with torch.inference_mode():
            assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_bit_equal_to_transformers(dtype: torch.dtype):
    """The rolled rotation with a signed sin against transformers' ``rotate_half`` form."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    head_dim, tokens = 64, 37
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    positions = torch.randint(0, 4000, (tokens,))
    cos, signed_sin = RotaryEmbedding(inv_freq, 1.0)(positions, dtype)
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    hf_cos, hf_sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q = torch.randn(tokens, 8, head_dim).to(dtype)
    k = torch.randn(tokens, 2, head_dim).to(dtype)
    # transformers works on [batch, heads, tokens, dim] with cos/sin [batch, tokens, dim].
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          hf_cos[None], hf_sin[None])
    assert torch.equal(_apply_rope(q, cos, signed_sin), want_q[0].transpose(0, 1))
    assert torch.equal(_apply_rope(k, cos, signed_sin), want_k[0].transpose(0, 1))


# ----------------------------------------------------------------------------- loader errors


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def one_line_error(model_dir: Path) -> str:
    with pytest.raises(ValueError) as info:
        load_model(model_dir)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_error_missing_dir(tmp_path: Path):
    assert "does not exist" in one_line_error(tmp_path / "nope")


def test_error_no_config(tmp_path: Path):
    assert "no config.json" in one_line_error(tmp_path)


def test_error_bad_json(tmp_path: Path):
    (tmp_path / "config.json").write_text("{not json")
    assert "not valid JSON" in one_line_error(tmp_path)


def test_error_unsupported_architecture(tmp_path: Path, tiny_llama_dir: Path):
    path = copy_dir(tiny_llama_dir, tmp_path / "m")
    edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    message = one_line_error(path)
    assert "unsupported architecture 'GPT2LMHeadModel'" in message
    assert "LlamaForCausalLM" in message


def test_error_unsupported_rope(tmp_path: Path, tiny_llama_dir: Path):
    path = copy_dir(tiny_llama_dir, tmp_path / "m")
    edit_config(path, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    assert "unsupported rope type 'dynamic'" in one_line_error(path)


def test_error_no_weights(tmp_path: Path, tiny_llama_dir: Path):
    path = copy_dir(tiny_llama_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    assert "no *.safetensors weights" in one_line_error(path)


def test_error_missing_tensor(tmp_path: Path, tiny_llama_dir: Path):
    path = copy_dir(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    message = one_line_error(path)
    assert "missing tensor 'model.layers.1.self_attn.k_proj.weight'" in message


def test_error_wrong_shape(tmp_path: Path, tiny_llama_dir: Path):
    path = copy_dir(tiny_llama_dir, tmp_path / "m")
    edit_config(path, intermediate_size=96)
    assert "has shape" in one_line_error(path)


def test_fixture_directories_tokenize_alike(
    tokenizer_dir: Path, tiny_llama_dir: Path, tiny_qwen2_dir: Path
):
    """transformers picks Qwen2Tokenizer for a Qwen2 directory: it must agree with the rest."""
    from transformers import AutoTokenizer

    toks = [
        AutoTokenizer.from_pretrained(d) for d in (tokenizer_dir, tiny_llama_dir, tiny_qwen2_dir)
    ]
    text = "numbers 1 2 3 10 12, café!\n<|user|>hi<|end|>"
    ids = toks[0](text).input_ids
    assert ids[0] == 0 and 2 in ids and 5 in ids
    for tok in toks:
        assert tok(text).input_ids == ids
        assert len(tok) == 400 and tok.eos_token_id == 1 and tok.bos_token_id == 0
        assert tok.decode(ids, skip_special_tokens=True) == "numbers 1 2 3 10 12, café!\nhi"
