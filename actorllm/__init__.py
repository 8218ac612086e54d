"""actorllm: an LLM inference server whose request lifecycle is explicit.

The public names below are imported lazily so that ``actorllm --help`` does not
pay for torch and transformers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from actorllm.cpus import openmp_defaults
from actorllm.wire.messages import SamplingParams, StructuredOutput

# Here, before anything of ours imports torch (libgomp reads its spin once, when it
# loads): every entry point passes through this file, the CLI, ``LLM`` and the engine's
# child and rank processes, which also inherit the variable (actorllm/cpus.py).
openmp_defaults(os.environ)

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "SamplingParams", "StructuredOutput",
           "open_engine"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from actorllm.config import EngineConfig
    from actorllm.engine.async_engine import AsyncEngine, open_engine
    from actorllm.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from actorllm.llm import LLM

        return LLM
    if name in ("AsyncEngine", "open_engine"):
        from actorllm.engine import async_engine as engine

        return getattr(engine, name)
    if name == "EngineConfig":
        from actorllm.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
