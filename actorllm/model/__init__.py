"""The project's own Llama-family model over the paged KV cache, and its checkpoint loader."""

from actorllm.model.llama import ForwardBatch, KVCache, LlamaForCausalLM
from actorllm.model.loader import eos_token_ids, load_config, load_model, max_model_len

__all__ = [
    "ForwardBatch",
    "KVCache",
    "LlamaForCausalLM",
    "eos_token_ids",
    "load_config",
    "load_model",
    "max_model_len",
]
