"""Loading a checkpoint's Hugging Face tokenizer: the Tokenizer, the Worker's grammars and
the Detokenizer each load their own copy from the same directory."""

from __future__ import annotations

import os
from typing import Any


def serial_tokenizers() -> None:
    """Keep the tokenizers library's batch calls on the calling thread, unless the user
    said otherwise (``TOKENIZERS_PARALLELISM``, read by the library at each call).

    By default it spreads a batch over a thread per core, and the Detokenizer decodes a
    step's rows in one batch while the forward pass runs on those cores: a 255-row decode
    took ~460 us of CPU spread that way against ~280 us on one thread, no sooner (near-
    zero model offline, in-process A/B over six pairs: 52.7k -> 54.9k output tok/s,
    means). On one thread the call still lets go of the GIL, so the step thread's Python
    runs meanwhile."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_hf_tokenizer(model_dir: str) -> Any:
    """The model's Hugging Face tokenizer, offline (see :func:`serial_tokenizers`).
    ValueError with a one-line reason."""
    from transformers import AutoTokenizer  # slow import: only where needed

    serial_tokenizers()
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a bad directory
        # Its messages run over several lines; the CLI prints one.
        reason = " ".join(str(exc).split())
        raise ValueError(f"cannot load a tokenizer from {model_dir}: {reason}") from None
