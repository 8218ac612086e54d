"""The models over the paged KV cache (the native Llama family, or any transformers causal
LM through :mod:`actorllm.model.hf_backend`), and the checkpoint loader that picks one."""

from actorllm.model.llama import ForwardBatch, KVCache, LlamaForCausalLM
from actorllm.model.loader import MODEL_IMPLS, load_config, load_model, model_impl_of

__all__ = [
    "MODEL_IMPLS",
    "ForwardBatch",
    "KVCache",
    "LlamaForCausalLM",
    "load_config",
    "load_model",
    "model_impl_of",
]
