"""A decode step of the whole model as one torch op on the CPU (``kernels/cpu_decode_step.cpp``).

Every torch op called from Python releases the GIL for its work and takes it back after.
A decode step of the embedded model is about 150 of them, and where the forward shares
its process with a busy event loop (the ``single`` topology) each retake waits for the
loop's next release: a 64-sequence step measured ~10 ms alone and ~24 ms beside the loop
at saturation. :class:`DecodeStep` runs the same ops from C++, called once through
``torch.ops``, whose binding releases the GIL for the whole call.

It covers what most steps of a busy server are: one new token for every sequence, fp32,
one rank, every linear a :class:`~actorllm.ops.cpu_linear.PackedLinear` and the C
decode kernel for attention (:mod:`actorllm.ops.cpu_backend`), each layer with its own
sliding window (Mistral windows every layer, Qwen2's ``layer_types`` some) and Qwen3's
per-head q and k norms. Prefill and mixed steps take it too, every token a row with its
sequence's block table and ``seq_len = position + 1`` (worker/packing.py
``every_token_a_row``): the op writes a layer's K/V for every token before any row
attends, so each row sees what the causal mask lets it see. The Python model in
:mod:`actorllm.model.llama` stays the reference and runs every other step (other dtypes,
tensor parallelism); tests compare the two (``tests/test_cpu_step.py``).

The op is compiled on first use with the machine's C++ compiler (``$CXX``, else
``c++``/``g++``) against the installed torch's headers (8 s here, once: it is cached
with the C kernel; :mod:`actorllm.ops.op_library`). Without a compiler or the headers,
:func:`load_decode_step` logs why and returns None, and the Worker keeps the Python
forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from actorllm.model.llama import (
    DecoderLayer,
    ForwardBatch,
    KVCache,
    LlamaForCausalLM,
    RotaryEmbedding,
)
from actorllm.ops.cpu_backend import CpuBackend, CpuKernelError
from actorllm.ops.cpu_linear import PackedLinear
from actorllm.ops.op_library import load_op_library

log = logging.getLogger(__name__)

# The decode kernel's limits (cpu_paged_decode.c): beyond them it refuses the shape.
_MAX_GROUP, _MAX_HEAD_DIM = 16, 256

def why_not(model: torch.nn.Module, backend: object) -> str | None:
    """Why :class:`DecodeStep` cannot run this model with this backend, or None when it can."""
    if type(model) is not LlamaForCausalLM:
        return f"the model is a {type(model).__name__}"
    if model.tp.enabled:
        return "the model is tensor-parallel"
    dtype = model.model.embed_tokens.weight.dtype
    if dtype != torch.float32:
        return f"the dtype is {dtype}, not float32"
    if not isinstance(backend, CpuBackend):
        return f"the attention backend is {getattr(backend, 'name', backend)!r}, not 'cpu'"
    if type(model.rotary) is not RotaryEmbedding:
        return "the rotary embedding is not the default one"
    layer = model.model.layers[0]
    attn = layer.self_attn
    eps = layer.input_layernorm.eps
    norms = [n for layer in model.model.layers
             for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
    if any(n is not None and n.eps != eps for n in norms) \
            or 0 < sum(n is None for n in norms) < len(norms):
        return "the q/k norms are not on every layer at the other norms' eps"
    if attn.head_dim > _MAX_HEAD_DIM or attn.num_heads // attn.num_kv_heads > _MAX_GROUP:
        return "the decode kernel does not take this head shape"
    for layer in model.model.layers:
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                   layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if not all(isinstance(m, PackedLinear) for m in linears):
            return "the linears are not PackedLinear"
    return None


class DecodeStep:
    """``model.forward`` for batches of one token a row, as one op call (a prefill chunk
    is given a row per token, see the module's docstring).

    Holds references to the model's weights (it copies nothing); build it after
    :func:`~actorllm.ops.cpu_linear.pack_linears` and use it with the same backend.
    """

    def __init__(self, model: LlamaForCausalLM, backend: CpuBackend) -> None:
        problem = why_not(model, backend)
        if problem is not None:
            raise ValueError(f"DecodeStep cannot run this model: {problem}")
        load_op_library()
        layers: list[DecoderLayer] = list(model.model.layers)
        self.weights: list[Tensor] = [model.model.embed_tokens.weight.detach()]
        self.biases: list[Tensor | None] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.weights += [layer.input_layernorm.weight.detach(), attn.qkv_proj.packed_weight,
                             attn.o_proj.packed_weight,
                             layer.post_attention_layernorm.weight.detach(),
                             mlp.gate_up_proj.packed_weight, mlp.down_proj.packed_weight]
            self.biases += [attn.qkv_proj.bias, attn.o_proj.bias, mlp.gate_up_proj.bias,
                            mlp.down_proj.bias]
        attn = layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scale = attn.head_dim, attn.scale
        self.eps = layers[0].input_layernorm.eps
        self.inv_freq: Tensor = model.rotary.inv_freq
        self.rope_scaling = float(model.rotary.attention_scaling)
        self.kernel = backend.kernel_address
        # Each layer's own window (Qwen2's layer_types window only some): 0 for none.
        self.windows: list[int] = [layer.self_attn.sliding_window or 0 for layer in layers]
        # Qwen3's per-head norms of q and k, two a layer; none for the other families.
        self.qk_norms: list[Tensor] = [n.weight.detach() for layer in layers
                                       for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)
                                       if n is not None]
        # The final norm and LM head, for steps whose every row samples (logits=True).
        head = model.lm_head
        self.final_norm: Tensor = model.model.norm.weight.detach()
        self.lm_head: Tensor | None = head.packed_weight if isinstance(head, PackedLinear) \
            and head.bias is None and model.model.norm.eps == self.eps else None

    @staticmethod
    def applies(batch: ForwardBatch) -> bool:
        """Whether ``batch`` is one this op runs: one new token per sequence, no -1 slot."""
        return batch.max_seqlen_q == 1 and batch.slots_valid

    @property
    def makes_logits(self) -> bool:
        """Whether ``logits=True`` is open to this model (its LM head is packed)."""
        return self.lm_head is not None

    def __call__(self, batch: ForwardBatch, kv_caches: list[KVCache], *,
                 logits: bool = False, temperature: Tensor | None = None,
                 greedy_below: float = 0.0, helper: bool = False) -> Tensor:
        """Hidden states ``[T, hidden]``, as ``model(batch, kv_caches, backend)`` returns;
        with ``logits`` (where :attr:`makes_logits`), ``model.compute_logits`` of them, every
        row, in the same call; with ``temperature`` too, one token per row drawn from
        those logits as :func:`sample_rows` draws."""
        head = self.lm_head if logits else None
        if logits and head is None:
            raise ValueError("this model's LM head is not packed: no logits from the op")
        if temperature is not None and not logits:
            raise ValueError("the op samples only from the logits it makes")
        return torch.ops.actorllm.llama_decode(
            batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables,
            batch.seq_lens, self.weights, self.biases, [k for k, _ in kv_caches],
            [v for _, v in kv_caches], self.inv_freq, self.rope_scaling, self.num_heads,
            self.num_kv_heads, self.head_dim, self.eps, self.scale,
            self.kernel, self.windows, self.qk_norms,
            self.final_norm if logits else None, head, temperature, greedy_below, helper)


def sample_rows(logits: Tensor, temperature: Tensor, greedy_below: float,
                uniforms: Tensor | None = None) -> Tensor:
    """One token per row of fp32 ``logits`` ``[rows, vocab]`` in one op call (the op
    library must be loaded): the argmax where ``temperature`` is below ``greedy_below``,
    else the inverse-CDF draw of ``softmax(logits / temperature)`` at ``1 - uniforms``
    (drawn from torch's default generator when None) over the unsorted row, the
    distribution ``filters.draw`` draws from."""
    return torch.ops.actorllm.sample_rows(logits, temperature, uniforms, greedy_below)


def load_sampler() -> Callable[..., Tensor] | None:
    """:func:`sample_rows` once the op library is loaded (built if needed), or None (logged)
    where it cannot be."""
    try:
        load_op_library()
    except CpuKernelError as exc:
        log.info("sampling runs torch ops: %s", exc)
        return None
    return sample_rows


def load_decode_step(model: torch.nn.Module, backend: object) -> DecodeStep | None:
    """A :class:`DecodeStep` for ``model``, or None (logged) where it cannot run or build."""
    try:
        return DecodeStep(model, backend)  # type: ignore[arg-type]
    except (ValueError, CpuKernelError) as exc:
        log.info("decode steps run the Python model: %s", exc)
        return None
