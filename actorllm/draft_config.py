"""The ``draft_model`` speculative method's checks, from config.json alone (no torch).

Shared ground beside :mod:`actorllm.config`, which calls them when an ``EngineConfig`` is
made: so the CLI, the server and ``LLM`` refuse a draft they cannot run in one line,
before any weights load (the Worker's loader, ``worker/draft.py``, checks the same
again on what it loads). docs/architecture.md, "Speculative decoding".
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from actorllm.hub import hub_cache_dir, hub_offline, resolve_model

_COMMON = frozenset({"method", "num_speculative_tokens", "disable_by_batch_size",
                     "max_draft_tokens_per_step"})
#: The keys each method takes.
METHOD_KEYS: dict[str, frozenset[str]] = {
    "ngram": _COMMON | {"prompt_lookup_max", "prompt_lookup_min"},
    "draft_model": _COMMON | {"model", "revision"},
}
#: The keys that are not positive integers (checked by their own code).
TEXT_KEYS = frozenset({"method", "model", "revision"})


def draft_dir(raw: Mapping[str, object]) -> str:
    """The ``model`` of a draft_model config as a directory with a config.json: a
    directory as it is, a hub id (at ``revision``, vLLM's key) through the hub cache as
    ``--model`` is (``hub.resolve_model``: ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE``)."""
    model, revision = raw.get("model"), raw.get("revision")
    if not isinstance(model, str) or not model:
        raise ValueError("--speculative-config: draft_model needs \"model\": a directory "
                         "or a hub id")
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise ValueError(f"--speculative-config: revision must be a non-empty string, got "
                         f"{revision!r}")
    if revision is not None and Path(model).expanduser().is_dir():
        raise ValueError(f"--speculative-config: revision applies to a hub id, and "
                         f"{model!r} is a directory")
    try:
        path = _resolve(model, revision, str(hub_cache_dir()), hub_offline())
    except ValueError as exc:
        raise ValueError(f"--speculative-config: draft {exc}") from None
    _text_config(path)
    return path


@functools.lru_cache(maxsize=16)
def _resolve(model: str, revision: str | None, cache: str, offline: bool) -> str:
    # The config is parsed again by each actor that needs it: online, one look-up each
    # would ask the hub again for the same snapshot. ``cache`` and ``offline`` are in the
    # key only so that a changed environment is looked up afresh.
    del cache, offline
    return resolve_model(model, revision)


def check_draft_model(draft: str, target: str, tensor_parallel_size: int) -> None:
    """ValueError (one line) for a draft the Worker cannot run beside ``target``: another
    vocabulary size, or tensor parallelism (the draft is not sharded)."""
    if tensor_parallel_size > 1:
        raise ValueError("--speculative-config: draft_model does not run with "
                         "--tensor-parallel-size > 1")
    if not (Path(target) / "config.json").is_file():
        return  # the target's own check names what is missing
    want = _text_config(target, "model").get("vocab_size")
    got = _text_config(draft).get("vocab_size")
    if want != got:
        raise ValueError(f"--speculative-config: the draft model's vocab_size {got} is not "
                         f"the model's {want}")


def _text_config(model_dir: str, what: str = "draft model") -> Mapping[str, object]:
    file = Path(model_dir) / "config.json"
    if not file.is_file():
        raise ValueError(f"--speculative-config: {what} directory {model_dir!r} does not "
                         "exist or has no config.json")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--speculative-config: cannot read {file}: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--speculative-config: {file} is not a JSON object")
    text = cfg.get("text_config", cfg)
    return text if isinstance(text, dict) else cfg


def check_runner_draft(draft: Any, spec: Any) -> None:
    """Refuse a model runner built for another draft than ``spec`` (a
    ``config.SpeculativeConfig`` or None) asks for; ``draft``: the runner's
    ``worker.draft.DraftModel`` or None. ``Resources`` outlive an engine run: reused with
    a draft_model config, a runner without a draft would leave every draft a
    placeholder, all rejected (exact output, no speculation) without a word."""
    wanted = spec.model if spec is not None and spec.method == "draft_model" else None
    built = draft.model_dir if draft is not None else None
    if wanted != built:
        raise ValueError(f"--speculative-config: the model runner was built with draft "
                         f"model {built!r}, not {wanted!r}: make new Resources for it")
