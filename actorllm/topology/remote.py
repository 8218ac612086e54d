"""Data-parallel replicas on other hosts: the rendezvous, on the main host and on theirs.

``--data-parallel-local-replicas K`` (of N): the main host starts replicas 0..K-1 as
children, as always; replicas K..N-1 are started by hand on other hosts with
``actorllm replica`` and torch.distributed's variables (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK`` = the replica, ``WORLD_SIZE`` = N). A remote replica runs the
very code of a local one (:func:`actorllm.topology.child.run_child`, role
``engine{RANK}``: Scheduler + Worker, the same control protocol and handshake) with TCP
endpoints instead of ``ipc://`` ones.

Who binds. Every inbox binds, as on one host: the main host's Detokenizer inbox and
control inbox listen on ``tcp://0.0.0.0:<any port>`` as well as on their ``ipc://``
paths (one PULL socket, several endpoints), and a replica binds its Scheduler and
control inboxes on any TCP port. Each sender connects one PUSH socket per edge, so
each edge stays one FIFO pipe. The main host's outboxes to a remote replica are made
unconnected (``Wiring.deferred``) and connected when it says where it listens.

The rendezvous is torch.distributed's ``TCPStore`` (:mod:`actorllm.wire.rendezvous`, keys
under ``actorllm/dp/``), hosted by the main host on ``MASTER_PORT``:

- ``config``: the main host's ``EngineConfig`` as JSON (the replica may override the
  model path and its threads); ``main``: ``{socket name: endpoint}`` of its TCP inboxes,
  with ``0.0.0.0`` for the host (the replica puts ``MASTER_ADDR`` there);
- ``joined/R`` (a second process with the same RANK is refused), ``heartbeat/R``
  (bumped by a thread, also while loading), ``status/R`` (``failed: REASON`` before it
  has a control channel, ``stopped`` when it obeys a Shutdown);
- ``endpoints/R``: the replica's inboxes, ``{"scheduler1.sock": ..., "engine1.ctl":
  ..., "host": ...}``, at the address of its route to the store. Then it sends its Hello.

Death. There is no process handle to watch. The Supervisor declares a ready remote
replica dead when its control heartbeats stop for ``REMOTE_TIMEOUT`` (3 s,
:mod:`actorllm.topology.child`), and one still loading when its store heartbeat stops;
then it is handled like a local replica's exit. A replica leaves when the store is gone
(the main host died) or its parent's heartbeats stop, with code 4, and with 0 after a
Shutdown.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from typing import Any

import attrs

from actorllm.config import EngineConfig
from actorllm.cpus import usable_cpus
from actorllm.topology.child import EXIT_ORPHANED, PARENT_CTL, run_child
from actorllm.topology.placement import REPLICATED, Wiring
from actorllm.wire.rendezvous import (
    DP,
    SPEC,
    HeartbeatMonitor,
    Rendezvous,
    driver_store,
    joined_key,
    master_port,
    rank_env,
    rank_store,
    start_heartbeat,
    status,
    status_key,
)
from actorllm.wire.transport import IpcDir, ZmqInbox

log = logging.getLogger(__name__)

ANY = "tcp://0.0.0.0:0"
CONFIG = f"{DP}config"
MAIN_ENDPOINTS = f"{DP}main"
HOST = "host"  # in a replica's endpoints: its name, for messages


def endpoints_key(rank: int) -> str:
    """Where replica ``rank`` listens, as JSON."""
    return f"{DP}endpoints/{rank}"


def _public(endpoint: str, addr: str) -> str:
    """``tcp://0.0.0.0:PORT`` as a peer reaches it: ``tcp://ADDR:PORT``."""
    return f"tcp://{addr}:{endpoint.rsplit(':', 1)[1]}"


# --- the main host's side ------------------------------------------------------------------


