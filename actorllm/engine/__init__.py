"""The wiring: the actors' nursery and the handle the API layers hold, and the one
admission gate for new work.
"""
