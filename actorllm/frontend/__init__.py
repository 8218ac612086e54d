"""The Frontend actor and what only it owns: the request registry (actor.py, state.py),
the output collectors (collector.py), reader pacing (readers.py) and the choice of a
data-parallel replica (routing.py). What a request gives back is shared ground:
``actorllm/wire/outputs.py``.
"""
