"""``serve`` flags of the API features (reasoning, chat template, Responses store,
embeddings), apart from ``cli.py`` to keep it small; stdlib only, as ``--help`` must not
import torch. ``server/features.py`` checks the values these give.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_feature_flags(p: argparse.ArgumentParser) -> None:
    """Reasoning models, the chat template, the Responses API's store, embeddings."""
    p.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3"], default=None,
                   help="split <think>...</think> reasoning into reasoning_content")
    p.add_argument("--chat-template", type=Path, default=None,
                   help="a Jinja chat template file to use instead of the model's")
    p.add_argument("--responses-store-size", type=int, default=1000,
                   help="responses kept for previous_response_id (oldest dropped first)")
    p.add_argument("--responses-store-ttl", type=float, default=3600.0,
                   help="seconds a stored response is kept")
    p.add_argument("--pooling", choices=["last", "mean"], default="last",
                   help="/v1/embeddings: the last token's or the mean final hidden state")
