"""Topologies: which actor runs in which process, the child processes, and their supervisor.

Three placements of the same five actors (``--topology``):

    single    main: Frontend Tokenizer Scheduler Worker Detokenizer
    engine    main: Frontend Tokenizer Detokenizer | engine: Scheduler Worker       (vLLM-like)
    pipeline  main: Frontend Tokenizer | engine: Scheduler Worker | detokenizer: Detokenizer
                                                                                (SGLang-like)

"main" is the process that called :func:`actorllm.engine.async_engine.open_engine` (the API
process); the others are children it starts with ``python -m actorllm.topology``.

Start-up. The parent binds its sockets, spawns each child (``subprocess``; the
config travels as JSON, never pickle) and waits. A child binds its sockets, sends
``Hello``; the parent checks it and answers with its own ``Hello``, which the child
checks in turn (protocol, codec version and message-schema fingerprint: a mismatch
is refused on both sides with an error naming the difference). Then the child
loads what it needs (the engine child: the model and KV cache; the detokenizer
child: the tokenizer the parent wrote as ``tokenizer.json``), starts its actors and
sends ``Ready``, or ``StartFailed`` with the reason and exits 1. The parent raises
:class:`EngineStartError` with that reason, or with the exit code of a child that
died without one, or after ``READY_TIMEOUT``.

The modules, in import order (each imports only those before it):

- :mod:`~actorllm.topology.placement`: the placements, the mailboxes of one process
  (:class:`~actorllm.topology.placement.Wiring`) and the actors built on them. Every
  process uses it, ``single`` included.
- :mod:`~actorllm.topology.child`: a child process: its command line, entry point and
  control loop, and the constants of the control protocol both sides share.
- :mod:`~actorllm.topology.remote`: data-parallel replicas on other hosts (``actorllm
  replica``) and the main host's side of their rendezvous; imports torch.distributed,
  so the Supervisor imports it only when some replicas are remote.
- :mod:`~actorllm.topology.children`: the parent's record of each child process, and
  how it spawns and stops them.
- :mod:`~actorllm.topology.supervisor`: the parent's side: when to start, watch and
  stop the children.
"""

from actorllm.topology.placement import EDGES, MAIN, PLACEMENTS, Wiring, child_roles
from actorllm.topology.supervisor import EngineStartError, Supervisor

__all__ = ["EDGES", "MAIN", "PLACEMENTS", "EngineStartError", "Supervisor", "Wiring",
           "child_roles"]
