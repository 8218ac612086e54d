"""The request state machine: the table from ``spec/lifecycle.toml``, the fold and
checker over a history, and the trace every transition is written to. Shared ground.
"""
