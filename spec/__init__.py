"""The request lifecycle spec, shipped as package data (see pyproject.toml)."""
