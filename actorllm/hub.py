"""``--model ORG/NAME``: a Hugging Face Hub id resolved to a directory, as transformers does.

A directory that exists wins. Otherwise a name shaped like a hub id goes through
``huggingface_hub.snapshot_download`` and its cache, which honours ``HF_HOME`` /
``HF_HUB_CACHE``, ``HF_TOKEN`` (and a stored login) and ``HF_HUB_OFFLINE``. Both are read
when called, not when ``huggingface_hub`` was imported, so that a caller (a test, an
embedding program) may set them late. Offline, an id already in the cache loads and one
that is not gives one line naming the id and the cache it looked in. No torch here: the
CLI's main process resolves the name before deciding where the model runs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What an engine reads from a snapshot: configs, weights, tokenizer files, chat templates.
_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_cache_dir() -> Path:
    """The hub cache in use: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for the cache only (as huggingface_hub reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_model(model: str, revision: str | None = None) -> str:
    """A local directory for ``model`` (a directory, or a hub id at ``revision``).

    A name not shaped like a hub id comes back as it is (a missing directory is reported
    where directories are read). Raises a one-line ``ValueError`` for a hub id that cannot
    be fetched (or, offline, found in the cache).
    """
    if Path(model).expanduser().is_dir():
        if revision is not None:
            raise ValueError(f"--revision applies to a hub id, and {model!r} is a directory")
        return str(Path(model).expanduser())
    if not _HUB_ID.match(model):
        return model  # a path: read_model_info says it is missing, as for any directory
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache, offline = hub_cache_dir(), hub_offline()
    where = f"{model}@{revision}" if revision else model
    try:
        return snapshot_download(model, revision=revision, cache_dir=str(cache),
                                 local_files_only=offline, allow_patterns=_PATTERNS)
    except LocalEntryNotFoundError:
        reason = "offline (HF_HUB_OFFLINE)" if offline else "the hub is unreachable"
        raise ValueError(f"model {where!r} is not in the hub cache {cache} and {reason}") \
            from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"model {where!r}: cannot fetch from the hub (cache {cache}): "
                         f"{first}") from None
