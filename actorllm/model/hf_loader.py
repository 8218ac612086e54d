"""Check and load a checkpoint for the transformers-backed path (:mod:`.hf_backend`).

``load_hf_config`` says in one line why a checkpoint is not a decoder-only causal LM this
path can serve (an encoder-decoder, a vision model, another head, attention layers of
another kind); ``load_hf_model`` builds the model with transformers' own
``from_pretrained`` (so its checkpoint conversions apply, e.g. per-expert MoE weights
into fused expert tensors) and turns a missing tensor or a shape mismatch into a
one-line ``ValueError`` instead of transformers' silent re-initialisation.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from actorllm.model.hf_attention import lean_attention
from actorllm.model.hf_backend import (
    ATTN_IMPLEMENTATION,
    HFCausalLM,
    direct_layer_forwards,
    register_attention,
    skip_eval_dropouts,
)
from actorllm.model.hf_experts import lean_experts
from actorllm.model.hf_kernels import fuse_rms_norms
from actorllm.model.hf_layout import transpose_weights
from actorllm.model.hf_mlp import fuse_expert_gates, fuse_gated_mlps

log = logging.getLogger(__name__)

_ATTENTION_LAYERS = ("full_attention", "sliding_attention")


def _causal_lm_classes() -> set[str]:
    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_hf_config(model_dir: str | Path, arch: str | None) -> PretrainedConfig:
    """The checkpoint's config, checked for this path; ``ValueError`` (one line) if unusable.

    ``arch`` is ``architectures[0]`` of config.json (None when it names none).
    """
    path = Path(model_dir)
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many types for an unknown/bad config
        raise ValueError(f"{str(path)!r}: transformers cannot read its config: "
                         f"{_first_line(exc)}") from None
    name = arch or type(config).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{str(path)!r}: {name} is an encoder-decoder model; only "
                         "decoder-only causal language models are supported")
    if getattr(config, "vision_config", None) is not None or "vision" in config.model_type:
        raise ValueError(f"{str(path)!r}: {name} is a vision model; only text-only "
                         "causal language models are supported")
    if arch is None:
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if not isinstance(arch, str) or arch not in _causal_lm_classes():
        raise ValueError(f"{str(path)!r}: {name} is not a causal language model "
                         "architecture transformers knows")
    _check_layers(config, path, arch)
    _check_rope(config, path, arch)
    config.architectures = [arch]
    if getattr(config, "num_key_value_heads", None) is None:
        config.num_key_value_heads = config.num_attention_heads
    return config


def _check_layers(config: PretrainedConfig, path: Path, arch: str) -> None:
    layer_types = getattr(config, "layer_types", None) or ()
    other = sorted({t for t in layer_types if t not in _ATTENTION_LAYERS})
    if other:
        raise ValueError(f"{str(path)!r}: {arch} has {other[0]!r} layers; only attention "
                         f"layers ({', '.join(_ATTENTION_LAYERS)}) are supported")
    if getattr(config, "use_bidirectional_attention", False) or \
            getattr(config, "is_causal", True) is False:
        raise ValueError(f"{str(path)!r}: {arch} attends bidirectionally; only causal "
                         "models are supported")


# transformers recomputes these frequencies from the longest position in the forward
# (``dynamic_rope_update``); in a packed batch that is another sequence's length, and the
# paged cache keeps keys rotated with the frequencies of the step that wrote them.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _check_rope(config: PretrainedConfig, path: Path, arch: str) -> None:
    rope = getattr(config, "rope_parameters", None) or {}
    # One dict, or one per layer type (Gemma 3: sliding_attention / full_attention).
    params = list(rope.values()) if all(isinstance(v, dict) for v in rope.values()) and rope \
        else [rope]
    for p in params:
        rope_type = p.get("rope_type", "default")
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise ValueError(f"{str(path)!r}: {arch} uses rope type {rope_type!r}, whose "
                             "frequencies change with the sequence's length; not supported")


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' load report and progress bars off: problems become our one line."""
    tl = transformers.utils.logging
    level = tl.get_verbosity()
    bars = tl.is_progress_bar_enabled()
    tl.set_verbosity_error()
    tl.disable_progress_bar()
    try:
        yield
    finally:
        tl.set_verbosity(level)
        if bars:
            tl.enable_progress_bar()


def load_hf_model(model_dir: str | Path, config: PretrainedConfig, *, dtype: torch.dtype,
                  device: str | torch.device) -> HFCausalLM:
    """Build ``config.architectures[0]`` from ``model_dir`` with paged attention.

    ``ValueError`` in one line for missing weights, a tensor whose shape the config does
    not imply, or a checkpoint transformers cannot load.
    """
    path = Path(model_dir)
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors weights")
    register_attention()
    arch = config.architectures[0]
    cls = getattr(transformers, arch, None) or transformers.AutoModelForCausalLM
    try:
        with _quiet_transformers():
            model, info = cls.from_pretrained(
                str(path), config=config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as exc:  # transformers raises many types for a bad checkpoint
        raise ValueError(f"{str(path)!r}: transformers cannot load {arch}: "
                         f"{_first_line(exc)}") from None
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        key, *shapes = mismatched[0] if isinstance(mismatched[0], tuple) else (mismatched[0],)
        detail = f" (checkpoint {tuple(shapes[0])}, the config implies {tuple(shapes[1])})" \
            if len(shapes) == 2 else ""
        raise ValueError(f"{str(path)!r}: tensor {key!r} has the wrong shape{detail}")
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"{str(path)!r}: checkpoint is missing tensor {missing[0]!r}{more}")
    if any(getattr(m, "sinks", None) is not None for m in model.modules()):
        raise ValueError(f"{str(path)!r}: {arch} uses attention sinks, which the paged "
                         "attention op does not implement")
    model = model.to(device).eval()
    # After the move: a fused forward keeps the device tensors it was built with; the
    # weights re-laid first, since Phi-3's fused MLP takes views of its gate/up weight.
    layout = transpose_weights(model)
    norms, mlps = fuse_rms_norms(model), fuse_gated_mlps(model)
    attention = lean_attention(model)
    skip_eval_dropouts(model)
    direct_layer_forwards(model)
    log.info("loaded %s from %s through transformers (%s, %s; weights stored transposed: "
             "%d linear, %d expert; RMSNorms in one op: %d Llama-kind, %d Gemma-kind, "
             "%d kept; gated MLPs in one forward: %d, %d kept; lean attention forwards: "
             "%d, %d kept; expert gates in place: %d; lean experts forwards: %d)",
             arch, path, dtype, device, layout["linear"], layout["experts"],
             norms["llama"], norms["gemma"], norms["kept"], mlps["fused"], mlps["kept"],
             attention["lean"], attention["kept"], fuse_expert_gates(model),
             lean_experts(model))
    return HFCausalLM(model)
