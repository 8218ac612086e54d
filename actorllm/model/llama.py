"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

The model sees only a :class:`ForwardBatch` (packed tokens of many sequences) and the
per-layer cache tensors; it writes each new token's K/V through the attention backend
and attends over the paged cache with the backend's one op (DESIGN.md section 5). It
owns no cache and no sequence state. q/k/v and gate/up are fused into single matmuls;
the loader (:mod:`actorllm.model.loader`) fills the fused weights from HF checkpoints.
Qwen3 adds an RMSNorm over each head of q and k before RoPE (``qk_norm``); Mistral and
windowed Qwen layers attend over a sliding window, which the attention op applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from actorllm.model.parallel import TensorParallel
from actorllm.ops import AttentionBackend

KVCache = tuple[Tensor, Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]


@dataclass
class ForwardBatch:
    """One step's packed input: every scheduled sequence's new tokens, back to back.

    ``slot_mapping[i]`` is where token ``i``'s K/V goes (``block * block_size + offset``);
    ``sample_indices`` are the rows (last token of each sampled sequence) whose logits
    are wanted. ``max_seqlen_q``/``max_seqlen_k`` are host ints so the backend needs no
    device sync to find them.
    """

    input_ids: Tensor  # int64 [T]
    positions: Tensor  # int64 [T]
    slot_mapping: Tensor  # int64 [T]
    block_tables: Tensor  # int32 [S, max_blocks]
    seq_lens: Tensor  # int32 [S]
    cu_seqlens_q: Tensor  # int32 [S + 1]
    sample_indices: Tensor  # int64 [num_sampled]
    max_seqlen_q: int
    max_seqlen_k: int
    slots_valid: bool = False  # no slot is -1: the attention backend need not look


def layer_window(config: PretrainedConfig, layer: int) -> int | None:
    """Layer ``layer``'s sliding window as transformers applies it, or None (full attention).

    Mistral windows every layer with ``sliding_window``; Qwen2/Qwen3 only the layers
    ``layer_types`` names ``sliding_attention`` (their configs clear the window when
    ``use_sliding_window`` is off).
    """
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_types[layer] != "sliding_attention":
        return None
    return int(window)


def head_dim_of(config: PretrainedConfig) -> int:
    """``head_dim`` from the config when present, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, like transformers."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype is torch.float32:
            # One op instead of eight, bit-equal to the path below in fp32 (checked in
            # tests/test_model.py); every op a step saves is one less GIL round trip.
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary positions from ``inv_freq`` (computed by the loader via HF)."""

    def __init__(self, inv_freq: Tensor, attention_scaling: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``cos`` and signed ``sin`` ``[T, 1, D]`` for :func:`_apply_rope`.

        The first half of ``sin`` is negated so that the rotation needs no negation per
        layer; it broadcasts over heads as returned.
        """
        # Computed per step from positions rather than cached per position: it is tiny next
        # to the matmuls and avoids a [max_position_embeddings, D] table for 128k contexts.
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        return (torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :],
                torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :])


def _apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate ``x`` [T, heads, D] by the half-split (GPT-NeoX / HF Llama) convention.

    HF's ``x * cos + cat(-x2, x1) * sin`` with the sign moved into ``signed_sin``: a roll
    by half the head makes ``cat(x2, x1)``, and ``x2 * -sin == -x2 * sin`` exactly, so the
    result is bit-equal in four ops instead of seven.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    """Fused-qkv GQA attention that writes K/V to the paged cache and reads it back."""

    def __init__(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool,
                 tp: TensorParallel, *, qk_norm: bool = False,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        # This rank's heads: all of them on one rank (model/parallel.py).
        self.num_heads = config.num_attention_heads // tp.world
        self.num_kv_heads = tp.kv_heads(config.num_key_value_heads)
        self.tp = tp
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.qkv_proj.shards = (self.q_size, self.kv_size, self.kv_size)  # for the loader
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)  # row-parallel
        self.sliding_window = sliding_window
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch,
                kv_cache: KVCache, backend: AttentionBackend) -> Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = qkv[:, : self.num_heads + self.num_kv_heads]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]),
                            self.k_norm(qk[:, self.num_heads :])), dim=1)
        # q and k heads side by side take one rotation (half the small ops of two).
        qk = _apply_rope(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        k_cache, v_cache = kv_cache
        backend.write_kv(k, v, k_cache, v_cache, batch.slot_mapping, slots_valid=batch.slots_valid)
        out = backend.paged_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.cu_seqlens_q,
            self.scale,
            max_seqlen_q=batch.max_seqlen_q,
            max_seqlen_k=batch.max_seqlen_k,
            sliding_window=self.sliding_window,
        )
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one matmul."""

    def __init__(self, config: PretrainedConfig, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        inter = config.intermediate_size // tp.world
        self.tp = tp
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=bias)
        self.gate_up_proj.shards = (inter, inter)  # for the loader
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block with residuals."""

    def __init__(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 tp: TensorParallel, *, qk_norm: bool = False, sliding_window: int | None = None):
        super().__init__()
        self.self_attn = Attention(config, qkv_bias, o_bias, tp, qk_norm=qk_norm,
                                   sliding_window=sliding_window)
        self.mlp = MLP(config, mlp_bias, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch,
                kv_cache: KVCache, backend: AttentionBackend) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, kv_cache, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (HF's ``model.*`` submodule)."""

    def __init__(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 tp: TensorParallel, qk_norm: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)  # replicated
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, o_bias, mlp_bias, tp, qk_norm=qk_norm,
                         sliding_window=layer_window(config, i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose attention goes through a paged-KV backend.

    Parameter names mirror transformers' except the fused ``qkv_proj`` and
    ``gate_up_proj``. ``qkv_bias`` is True for Qwen2; ``o_bias``/``mlp_bias`` follow
    Llama's ``attention_bias``/``mlp_bias``; ``qk_norm`` is True for Qwen3. ``tp`` makes it
    one rank's shard of a tensor-parallel model (:mod:`actorllm.model.parallel`); the LM
    head is replicated.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        rotary: RotaryEmbedding,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        mlp_bias: bool = False,
        qk_norm: bool = False,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        self.model = DecoderModel(config, qkv_bias, o_bias, mlp_bias, self.tp, qk_norm)
        self.rotary = rotary
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, batch: ForwardBatch, kv_caches: list[KVCache], backend: AttentionBackend
    ) -> Tensor:
        """Hidden states ``[T, hidden]`` of every packed token (before the final norm)."""
        h = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rotary(batch.positions, h.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, batch, kv_cache, backend)
        return h

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits ``[N, vocab]`` for the given rows of ``forward``'s output."""
        return self.lm_head(self.model.norm(hidden)).float()


def allocate_kv_caches(config: PretrainedConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device,
                       tp: TensorParallel | None = None) -> list[KVCache]:
    """Zeroed K and V caches of every layer for this rank's KV heads.

    Zeros, not empty: padded attention reads multiply masked slots by 0, and NaN * 0
    garbage in never-written slots would poison the output.
    """
    heads = (tp or TensorParallel()).kv_heads(config.num_key_value_heads)
    shape = (num_blocks, block_size, heads, head_dim_of(config))
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_hidden_layers)]
