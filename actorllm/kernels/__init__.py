"""CUDA sources for actorllm.ops, shipped as package data (see pyproject.toml)."""
