"""A lean forward for a transformers model's attention modules, checked before use.

A transformers attention module (Llama's and the many kinds copied from it) projects q, k
and v, views and transposes them to ``[1, H, T, D]``, applies RoPE through
``rotate_half`` (two slices, a negation and a ``cat`` for q and again for k, Phi-3 one
more slice and ``cat`` each for its partial-rotary split), looks the attention function
up by the config's implementation and calls it through two decorators
(``deprecate_kwarg``, ``kernels``' ``use_kernelized_func``), and our attention function
turns q, k and v back to ``[T, H, D]``. At a decode step's few rows each of those ops
costs its dispatch, not its arithmetic.

:func:`lean_attention` gives each such module instance a forward that does the same in
the paged op's layout: the same projections (Phi-3's fused ``qkv_proj`` split as the
module splits it), the module's own q/k norms (per head or over the whole projection,
as the module applies them), RoPE as ``x * cos + roll(x) * sin`` with the sign of
``rotate_half`` folded into a ``sin`` built once a step, and the backend's ``write_kv``
and ``paged_attention`` called directly with the scale, window and soft-cap the module's
own forward passed to the attention function (recorded on a probe). A forward is kept
only if, on a random probe, its output and the K/V it writes match the module's own
(float rounding: RoPE's products are summed by one ``addcmul``); a module whose forward
does something else (another RoPE, a clip, another signature) keeps its own. Outside a
step (no ``actorllm_step`` keyword) or with a partial rotary ``cos`` the module's own
forward runs.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
from torch import Tensor, nn

from actorllm.model.hf_backend import STEP_KWARG, Step
from actorllm.model.hf_mlp import close, swap_or_keep
from actorllm.model.llama import ForwardBatch
from actorllm.ops import TorchBackend

_LEAN = "_actorllm_lean_attention"
_SEPARATE = ("q_proj", "k_proj", "v_proj", "o_proj")


class _Recorder(TorchBackend):
    """The torch reference, remembering what the module's forward asked of the op."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[float, int | None, float | None]] = []

    def paged_attention(self, q: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        scale = args[5] if len(args) > 5 else kwargs["scale"]
        self.asked.append((scale, kwargs.get("sliding_window"), kwargs.get("softcap")))
        return super().paged_attention(q, *args, **kwargs)


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    child = getattr(module, name, None)
    return child if type(child) is nn.Linear else None


def _rope(step: Step, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """``cos`` and ``rotate_half``'s signed ``sin`` as ``[T, 1, D]``, once a step per pair
    (layers of one attention type share theirs)."""
    key = id(sin)
    found = step.rope.get(key)
    if found is None or found[0] is not sin:
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        found = (sin, cos[0].unsqueeze(1), signed[0].unsqueeze(1))
        step.rope[key] = found
    return found[1], found[2]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # rotate_half(x) * sin == roll(x, D/2) * signed sin: the sign flips are exact.
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


def _projections(module: nn.Module, heads: int, kv_heads: int, head_dim: int
                 ) -> Callable[[Tensor], tuple[Tensor, Tensor, Tensor]] | None:
    """``x [T, hidden] -> q, k, v`` as ``[T, heads, D]`` with the module's q/k norms, or
    None when the module's children are not one of the known layouts."""
    names = {n for n, _ in module.named_children()}
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    norms = q_norm is not None and k_norm is not None
    if names != {*_SEPARATE, *(("q_norm", "k_norm") if norms else ())} \
            and names != {"qkv_proj", "o_proj"}:
        return None
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    if "qkv_proj" in names:
        fused = module.qkv_proj
        if fused.out_features != q_size + 2 * kv_size:
            return None
        w, b = fused.weight, fused.bias

        def split(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            qkv = torch.nn.functional.linear(x, w, b)
            t = qkv.shape[0]
            return (qkv[:, :q_size].view(t, heads, head_dim),
                    qkv[:, q_size:q_size + kv_size].view(t, kv_heads, head_dim),
                    qkv[:, q_size + kv_size:].view(t, kv_heads, head_dim))

        return split
    linears = [_linear(module, n) for n in _SEPARATE[:3]]
    if any(lin is None for lin in linears):
        return None
    (qw, qb), (kw, kb), (vw, vb) = [(lin.weight, lin.bias) for lin in linears]
    # Qwen3 and Gemma 3 normalise each head; OLMo 2 the whole projection.
    whole = norms and q_norm.weight.shape[-1] == q_size and q_size != head_dim

    def separate(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        t = x.shape[0]
        q = torch.nn.functional.linear(x, qw, qb)
        k = torch.nn.functional.linear(x, kw, kb)
        v = torch.nn.functional.linear(x, vw, vb).view(t, kv_heads, head_dim)
        if not norms:
            return q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), v
        if whole:
            return (q_norm(q).view(t, heads, head_dim), k_norm(k).view(t, kv_heads, head_dim),
                    v)
        return (q_norm(q.view(t, heads, head_dim)), k_norm(k.view(t, kv_heads, head_dim)), v)

    return separate


def _forward(project: Callable[[Tensor], tuple[Tensor, Tensor, Tensor]], o_proj: nn.Linear,
             asked: tuple[float, int | None, float | None], own: Callable[..., Any]
             ) -> Callable[..., Any]:
    scale, window, softcap = asked
    ow, ob = o_proj.weight, o_proj.bias

    def attention(self: nn.Module, hidden_states: Tensor,
                  position_embeddings: tuple[Tensor, Tensor] | None = None,
                  attention_mask: Tensor | None = None, **kwargs: Any) -> tuple[Tensor, None]:
        step: Step | None = kwargs.get(STEP_KWARG)
        if step is None or position_embeddings is None \
                or position_embeddings[0].shape[-1] != self.head_dim:
            return own(hidden_states, position_embeddings, attention_mask, **kwargs)
        x = hidden_states[0]
        q, k, v = project(x)
        cos, sin = _rope(step, *position_embeddings)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        batch, backend = step.batch, step.backend
        k_cache, v_cache = step.kv_caches[self.layer_idx]
        backend.write_kv(k, v.contiguous(), k_cache, v_cache, batch.slot_mapping,
                         slots_valid=batch.slots_valid)
        out = backend.paged_attention(
            q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q,
            scale, max_seqlen_q=batch.max_seqlen_q, max_seqlen_k=batch.max_seqlen_k,
            sliding_window=window, softcap=softcap)
        return torch.nn.functional.linear(out.view(x.shape[0], -1), ow, ob)[None], None

    return attention


def _probe_step(module: nn.Module, kv_heads: int, head_dim: int, tokens: int,
                backend: TorchBackend) -> Step:
    weight = module.o_proj.weight
    block = 4
    blocks = (tokens + block - 1) // block
    caches = [(torch.zeros(blocks, block, kv_heads, head_dim, dtype=weight.dtype,
                           device=weight.device),
               torch.zeros(blocks, block, kv_heads, head_dim, dtype=weight.dtype,
                           device=weight.device))]
    ints = dict(dtype=torch.int32, device=weight.device)
    batch = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.long, device=weight.device),
        positions=torch.arange(tokens, device=weight.device),
        slot_mapping=torch.arange(tokens, device=weight.device),
        block_tables=torch.arange(blocks, **ints)[None],
        seq_lens=torch.tensor([tokens], **ints), cu_seqlens_q=torch.tensor([0, tokens], **ints),
        sample_indices=torch.tensor([tokens - 1], device=weight.device),
        max_seqlen_q=tokens, max_seqlen_k=tokens, slots_valid=True)
    # The probe's module is layer 0 of its own one-layer cache list.
    return Step(batch, caches * (module.layer_idx + 1), backend)


def _check(module: nn.Module, kv_heads: int, head_dim: int,
           build: Callable[[tuple[float, int | None, float | None]], Callable[..., Any]]
           ) -> Callable[..., Any] | None:
    """The lean forward if it reproduces the module's own on a random probe, else None."""
    weight = module.o_proj.weight
    hidden = module.o_proj.out_features
    tokens = 11
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, hidden, generator=gen).to(weight.device, weight.dtype)
    angles = torch.rand(1, tokens, head_dim, generator=gen) * 6.0
    rope = (angles.cos().to(weight.device, weight.dtype),
            angles.sin().to(weight.device, weight.dtype))
    recorder = _Recorder()
    own_step = _probe_step(module, kv_heads, head_dim, tokens, recorder)
    try:
        with torch.inference_mode():
            want, _ = module(x, position_embeddings=rope, attention_mask=None,
                             **{STEP_KWARG: own_step})
            if len(recorder.asked) != 1:
                return None
            forward = build(recorder.asked[0])
            lean_step = _probe_step(module, kv_heads, head_dim, tokens, TorchBackend())
            got, _ = MethodType(forward, module)(x, rope, None, **{STEP_KWARG: lean_step})
    except Exception:  # another signature or layout: not ours to replace
        return None
    pairs = [(got, want), *zip(lean_step.kv_caches[module.layer_idx],
                               own_step.kv_caches[module.layer_idx], strict=True)]
    return forward if all(close(a, b, weight.dtype) for a, b in pairs) else None


def lean_attention(model: nn.Module) -> dict[str, int]:
    """Give every attention module of ``model`` that a lean forward reproduces that
    forward; returns ``{"lean": n, "kept": m}`` (``kept``: modules with q/k/v projections
    that keep their own). Call after the weights are laid out and the norms fused (the
    forward keeps the tensors it was built with). Idempotent."""
    config = model.config
    counts = {"lean": 0, "kept": 0}
    for name, module in model.named_modules():
        if getattr(module, _LEAN, False) or _linear(module, "o_proj") is None \
                or not isinstance(getattr(module, "layer_idx", None), int) \
                or not isinstance(getattr(module, "head_dim", None), int):
            continue
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        project = _projections(module, heads, kv_heads, module.head_dim) \
            if isinstance(heads, int) else None
        own = module.forward
        forward = None if project is None else _check(
            module, kv_heads, module.head_dim,
            lambda asked, p=project, m=module, o=own: _forward(p, m.o_proj, asked, o))
        swap_or_keep(counts, "lean", name, module, forward, _LEAN)
    return counts
