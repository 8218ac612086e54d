"""Engine configuration: one frozen object built by the CLI or the Python API."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import attrs

TOPOLOGIES = ("single", "engine", "pipeline")


def default_model_dir() -> Path:
    """The small Llama shipped inside the package (see its MODEL_CARD.md)."""
    return Path(str(importlib.resources.files("actorllm").joinpath("assets/default-model")))


@attrs.frozen
class EngineConfig:
    """Everything that shapes an engine. Sizes are validated against the model at start-up."""

    model: str = attrs.field(factory=lambda: str(default_model_dir()))
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from kv_cache_memory
    kv_cache_memory: int = 256 * 2**20  # bytes for K and V of all layers
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    attention_backend: str = "auto"
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    cpu_threads: int | None = None  # torch threads of the Worker's process; None: torch's
    mailbox_capacity: int = 256
    topology: str = "single"
    trace: str | None = None
    trace_hops: bool = False

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.block_size <= 256:
            raise ValueError(f"--block-size must be in [1, 256], got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("--num-kv-blocks must be at least 1")
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be at least 1")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("--cpu-threads must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must be at least 2")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"--topology must be one of {', '.join(TOPOLOGIES)}")
        if self.attention_backend not in ("auto", "torch", "cpu", "cuda"):
            raise ValueError("--attention-backend must be auto, torch, cpu or cuda")

    def as_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


@attrs.frozen
class ModelInfo:
    """What the non-Worker actors need to know about a checkpoint, read without torch."""

    path: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict[str, object]


def read_model_info(model_dir: str | Path, max_model_len: int | None = None) -> ModelInfo:
    """Read config.json and generation_config.json; ValueError with a one-line reason."""
    import json

    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model directory not found: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"not a model directory (no config.json): {path}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {cfg_file}: {exc}") from None
    text_cfg = cfg.get("text_config", cfg)
    gen: dict[str, object] = {}
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        try:
            gen = json.loads(gen_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {gen_file}: {exc}") from None
    eos: object = gen.get("eos_token_id", text_cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))  # type: ignore[arg-type]
    limit = int(text_cfg.get("max_position_embeddings", 2048))
    if max_model_len is not None:
        if max_model_len > limit:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the model's {limit}")
        limit = max_model_len
    return ModelInfo(
        path=str(path),
        vocab_size=int(text_cfg["vocab_size"]),
        max_model_len=limit,
        eos_token_ids=tuple(int(e) for e in eos_ids),
        generation_defaults=gen,
    )
