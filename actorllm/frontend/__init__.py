"""The Frontend actor and what only it owns: the request registry, the output
collectors, reader pacing and the choice of a data-parallel replica.
"""
