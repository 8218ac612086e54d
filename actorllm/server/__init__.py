"""actorllm.server: the OpenAI-compatible HTTP server (``actorllm serve``).

``build_app(engine, served_model_name=...)`` gives the ASGI app for a running engine;
``serve_main(config, args)`` is the whole command (engine + hypercorn on one trio loop).
"""

from actorllm.server.app import build_app
from actorllm.server.main import serve_main

__all__ = ["build_app", "serve_main"]
