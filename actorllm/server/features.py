"""Server settings of the issue-31 features, handed to ``build_app`` as one object.

Kept apart from ``ServerState`` so the features (reasoning, the Responses API's store,
embeddings) add no fields to it: the routes of those features read this instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from actorllm.server.reasoning import REASONING_PARSERS, ReasoningParser

POOLINGS = ("last", "mean", "cls")
# A sentence-transformers Pooling module's modes, by the name --pooling gives them.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls", "lasttoken": "last", "mean": "mean", "cls": "cls"}


@attrs.frozen
class ModelPooling:
    """What a model's sentence-transformers config says: its pooling modes (as
    ``--pooling`` names those it shares, the others by their own names) and whether it
    ends with a ``Normalize`` module."""

    modes: tuple[str, ...]
    normalize: bool


def sentence_transformers_pooling(model_dir: str | Path) -> ModelPooling | None:
    """The pooling of a model laid out for sentence-transformers (``modules.json`` and its
    ``Pooling`` module's ``config.json``); None where there is no ``modules.json``."""
    root = Path(model_dir)
    try:
        modules = json.loads((root / "modules.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{root / 'modules.json'}: {exc}") from None
    types = [(str(m.get("type", "")), str(m.get("path", ""))) for m in modules
             if isinstance(m, dict)] if isinstance(modules, list) else []
    normalize = any(t.endswith(".Normalize") for t, _ in types)
    modes: tuple[str, ...] = ()
    for kind, path in types:
        if kind.endswith(".Pooling"):
            file = root / path / "config.json"
            try:
                config = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ValueError(f"{file}: {exc}") from None
            given = config.get("pooling_mode")  # newer files name the mode in one key
            modes = ((str(given),) if isinstance(given, str) else
                     tuple(k for k, v in config.items() if k.startswith("pooling_mode_") and v))
            modes = tuple(_ST_MODES.get(m, m) for m in modes)
    return ModelPooling(modes, normalize)


@attrs.define
class Features:
    """``reasoning``: the ``--reasoning-parser`` (None: off); the Responses store's limits
    (``--responses-store-size`` responses, each kept ``--responses-store-ttl`` seconds);
    ``pooling``: how ``/v1/embeddings`` pools the final hidden states, and ``normalize``
    whether it scales them to unit length; ``tokenizer_info``: whether ``GET
    /tokenizer_info`` is served (``--enable-tokenizer-info-endpoint``)."""

    reasoning: ReasoningParser | None = None
    store_size: int = 1000
    store_ttl: float = 3600.0
    pooling: str = "last"
    normalize: bool = True
    tokenizer_info: bool = False

    @classmethod
    def build(cls, *, reasoning_parser: str | None = None, store_size: int = 1000,
              store_ttl: float = 3600.0, pooling: str | None = None,
              model_pooling: ModelPooling | None = None,
              tokenizer_info: bool = False) -> Features:
        """Check the names and limits; ValueError for an unknown one. The pooling is
        ``pooling`` (``--pooling``), else the model's sentence-transformers config, else
        the last token; vectors are normalized unless that config has no ``Normalize``."""
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}")
        if pooling is None and model_pooling is not None and model_pooling.modes:
            if len(model_pooling.modes) != 1 or model_pooling.modes[0] not in POOLINGS:
                raise ValueError(f"the model's sentence-transformers pooling "
                                 f"({', '.join(model_pooling.modes)}) is not supported: "
                                 f"choose --pooling {'|'.join(POOLINGS)}")
            pooling = model_pooling.modes[0]
        pooling = pooling or "last"
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}")
        if store_size < 0 or store_ttl <= 0:
            raise ValueError("the responses store needs a size >= 0 and a ttl > 0")
        parser = None if reasoning_parser is None else REASONING_PARSERS[reasoning_parser]
        normalize = model_pooling is None or model_pooling.normalize
        return cls(parser, store_size, store_ttl, pooling, normalize, tokenizer_info)
