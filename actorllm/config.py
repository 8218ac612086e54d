"""Engine configuration: one frozen object built by the CLI or the Python API."""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Mapping
from pathlib import Path

import attrs

from actorllm.draft_config import METHOD_KEYS, TEXT_KEYS, check_draft_model, draft_dir

TOPOLOGIES = ("single", "engine", "pipeline")
CPU_DRAFT_TOKENS_PER_STEP = 8  # SpeculativeConfig.max_draft_tokens_per_step's CPU default


def default_model_dir() -> Path:
    """The small Llama shipped inside the package (see its MODEL_CARD.md)."""
    return Path(str(importlib.resources.files("actorllm").joinpath("assets/default-model")))


def check_here_and_wait(kind: str, what: str, local: int | None, size: int,
                         timeout: float) -> None:
    """``--{kind}-local-{what}`` within [1, size] and a positive ``--{kind}-timeout`` (for
    the config and for a rendezvous made without one)."""
    if local is not None and not 1 <= local <= size:
        raise ValueError(f"--{kind}-local-{what} must be in [1, {size}] (--{kind}-size), "
                         f"got {local}")
    if not timeout > 0:
        raise ValueError(f"--{kind}-timeout must be positive, got {timeout:g}")


def _json_object(value: object) -> object:
    """A JSON text as what it encodes (a bad one is kept, for the check to name)."""
    if isinstance(value, str) and value:
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


