"""The routes, one module per endpoint family; each holds an ``APIRouter`` named ``router``.

A handler is a plain function of the request; it finds the shared
:class:`~actorllm.server.state.ServerState` with ``state_of(request)``. To add a family,
write a module with a ``router`` and list it in ``app.ROUTERS``.
"""
