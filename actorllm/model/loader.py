"""Load a Hugging Face checkpoint directory: the native model or the transformers path.

A directory holds ``config.json`` and ``*.safetensors`` weights (one file, or shards
listed by ``model.safetensors.index.json``). ``model_impl`` picks the implementation:
``native`` is :class:`LlamaForCausalLM` (Llama, Mistral, Qwen2, Qwen3), ``transformers``
is :class:`~actorllm.model.hf_backend.HFCausalLM` (any decoder-only causal LM transformers
can build), ``auto`` the native one where it exists. For the native model, RoPE
frequencies come from transformers' own init functions, so every rope type it computes
statically (default, linear, llama3, yarn) matches it exactly. Every problem with the
directory is a one-line ``ValueError``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from actorllm.config import read_config_json
from actorllm.model.llama import LlamaForCausalLM, RotaryEmbedding, head_dim_of

if TYPE_CHECKING:
    from actorllm.model.hf_backend import HFCausalLM
from actorllm.model.parallel import IMPL_ATTR, TensorParallel, check_tensor_parallel

log = logging.getLogger(__name__)

CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "LlamaForCausalLM": LlamaConfig,
    "MistralForCausalLM": MistralConfig,
    "Qwen2ForCausalLM": Qwen2Config,
    "Qwen3ForCausalLM": Qwen3Config,
}
# Rope types whose frequencies depend on the running sequence length are not supported:
# the paged cache stores rotated keys, so frequencies must not change mid-sequence.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# HF name -> (our fused parameter, shard index) for the projections fused at load time.
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


MODEL_IMPLS = ("auto", "native", "transformers")


def model_impl_of(config: PretrainedConfig) -> str:
    """``"native"`` or ``"transformers"``: the implementation ``load_config`` chose."""
    return getattr(config, IMPL_ATTR, "native")


def _choose_impl(arch: object, model_impl: str, path: Path) -> str:
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"--model-impl must be one of {', '.join(MODEL_IMPLS)}, "
                         f"got {model_impl!r}")
    if model_impl == "native" and arch not in CONFIG_CLASSES:
        raise ValueError(
            f"{str(path)!r}: unsupported architecture {arch!r} for the native model (supported: "
            f"{', '.join(CONFIG_CLASSES)}); --model-impl auto or transformers runs it")
    if model_impl == "transformers" or arch not in CONFIG_CLASSES:
        return "transformers"
    return "native"


def load_config(model_dir: str | Path, model_impl: str = "native") -> PretrainedConfig:
    """Read and check ``model_dir/config.json`` for ``model_impl``; a one-line ``ValueError``
    if unusable. :func:`model_impl_of` says which implementation it chose."""
    path = Path(model_dir)
    raw = read_config_json(path)
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if _choose_impl(arch, model_impl, path) == "transformers":
        from actorllm.model.hf_loader import load_hf_config

        config = load_hf_config(path, arch if isinstance(arch, str) else None)
        setattr(config, IMPL_ATTR, "transformers")
        return config
    try:
        config = CONFIG_CLASSES[arch].from_dict(raw)  # (the file is read once, above)
    except Exception as exc:  # transformers raises many types for a bad config
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path / 'config.json'}: cannot be read as {arch}: {first_line}") \
            from None
    config.architectures = [arch]
    try:
        _check_config(config, path)
    except ValueError as exc:
        if model_impl != "auto":
            raise
        # A native architecture with a feature the native model lacks (an activation,
        # partial rotary): the model's own transformers code may still run it.
        log.info("%s; using the transformers implementation", exc)
        return load_config(path, "transformers")
    return config


def _check_config(config: PretrainedConfig, path: Path) -> None:
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"{str(path)!r}: num_attention_heads ({config.num_attention_heads}) is not a "
            f"multiple of num_key_value_heads ({config.num_key_value_heads})"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"{str(path)!r}: unsupported hidden_act {config.hidden_act!r}")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"{str(path)!r}: unsupported rope type {rope_type!r} "
            f"(supported: {', '.join(STATIC_ROPE_TYPES)})"
        )
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{str(path)!r}: partial rotary embeddings are not supported")


def rotary_for(config: PretrainedConfig) -> RotaryEmbedding:
    """The rotary embedding, with ``inv_freq`` from transformers' rope init functions."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        # transformers keeps the default formula inside each model class, not in the table.
        dim = head_dim_of(config)
        base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return RotaryEmbedding(inv_freq, 1.0)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return RotaryEmbedding(inv_freq, float(scaling))


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a valid safetensors index ({exc!r})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{str(path)!r}: shard {missing[0]} listed in {index.name} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors weights")
    return files


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    config: PretrainedConfig | None = None,
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM | HFCausalLM:
    """Build the model for ``model_dir`` and fill it from its safetensors (``dtype``, ``device``).

    With ``tp``, only that rank's shard: each sharded tensor is read as its slice
    (``safe_open(...).get_slice``), so a rank never holds the whole of it.

    Raises a one-line ``ValueError`` for a missing/bad directory, an unsupported
    architecture or a checkpoint that lacks tensors the model needs.
    """
    path = Path(model_dir)
    config = config or load_config(path)
    if model_impl_of(config) == "transformers":
        check_tensor_parallel(config, tp.world if tp is not None else 1)
        from actorllm.model.hf_loader import load_hf_model

        return load_hf_model(path, config, dtype=dtype, device=device)
    files = _weight_files(path)
    arch = config.architectures[0]
    attention_bias = bool(getattr(config, "attention_bias", False))
    with torch.device("meta"):
        model = LlamaForCausalLM(
            config,
            RotaryEmbedding(torch.empty(head_dim_of(config) // 2), 1.0),  # replaced below
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tp=tp,
        )
    # Meta construction skips random init (minutes for a 7B model on CPU); every
    # parameter is then either loaded below or reported missing.
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own tensor, breaking the tie
    model.rotary = rotary_for(config).to(device)  # after the cast: rope stays fp32, as in HF

    expected = set(_hf_names(model))
    seen: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in expected:
                        log.debug("%s: ignoring tensor %s", file.name, name)
                        continue
                    _load_one(model, name, _read(f, name, model), file.name)
                    seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"{str(path)!r}: checkpoint is missing tensor {missing[0]!r}{more}")
    log.info("loaded %s from %s (%s, %s)", arch, path, dtype, device)
    return model.eval()


def _hf_names(model: LlamaForCausalLM) -> list[str]:
    """The checkpoint tensor names that fill the model (fused ones expand to their parts)."""
    names = []
    for name, _ in model.named_parameters():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        prefix, _, leaf = name.rpartition(".")
        module_path, _, module = prefix.rpartition(".")
        parts = [hf for hf, (ours, _) in _FUSED.items() if ours == module]
        names += [f"{module_path}.{p}.{leaf}" for p in parts] if parts else [name]
    return names


def _read(f: object, name: str, model: LlamaForCausalLM) -> torch.Tensor:
    """Checkpoint tensor ``name``, or only this rank's slice of it."""
    tp = model.tp
    view = f.get_slice(name)  # type: ignore[attr-defined]
    shape = tuple(view.get_shape())
    if tp.zero_on_this_rank(name):
        return torch.zeros(shape)  # copy_ casts it
    span = tp.shard(name, shape, model.config)
    if span is None:
        return view[:]
    dim, start, length = span
    return view[start:start + length] if dim == 0 else view[:, start:start + length]


def _load_one(model: LlamaForCausalLM, name: str, tensor: torch.Tensor, file: str) -> None:
    """Copy one checkpoint tensor into its parameter, or into its slice of a fused one."""
    prefix, _, leaf = name.rpartition(".")
    module_path, _, module = prefix.rpartition(".")
    if module in _FUSED:
        fused, shard = _FUSED[module]
        linear = model.get_submodule(f"{module_path}.{fused}")
        sizes = linear.shards
        target = getattr(linear, leaf).narrow(0, sum(sizes[:shard]), sizes[shard])
    else:
        target = model.get_parameter(name)
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(
            f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the config implies {tuple(target.shape)}"
        )
    target.copy_(tensor)


def check_device_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """Raise a one-line ``ValueError`` unless ``device`` exists and can run ``dtype``.

    A few ops of the kinds every model runs (a matmul, a softmax, an RMSNorm) are tried,
    so that a dtype the device lacks fails here rather than inside the first step.
    """
    name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: torch sees no CUDA GPU here")
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ValueError(f"--dtype bfloat16: the GPU on {device} cannot run it; "
                             "use --dtype float16")
    try:
        x = torch.ones(2, 8, dtype=dtype, device=device)
        torch.softmax(torch.rms_norm(x @ x.T, (2,)), dim=-1).sum().item()
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"--dtype {name} cannot run on {device}: {first}") from None
