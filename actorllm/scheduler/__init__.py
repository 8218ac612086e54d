"""The Scheduler actor and what only it owns: sequences, the KV block pool, the
waiting order and flow control of paused sequences.
"""