class RemoteReplicas:
    """The main host's store and what each remote replica has said in it.

    Made by the Supervisor when some replicas are remote; binds the main host's TCP
    endpoints (``wiring``'s remote inboxes and the control inbox ``ctl``) and publishes
    them with the config. Every read is a round trip to this process's own store.
    """

    def __init__(self, config: EngineConfig, wiring: Wiring, ctl: ZmqInbox[Any]) -> None:
        self.world = config.data_parallel_size
        self.ranks = range(config.local_replicas, self.world)
        self.wiring = wiring
        rdv = Rendezvous("127.0.0.1", master_port(), config.local_replicas,
                         config.data_parallel_timeout)
        self.store: Any = driver_store(rdv, "data-parallel replicas")
        self.where = rdv.where(self.store.port)
        mine = {PARENT_CTL: ctl.bind(ANY)}
        for inbox in wiring.remote_inboxes:
            mine[inbox.endpoint.rsplit("/", 1)[1]] = inbox.bind(ANY)
        self.store.set(MAIN_ENDPOINTS, json.dumps(mine))
        self.store.set(CONFIG, json.dumps(config.as_dict()))
        self.monitor: Any = HeartbeatMonitor(self.store, self.ranks, DP)
        self.hosts: dict[int, str] = {}
        self.ctl: dict[int, str] = {}  # each joined replica's control inbox
        log.warning("waiting for data-parallel replicas %d..%d at %s (actorllm replica)",
                    self.ranks.start, self.world - 1, self.where)

    def joined(self, rank: int) -> bool:
        """Whether replica ``rank`` has published its endpoints (its Hello follows);
        the first time, connect the data outboxes to it and note its control inbox."""
        if rank in self.hosts:
            return True
        if not self.store.check([endpoints_key(rank)]):
            return False
        endpoints: dict[str, str] = json.loads(self.store.get(endpoints_key(rank)))
        self.hosts[rank] = endpoints.pop(HOST, "?")
        self.ctl[rank] = endpoints[f"{REPLICATED}{rank}.ctl"]
        self.monitor.touch(rank)
        self.wiring.connect_remote(endpoints)
        log.info("%s joined", self.name(rank))
        return True

    def name(self, rank: int) -> str:
        """``engine1 (remote, on HOST)``: how messages name it."""
        return f"{REPLICATED}{rank} (remote, on {self.hosts.get(rank, '?')})"

    def failed(self, rank: int) -> str | None:
        """Why replica ``rank`` refused to start before it had a control channel."""
        said = status(self.store, rank, DP)
        if said is not None and said.startswith("failed: "):
            return f"data-parallel replica {rank} failed to start: {said[8:]}"
        return None

    def stale(self, rank: int) -> bool:
        """Its store heartbeat has stood still (see HeartbeatMonitor)."""
        return self.monitor.stale([rank]) == rank

    def stopped(self, rank: int) -> bool:
        """It has obeyed a Shutdown."""
        return status(self.store, rank, DP) == "stopped"

    def missing(self, rank: int, timeout: float) -> str:
        """The start-up error for replica ``rank`` not ready after ``timeout``."""
        if rank in self.hosts:
            return f"{self.name(rank)} process not ready after {timeout:g} s"
        return (f"data-parallel replica {rank} did not join the rendezvous at {self.where} "
                f"within {timeout:g} s (start `actorllm replica` with RANK={rank} "
                f"WORLD_SIZE={self.world} on its host)")

    def close(self) -> None:
        """Stop the store's server (a replica still there sees its heartbeat fail)."""
        self.monitor = None
        self.store = None  # the last reference: the server stops


# --- a remote replica's side ----------------------------------------------------------------


class RemoteEndpoints(IpcDir):
    """A remote replica's endpoints: any TCP port for what it binds, the main host's
    published endpoints for what it connects to. No directory."""

    def __init__(self, main: dict[str, str]) -> None:  # no super(): nothing to create
        self.path = "(tcp)"
        self.owner = False
        self.main = main

    def endpoint(self, name: str) -> str:
        return self.main.get(name, ANY)

    def file(self, name: str) -> str:
        raise ValueError(f"a replica on another host has no {name}")

    def remove(self) -> None:
        pass


