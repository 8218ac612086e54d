"""What an engine is built from that is slow to build and outlives one engine run."""

from __future__ import annotations

from typing import Any

from actorllm.config import EngineConfig, ModelInfo, read_model_info
from actorllm.text.hf import load_hf_tokenizer
from actorllm.topology.placement import build_runner


class Resources:
    """What is slow to build and may outlive one engine run: tokenizer, weights, caches.

    The weights load here only for the ``single`` topology; in the others the
    engine child process loads its own, so this process never imports torch.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.info: ModelInfo = read_model_info(config.model, config.max_model_len)
        self.hf_tokenizer: Any = load_hf_tokenizer(config.model)
        self.runner: Any = build_runner(config, self.info) if config.topology == "single" \
            else None

    def load_runner(self, config: EngineConfig) -> Any:
        """The model runner, built now if these resources were made for another topology."""
        if self.runner is None:
            self.runner = build_runner(config, self.info)
        return self.runner