@attrs.frozen
class SpeculativeConfig:
    """Speculative decoding, vLLM's ``--speculative-config`` shape. ``ngram`` (prompt
    lookup): the Scheduler proposes up to ``num_speculative_tokens`` tokens that followed
    the latest earlier occurrence of the sequence's last n tokens, n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``. ``draft_model``: the Worker's
    draft ``model`` (a directory or a hub id) proposes them (docs/architecture.md, "Speculative
    decoding")."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # vLLM's: no proposals while this many sequences or more run (None: no limit).
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft's directory (a hub id resolved)
    # A step's draft tokens, shared evenly (a row gets this // running); None: for_device.
    max_draft_tokens_per_step: int | None = None

    @classmethod
    def parse(cls, raw: object) -> SpeculativeConfig | None:
        """From a JSON text or a mapping (None or empty: off). ValueError, one line."""
        if raw is None or raw == "" or raw == {}:
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(raw, Mapping):
            raise ValueError("--speculative-config must be a JSON object")
        method = raw.get("method", "ngram")
        if method not in METHOD_KEYS:
            raise ValueError(f"--speculative-config: method {method!r} is not supported "
                             "(only 'ngram' and 'draft_model')")
        unknown = sorted(set(raw) - METHOD_KEYS[method])
        if unknown:
            raise ValueError(f"--speculative-config: unknown key {unknown[0]!r}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config: num_speculative_tokens is required")
        model = draft_dir(raw) if method == "draft_model" else None
        fields = {k: raw[k] for k in raw if k not in TEXT_KEYS}
        for k, v in fields.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"--speculative-config: {k} must be a positive integer, "
                                 f"got {v!r}")
        lo, hi = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        if lo is not None and hi is None:
            fields["prompt_lookup_max"] = hi = max(lo, cls.prompt_lookup_max)
        if hi is not None and lo is None:
            fields["prompt_lookup_min"] = lo = min(hi, cls.prompt_lookup_min)
        if lo is not None and hi is not None and lo > hi:
            raise ValueError("--speculative-config: prompt_lookup_min must not exceed "
                             "prompt_lookup_max")
        if fields["num_speculative_tokens"] > 32:
            raise ValueError("--speculative-config: num_speculative_tokens must be at most 32")
        return cls(method, **fields, model=model)

    def for_device(self, device: str) -> SpeculativeConfig:
        """``max_draft_tokens_per_step`` resolved: unset, 8 on the CPU (docs/architecture.md,
        "Speculative decoding"); on a GPU no cap."""
        if self.max_draft_tokens_per_step is not None or not device.startswith("cpu"):
            return self
        return attrs.evolve(self, max_draft_tokens_per_step=CPU_DRAFT_TOKENS_PER_STEP)


@attrs.frozen
class EngineConfig:
    """Everything that shapes an engine. Sizes are validated against the model at start-up."""

    model: str = attrs.field(factory=lambda: str(default_model_dir()))
    # auto: the native model where it has the architecture, else transformers' own modules
    # with paged attention (actorllm/model/hf_backend.py); native; transformers.
    model_impl: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from kv_cache_memory
    kv_cache_memory: int = 256 * 2**20  # bytes for K and V of all layers
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # or "priority" (SamplingParams.priority)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    attention_backend: str = "auto"
    device: str = "cpu"
    cuda_graphs: bool = False  # decode steps replayed from CUDA graphs (worker/cuda_graphs.py)
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    cpu_threads: int | None = None  # the Worker process's torch threads; None: worker_threads
    # The main process's event loop serves HTTP (`actorllm serve`): on the CPU, a Worker
    # beside it (`single`) leaves it a core for ordinary steps (placement.worker_threads).
    serving_http: bool = False
    # Ranks of one model, Megatron-style (actorllm/worker/ranks.py): the Worker's process is rank
    # 0 and starts ranks 1..local-1 on this host; the others join from other hosts
    # (actorllm/wire/rendezvous.py, at MASTER_ADDR:MASTER_PORT). On the CPU, cpu_threads (None:
    # cores / N) is per rank.
    tensor_parallel_size: int = 1
    tensor_parallel_local_ranks: int | None = None  # None: all of them on this host
    tensor_parallel_timeout: float = 300.0  # for every rank to join and load its shard
    # Replicas of the Scheduler and Worker, each in a process of its own behind one
    # Frontend (docs/architecture.md, "Data parallelism"); > 1 needs topology "engine".
    data_parallel_size: int = 1
    # Replicas 0..local-1 run on this host; the others join from other hosts (`actorllm
    # replica`, at MASTER_ADDR:MASTER_PORT: actorllm/topology/remote.py). None: all here.
    data_parallel_local_replicas: int | None = None
    data_parallel_timeout: float = 300.0  # for every replica to join and load its model
    # When a process of the engine dies: "exit" (the engine is dead) or, with data
    # parallelism, "stay" (only that replica's requests fail; the others serve on).
    on_engine_death: str = "exit"
    # Plan step N+1 while step N runs (two steps in flight); None: where it measured
    # faster (the ``overlap`` property).
    async_scheduling: bool | None = None
    mailbox_capacity: int = 256
    topology: str = "single"
    trace: str | None = None
    trace_hops: bool = False
    # Slow readers (the Frontend's flow control, FlowLimits in actorllm/frontend/readers.py);
    # None: off.
    max_pending_bytes_per_request: int | None = 256 << 10
    max_pending_bytes: int | None = 64 << 20
    stream_timeout: float | None = 30.0
    # Speculative decoding (SpeculativeConfig's JSON shape, kept as a plain mapping so the
    # config travels to child processes as JSON); None: off.
    speculative_config: dict[str, object] | None = attrs.field(default=None,
                                                               converter=_json_object)

    def __attrs_post_init__(self) -> None:
        spec = SpeculativeConfig.parse(self.speculative_config)  # ValueError now, not at load
        if spec is not None and spec.model is not None:
            check_draft_model(spec.model, self.model, self.tensor_parallel_size)
        if not 1 <= self.block_size <= 256:
            raise ValueError(f"--block-size must be in [1, 256], got {self.block_size}")
        for flag, n in (("--num-kv-blocks", self.num_kv_blocks),
                        ("--max-num-seqs", self.max_num_seqs),
                        ("--max-num-batched-tokens", self.max_num_batched_tokens),
                        ("--cpu-threads", self.cpu_threads),
                        ("--tensor-parallel-size", self.tensor_parallel_size)):
            if n is not None and n < 1:
                raise ValueError(f"{flag} must be at least 1")
        check_here_and_wait("tensor-parallel", "ranks", self.tensor_parallel_local_ranks,
                             self.tensor_parallel_size, self.tensor_parallel_timeout)
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got "
                             f"{self.data_parallel_size}")
        if self.data_parallel_size > 1 and self.topology != "engine":
            raise ValueError(f"--data-parallel-size > 1 needs --topology engine (each replica "
                             f"is an engine process), got --topology {self.topology}")
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError("--data-parallel-size and --tensor-parallel-size cannot both be "
                             "above 1 yet")
        check_here_and_wait("data-parallel", "replicas", self.data_parallel_local_replicas,
                             self.data_parallel_size, self.data_parallel_timeout)
        if self.on_engine_death not in ("exit", "stay"):
            raise ValueError("--on-engine-death must be exit or stay")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must be at least 2")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"--topology must be one of {', '.join(TOPOLOGIES)}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("--scheduling-policy must be fcfs or priority")
        if self.model_impl not in ("auto", "native", "transformers"):
            raise ValueError("--model-impl must be auto, native or transformers")
        if self.attention_backend not in ("auto", "torch", "cpu", "cuda"):
            raise ValueError("--attention-backend must be auto, torch, cpu or cuda")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"--cuda-graphs needs --device cuda, got --device {self.device}")
        for flag, v in (("--max-pending-bytes-per-request", self.max_pending_bytes_per_request),
                        ("--max-pending-bytes", self.max_pending_bytes),
                        ("--stream-timeout", self.stream_timeout)):
            if v is not None and not v > 0:
                raise ValueError(f"{flag} must be positive, got {v}")

    @property
    def overlap(self) -> bool:
        """Whether the Scheduler keeps two steps in flight (``async_scheduling`` resolved)."""
        if self.async_scheduling is not None or self.device.startswith("cuda"):
            return self.async_scheduling is not False
        # The CPU: only where it measured faster (docs/architecture.md, "Where overlap is
        # on"): one rank, in `single` and `engine`.
        return self.tensor_parallel_size == 1 and self.topology in ("single", "engine")

    @property
    def worker_beside_http(self) -> bool:
        """Whether the one-rank Worker shares its process with the event loop that serves
        HTTP (`single` under `serve`): on the CPU it leaves that loop a core (worker_threads)."""
        return self.serving_http and self.topology == "single" \
            and self.tensor_parallel_size == 1

    @property
    def local_replicas(self) -> int:
        """How many data-parallel replicas run on this host (the rest join from others)."""
        if self.data_parallel_local_replicas is None:
            return self.data_parallel_size
        return self.data_parallel_local_replicas

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed (checked when the config was made)."""
        return SpeculativeConfig.parse(self.speculative_config)

    def as_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