@attrs.define
class _Hooks:
    """:class:`~actorllm.topology.child.RemoteHooks` of one remote replica."""

    store: Any
    rank: int
    addr: str  # this host's address on its route to the store
    stopped: bool = False

    def announce(self, ctl: ZmqInbox[Any], wiring: Wiring) -> None:
        mine = {f"{box.name}{self.rank}.sock": _public(box.endpoint, self.addr)
                for box in wiring.remote_inboxes}
        mine[ctl.name] = _public(ctl.endpoint, self.addr)
        mine[HOST] = f"{socket.gethostname()} {self.addr}"
        self.store.set(endpoints_key(self.rank), json.dumps(mine))

    def stopping(self) -> None:
        self.stopped = True  # before the main host can close the store
        self.store.set(status_key(self.rank, DP), "stopped")

    def lost(self, why: str) -> None:
        if self.stopped:
            return  # a clean stop: the main host closed its store
        log.error("the main host is gone (%s); leaving", why)
        logging.shutdown()
        os._exit(EXIT_ORPHANED)


def route_address(addr: str, port: int) -> str:
    """This host's address on the route to ``addr`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, port))
        return str(s.getsockname()[0])


def serve_replica(model: str | None = None, *, timeout: float = 300.0,
                  num_threads: int | None = None) -> int:
    """``actorllm replica``: with torch.distributed's variables in the environment, join
    the main host's store, take its config and endpoints, and run replica ``RANK`` until
    it says Shutdown (0) or is gone (4). ``model`` overrides the main host's path.

    A one-line ``ValueError`` when it cannot join (after telling the main host why,
    once it has joined).
    """
    addr, port, rank, world = rank_env("replica 0 runs on the main host, `actorllm serve`")
    store = rank_store(addr, port, timeout, "data-parallel main host")
    if store.check([SPEC]):
        raise ValueError(f"{addr}:{port} is a tensor-parallel driver (join it with "
                         "`actorllm rank`), not a data-parallel main host")
    if store.add(joined_key(rank, DP), 1) > 1:
        raise ValueError(f"data-parallel replica {rank} has already joined the main host at "
                         f"{addr}:{port}")
    try:
        store.wait([CONFIG, MAIN_ENDPOINTS])
        config = EngineConfig(**json.loads(store.get(CONFIG)))
        local = config.local_replicas
        if world != config.data_parallel_size:
            raise ValueError(f"WORLD_SIZE={world}, but the main host runs "
                             f"{config.data_parallel_size} replicas")
        if rank < local:
            raise ValueError(f"RANK={rank} is a replica the main host runs itself "
                             f"(--data-parallel-local-replicas {local}): give RANK in "
                             f"[{local}, {world - 1}]")
        main = {name: _public(ep, addr)
                for name, ep in json.loads(store.get(MAIN_ENDPOINTS)).items()}
    except ValueError as exc:
        store.set(status_key(rank, DP), f"failed: {exc}")
        raise
    hooks = _Hooks(store, rank, route_address(addr, port))
    start_heartbeat(store, rank, hooks.lost, DP)  # also while loading: the main may die
    # Ctrl-C stops it as SIGTERM does (trio's receiver, exit 0); the main host then sees
    # its heartbeats stop, as for any replica that leaves.
    signal.signal(signal.SIGINT, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    if num_threads is None and config.device == "cpu":
        num_threads = max(1, usable_cpus() - 1)  # one left to its loop
    config = attrs.evolve(config, model=model or config.model, cpu_threads=num_threads,
                          trace=None)  # (a trace is the main host's file)
    log.info("replica %d of %d joined %s:%d", rank, world, addr, port)
    return run_child(f"{REPLICATED}{rank}", config, RemoteEndpoints(main), None, hooks)
