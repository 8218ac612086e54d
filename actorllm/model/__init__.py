"""The project's own Llama-family model over the paged KV cache, and its checkpoint loader."""

from actorllm.model.llama import ForwardBatch, KVCache, LlamaForCausalLM
from actorllm.model.loader import load_config, load_model

__all__ = [
    "ForwardBatch",
    "KVCache",
    "LlamaForCausalLM",
    "load_config",
    "load_model",
]