@attrs.frozen
class ModelInfo:
    """The facts about a checkpoint every actor shares, read once, without torch.

    One object, computed by :func:`read_model_info` and handed to the Tokenizer, the
    Worker, the CLI, the server and the replay tool, so that no two of them can disagree
    about the context limit or the end-of-sequence ids.
    """

    path: str
    vocab_size: int
    max_model_len: int  # the context this engine serves (see model_context_limit)
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict[str, object]  # generation_config.json as written
    # What a request leaves out, the model supplies (sampling_defaults below).
    sampling_defaults: dict[str, object] = attrs.field(factory=dict)


# Request fields a model's generation_config.json may supply when a request leaves them
# out (vLLM's list, with HF's name for the length), as {field: generation_config key}.
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_new_tokens",
}


def sampling_defaults(generation_config: Mapping[str, object]) -> dict[str, object]:
    """The defaults a model asks for, as request fields; the CLI and HTTP both use this.

    Only keys the file sets appear. ``do_sample: false`` means greedy in transformers, so
    it becomes ``temperature: 0`` (an explicit temperature in a request still wins).
    """
    out = {field: generation_config[key] for field, key in _GENERATION_KEYS.items()
           if generation_config.get(key) is not None}
    if generation_config.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def model_context_limit(text_config: Mapping[str, object]) -> int:
    """The longest context the model serves by default: its ``max_position_embeddings``.

    A sliding window does not shorten it: the attention ops apply the window themselves
    (the torch reference, the CPU decode kernel and the CUDA kernels all take
    ``sliding_window``), so a windowed model serves every position it has, each query
    seeing its last ``sliding_window`` keys, as transformers computes it.
    """
    return int(text_config.get("max_position_embeddings", 2048))  # type: ignore[call-overload]


