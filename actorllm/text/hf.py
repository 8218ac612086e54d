"""Loading a checkpoint's Hugging Face tokenizer: the Tokenizer, the Worker's grammars and
the Detokenizer each load their own copy from the same directory."""

from __future__ import annotations

from typing import Any


def load_hf_tokenizer(model_dir: str) -> Any:
    """The model's Hugging Face tokenizer, offline. ValueError with a one-line reason."""
    from transformers import AutoTokenizer  # slow import: only where needed

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a bad directory
        # Its messages run over several lines; the CLI prints one.
        reason = " ".join(str(exc).split())
        raise ValueError(f"cannot load a tokenizer from {model_dir}: {reason}") from None
