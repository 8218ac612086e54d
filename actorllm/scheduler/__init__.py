"""The Scheduler actor and what only it owns: sequences, the KV block pool, the
waiting order and flow control of paused sequences.

actor.py (the actor: messages, finishes, steps in flight and their results) owns a
batch.py ``Batch`` (who runs, waits or is paused, and the block pool), which owns a
flow.py ``Pacer`` (pauses); outgoing.py holds what waits to go to the Detokenizer.
"""