def eos_ids(generation_config: Mapping[str, object],
            text_config: Mapping[str, object]) -> tuple[int, ...]:
    """End-of-sequence ids as transformers' ``generate`` uses them.

    generation_config.json's ``eos_token_id`` when it sets one, else config.json's: the
    file replaces the model's value rather than adding to it.
    """
    eos = generation_config.get("eos_token_id")
    if eos is None:
        eos = text_config.get("eos_token_id")
    values = eos if isinstance(eos, list | tuple) else ([] if eos is None else [eos])
    return tuple(dict.fromkeys(int(e) for e in values))  # type: ignore[call-overload]


def _read_json(file: Path) -> dict[str, object]:
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: not a JSON object")
    return data


def read_config_json(model_dir: str | Path) -> dict[str, object]:
    """``model_dir/config.json`` as a dict; a one-line ValueError if the directory or the
    file is missing or is not a JSON object. The one reader of that file: the model loader
    (:func:`actorllm.model.loader.load_config`) and :func:`read_model_info` both use it."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist or is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    return _read_json(config_file)


def tensor_parallel_problem(size: int, heads: int, kv_heads: int,
                            intermediate: int) -> str | None:
    """Why a model with these shapes cannot be split over ``size`` ranks (None: it can)."""
    if size < 1:
        return f"--tensor-parallel-size must be at least 1, got {size}"
    if heads % size:
        return f"--tensor-parallel-size {size} does not divide the model's {heads} attention heads"
    if kv_heads % size and size % kv_heads:
        return (f"--tensor-parallel-size {size} and the model's {kv_heads} KV heads: one must "
                "divide the other")
    if intermediate % size:
        return (f"--tensor-parallel-size {size} does not divide the model's intermediate_size "
                f"{intermediate}")
    return None


def check_tensor_parallel_size(model_dir: str | Path, size: int) -> None:
    """The same check as the runner's, from config.json alone (no torch): ValueError."""
    if size == 1:
        return
    cfg = read_config_json(model_dir)
    text_cfg = cfg.get("text_config", cfg)
    assert isinstance(text_cfg, dict)
    try:
        heads = int(text_cfg["num_attention_heads"])
        shapes = (heads, int(text_cfg.get("num_key_value_heads", heads)),
                  int(text_cfg["intermediate_size"]))
    except (KeyError, TypeError, ValueError):
        return  # not a shape this check knows; the runner's loader says what is wrong
    problem = tensor_parallel_problem(size, *shapes)
    if problem is not None:
        raise ValueError(problem)


def read_model_info(model_dir: str | Path, max_model_len: int | None = None) -> ModelInfo:
    """Read config.json and generation_config.json; ValueError with a one-line reason."""
    path = Path(model_dir)
    if not path.is_dir():  # (the CLI's and the server's first check: a short message)
        raise ValueError(f"model directory not found: {path}")
    cfg = read_config_json(path)
    text_cfg = cfg.get("text_config", cfg)
    assert isinstance(text_cfg, dict)
    gen_file = path / "generation_config.json"
    gen = _read_json(gen_file) if gen_file.is_file() else {}
    limit = model_context_limit(text_cfg)
    if max_model_len is not None:
        if max_model_len > limit:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the model's {limit}")
        limit = max_model_len
    if not isinstance(text_cfg.get("vocab_size"), int):
        raise ValueError(f"{path / 'config.json'}: no vocab_size: not a language model's config")
    return ModelInfo(
        path=str(path),
        vocab_size=int(text_cfg["vocab_size"]),  # type: ignore[call-overload]
        max_model_len=limit,
        eos_token_ids=eos_ids(gen, text_cfg),
        generation_defaults=gen,
        sampling_defaults=sampling_defaults(gen),
    )
