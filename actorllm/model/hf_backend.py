"""Any decoder-only causal LM transformers can build, run over the paged KV cache.

The model's own transformers modules compute everything but attention: embeddings (scaled
ones too), norms, rotary embeddings of every kind, q/k norms, MLPs and mixtures of
experts, per-layer attention types. Attention goes through transformers' attention
interface: the model is built with ``attn_implementation="actorllm_paged"``, whose
function (:func:`paged_attention_forward`) writes each layer's new K/V into that layer's
paged cache and runs the backend's paged attention op, with the window, scale and
soft-cap the model's attention module passes. So continuous batching, chunked prefill,
prefix caching and preemption work as for the native model: the model sees one packed
batch of every scheduled sequence's new tokens (``[1, T]``, positions per token), and
each step's :class:`ForwardBatch`, caches and backend travel to the attention function
as a keyword argument of the model's forward, which transformers passes down to it.

transformers builds no attention mask for an implementation it has no mask function
for (``masking_utils._preprocess_mask_arguments``), so the packed batch costs no
``[T, T]`` mask: the paged op knows where each sequence starts from ``cu_seqlens_q``.
"""

from __future__ import annotations

import logging
from types import MethodType
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from actorllm.model.llama import ForwardBatch, KVCache
from actorllm.model.parallel import TensorParallel
from actorllm.ops import AttentionBackend

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "actorllm_paged"
STEP_KWARG = "actorllm_step"
_registered = False


class Step:
    """What the attention function needs from the step in flight."""

    __slots__ = ("backend", "batch", "kv_caches", "rope")

    def __init__(self, batch: ForwardBatch, kv_caches: list[KVCache],
                 backend: AttentionBackend) -> None:
        self.batch, self.kv_caches, self.backend = batch, kv_caches, backend
        # RoPE tables in the paged op's layout, built once a step (``hf_attention``).
        self.rope: dict[int, tuple[Tensor, Tensor, Tensor]] = {}


def paged_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract over the paged cache.

    ``query`` is ``[1, H, T, D]`` and ``key``/``value`` ``[1, Hkv, T, D]`` (after RoPE and
    any q/k norm); returns ``([1, T, H, D], None)`` as transformers' SDPA function does.
    ``attention_mask`` is ignored: causality per sequence comes from the batch.
    """
    step: Step | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(f"{type(module).__name__}: {ATTN_IMPLEMENTATION} attention called "
                           "outside a step (the model must run through HFCausalLM)")
    batch = step.batch
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    k_cache, v_cache = step.kv_caches[module.layer_idx]
    step.backend.write_kv(k, v, k_cache, v_cache, batch.slot_mapping,
                          slots_valid=batch.slots_valid)
    out = step.backend.paged_attention(
        q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q,
        scaling if scaling is not None else q.shape[-1] ** -0.5,
        max_seqlen_q=batch.max_seqlen_q, max_seqlen_k=batch.max_seqlen_k,
        sliding_window=sliding_window or None, softcap=softcap or None,
    )
    return out.unsqueeze(0), None


def register_attention() -> None:
    """Make ``attn_implementation="actorllm_paged"`` known to transformers (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
        _registered = True


class _WholeSlices(nn.ModuleList):
    """A ``ModuleList`` whose slice over all of it is itself.

    transformers' base models iterate ``self.layers[: config.num_hidden_layers]``: on a
    plain ``ModuleList`` that builds a new list each forward (a ``Module.__init__`` and an
    ``add_module`` per layer, about 2 % of a decode step at the benchmark's shape).
    """

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice) and idx.indices(len(self)) == (0, len(self), 1):
            return self
        return super().__getitem__(idx)


def whole_layer_slices(base: nn.Module) -> bool:
    """Make ``base.layers`` (a plain ``ModuleList``) return itself for a whole slice;
    whether it did. The same modules in the same order: the forward is unchanged."""
    layers = getattr(base, "layers", None)
    if type(layers) is not nn.ModuleList:
        return False
    layers.__class__ = _WholeSlices
    return True


def _no_dropout(self: nn.Module, x: Tensor) -> Tensor:
    # ``F.dropout`` with ``training=False`` returns its input; its Python checks are skipped.
    return x if not self.training else type(self).forward(self, x)


def skip_eval_dropouts(model: nn.Module) -> int:
    """Give every ``nn.Dropout`` of ``model`` a forward that returns its input unless the
    module is training (Phi-3's two residual dropouts a layer); returns how many. The
    output is the same tensor ``F.dropout`` returns in eval. Idempotent."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Dropout and "forward" not in module.__dict__:
            module.forward = MethodType(_no_dropout, module)
            count += 1
    return count


# The wrappers around a decoder layer's forward that do nothing in inference: gradient
# checkpointing (training only) and renaming a deprecated keyword our forward never passes.
_INERT_WRAPPERS = ("forward_with_checkpointing", "deprecate_kwarg.")


def direct_layer_forwards(model: nn.Module) -> int:
    """Bind each decoder layer's own forward, without the wrappers of ``_INERT_WRAPPERS``,
    to the layer instance; returns how many. A layer whose forward is wrapped by anything
    else, or that is training, keeps its class's forward. Idempotent."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    count = 0
    for module in model.modules():
        if not isinstance(module, GradientCheckpointingLayer) or "forward" in module.__dict__ \
                or module.training or module.gradient_checkpointing:
            continue
        forward, wrappers = type(module).forward, 0
        while hasattr(forward, "__wrapped__"):
            # functools.wraps copies the name; the code object keeps the wrapper's own.
            if not any(w in forward.__code__.co_qualname for w in _INERT_WRAPPERS):
                break
            forward, wrappers = forward.__wrapped__, wrappers + 1
        else:
            if wrappers:
                module.forward = MethodType(forward, module)
                count += 1
    return count


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the runner's model contract.

    ``forward(batch, kv_caches, backend)`` returns the final hidden states ``[T, hidden]``
    (after the model's final norm, unlike the native model, which leaves it to
    ``compute_logits``); ``compute_logits`` applies the LM head and what the model's
    own ``forward`` does to its logits after it (Gemma's final soft-cap, Granite's
    ``logits_scaling``, Cohere's ``logit_scale``).
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        self.config: PretrainedConfig = hf_model.config
        self.tp = TensorParallel()  # one rank: the transformers path is not sharded
        self.base = getattr(hf_model, hf_model.base_model_prefix)
        whole_layer_slices(self.base)
        self.lm_head = hf_model.get_output_embeddings()
        cfg = self.config
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        self._divide = getattr(cfg, "logits_scaling", None)
        scale = getattr(hf_model, "logit_scale", None)
        self._multiply = scale if isinstance(scale, int | float) and scale != 1 else None

    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache],
                backend: AttentionBackend) -> Tensor:
        """Final hidden states of every packed token, ``[T, hidden]``."""
        out = self.base(
            input_ids=batch.input_ids[None],
            position_ids=batch.positions[None],
            use_cache=False,
            **{STEP_KWARG: Step(batch, kv_caches, backend)},
        )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits ``[N, vocab]`` for the given rows of ``forward``'s output."""
        logits = self.lm_head(hidden)
        if self._multiply is not None:
            logits = logits * self._multiply
        if self._divide:
            logits = logits / self._divide
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits.float()
