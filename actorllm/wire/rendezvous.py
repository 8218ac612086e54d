"""Where tensor-parallel ranks meet, on one host or several: torch.distributed's TCPStore.

The driver (rank 0, the Worker's ModelRunner) hosts the group's ``TCPStore``; every
rank, whether the driver started it or another host did (``actorllm rank``), connects
to it with the standard variables ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
``WORLD_SIZE`` and then uses it for four things, each under one key:

- ``spec``: the :class:`~actorllm.worker.ranks.RankSpec` the driver computed (KV blocks,
  dtype, ...), as JSON, so a remote rank needs only the rendezvous and a model path;
- ``joined/R``: a counter each rank bumps on arrival (a second process with the same
  ``RANK`` sees 2 and leaves);
- ``status/R``: ``ready`` once its shard is loaded, or ``failed: REASON``;
- ``heartbeat/R``: a counter the rank bumps every :data:`HEARTBEAT_INTERVAL` from a
  thread. The driver declares the rank dead when the counter has not moved for
  :data:`HEARTBEAT_TIMEOUT` by the driver's own clock (no clock sync needed); the rank
  exits when a bump fails, i.e. when the driver's store is gone (the driver died or
  closed the group) or unreachable for :data:`RANK_STORE_TIMEOUT`.

The keys live under a prefix: :data:`TP` (``actorllm/``) for tensor-parallel ranks,
:data:`DP` (``actorllm/dp/``) for data-parallel replicas on other hosts
(:mod:`actorllm.topology.remote`, which uses the same store helpers with its own keys
beside these).

Which ranks run on this host and how long to wait for the others are the engine's
settings (``EngineConfig.tensor_parallel_local_ranks``/``tensor_parallel_timeout``,
``--tensor-parallel-local-ranks``/``--tensor-parallel-timeout``); where the store
listens is the standard ``MASTER_PORT``.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch.distributed as dist

from actorllm.config import check_here_and_wait

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 300.0  # loading a large shard can take minutes; a failure reports at once
DEFAULT_PORT = 29500  # torchrun's
HEARTBEAT_INTERVAL = 0.25
# A rank whose counter stood still this long is dead to the driver. Generous beside the
# interval: a false alarm kills the engine, and a loaded 2-core box can starve a thread.
HEARTBEAT_TIMEOUT = 3.0
RANK_STORE_TIMEOUT = 30.0  # a rank that cannot reach the driver's store this long leaves

TP = "actorllm/"  # the key prefix of tensor-parallel ranks
DP = "actorllm/dp/"  # the key prefix of data-parallel replicas
SPEC = f"{TP}spec"


def joined_key(rank: int, prefix: str = TP) -> str:
    """Bumped once by each rank on arrival."""
    return f"{prefix}joined/{rank}"


def status_key(rank: int, prefix: str = TP) -> str:
    """A tensor-parallel rank's ``ready``, ``failed: REASON`` or ``stopped`` (it saw the
    driver's stop); a data-parallel replica's ``failed: REASON`` or ``stopped``."""
    return f"{prefix}status/{rank}"


def heartbeat_key(rank: int, prefix: str = TP) -> str:
    """Bumped by the rank every HEARTBEAT_INTERVAL."""
    return f"{prefix}heartbeat/{rank}"


@dataclass(frozen=True)
class Rendezvous:
    """Where the driver's store listens, which ranks it starts itself, how long it waits."""

    addr: str  # how the driver's own ranks reach the store
    port: int  # 0: any free port (every rank on this host)
    local_ranks: int  # ranks 0..local_ranks-1 run on this host; the driver starts 1..
    timeout: float  # for every rank to join and load its shard

    @property
    def remote(self) -> bool:
        """Some ranks join from elsewhere."""
        return self.port != 0

    @classmethod
    def for_driver(cls, world: int, local_ranks: int | None = None,
                   timeout: float = DEFAULT_TIMEOUT,
                   environ: Mapping[str, str] = os.environ) -> Rendezvous:
        """The rendezvous of a driver of ``world`` ranks, ``local_ranks`` of them (None:
        all) on this host (``EngineConfig.tensor_parallel_local_ranks``/``_timeout``); a
        one-line ``ValueError`` if that is impossible.

        All ranks local (the default): a free loopback port; ``MASTER_*`` are ignored, so
        a job that has them set for something else does not collide with it. Some
        remote: the store listens on ``MASTER_PORT`` (default 29500) on every interface.
        """
        check_here_and_wait("tensor-parallel", "ranks", local_ranks, world, timeout)
        local = world if local_ranks is None else local_ranks
        if local == world:
            return cls("127.0.0.1", 0, local, timeout)
        return cls("127.0.0.1", master_port(environ), local, timeout)

    def where(self, store_port: int) -> str:
        """``MASTER_ADDR:PORT`` as a remote rank should be told it (for messages)."""
        return f"{os.environ.get('MASTER_ADDR', '<this host>')}:{store_port}"


def master_port(environ: Mapping[str, str] = os.environ) -> int:
    """Where a driver with ranks (or replicas) on other hosts listens: ``MASTER_PORT``,
    default 29500; a one-line ``ValueError`` if it is not an integer."""
    return _int(environ, "MASTER_PORT", DEFAULT_PORT, "MASTER_PORT")


def _int(environ: Mapping[str, str], name: str, default: int, flag: str) -> int:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{flag} must be an integer, got {raw!r}") from None


def rank_env(zero: str = "rank 0 is the driver, `actorllm serve`"
             ) -> tuple[str, int, int, int]:
    """A rank's ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``; a one-line
    ``ValueError`` naming what is missing or wrong (``zero``: who rank 0 is)."""
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
               if not os.environ.get(v)]
    if missing:
        raise ValueError(f"set {', '.join(missing)} (torch.distributed's rendezvous: "
                         "where the driver listens, this rank, how many ranks)")
    try:
        port, rank, world = (int(os.environ[v]) for v in ("MASTER_PORT", "RANK", "WORLD_SIZE"))
    except ValueError:
        raise ValueError("MASTER_PORT, RANK and WORLD_SIZE must be integers") from None
    if not 1 <= rank < world:
        raise ValueError(f"RANK must be in [1, WORLD_SIZE-1] ({zero}), "
                         f"got RANK={rank} WORLD_SIZE={world}")
    return os.environ["MASTER_ADDR"], port, rank, world


def driver_store(rdv: Rendezvous, who: str = "tensor-parallel ranks") -> dist.TCPStore:
    """The group's store, hosted by this process (the server listens on every interface);
    ``who`` joins it (for the message when the port is taken)."""
    try:
        return dist.TCPStore(rdv.addr, rdv.port, None, True,
                             datetime.timedelta(seconds=rdv.timeout), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise ValueError(f"cannot listen for {who} on port {rdv.port}: "
                         f"{str(exc).splitlines()[0]}") from None


def rank_store(addr: str, port: int, timeout: float,
               who: str = "tensor-parallel driver") -> dist.TCPStore:
    """Connect to the driver's store, retrying until ``timeout`` (the driver may start
    later); a one-line ``ValueError`` when it never answers (naming ``who``)."""
    try:
        store = dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=timeout))
    except (RuntimeError, OSError):
        raise ValueError(f"no {who} answered at {addr}:{port} within "
                         f"{timeout:g} s") from None
    return store


def status(store: dist.TCPStore, rank: int, prefix: str = TP) -> str | None:
    """Rank ``rank``'s status, None before it has one."""
    key = status_key(rank, prefix)
    return store.get(key).decode() if store.check([key]) else None


def start_heartbeat(store: dist.TCPStore, rank: int, on_lost: Callable[[str], None],
                    prefix: str = TP) -> None:
    """Rank side: bump ``heartbeat/RANK`` every HEARTBEAT_INTERVAL from a daemon thread;
    call ``on_lost(why)`` (which should exit) when the driver's store is gone."""
    store.set_timeout(datetime.timedelta(seconds=RANK_STORE_TIMEOUT))

    def beat() -> None:
        while True:
            try:
                store.add(heartbeat_key(rank, prefix), 1)
            except Exception as exc:  # the store's server went away: the driver did
                on_lost(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                return
            time.sleep(HEARTBEAT_INTERVAL)

    threading.Thread(target=beat, name=f"heartbeat-{rank}", daemon=True).start()


class HeartbeatMonitor:
    """Driver side: which rank's heartbeat has stood still for HEARTBEAT_TIMEOUT."""

    def __init__(self, store: dist.TCPStore, ranks: Iterable[int], prefix: str = TP) -> None:
        self.store = store
        self.prefix = prefix
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in ranks}  # rank -> (counter, when it last moved)
        self._checked = 0.0

    def touch(self, rank: int) -> None:
        """Start ``rank``'s clock now (it has just been seen to join)."""
        self._seen[rank] = (self._seen[rank][0], time.monotonic())

    def stale(self, among: Iterable[int] | None = None) -> int | None:
        """The first rank (of ``among``, default all) whose heartbeat is overdue, else
        None. Reads the store at most every HEARTBEAT_INTERVAL; each read is a local
        round trip. A rank is overdue HEARTBEAT_TIMEOUT after the monitor was made, it
        was touched, or its counter last moved, whichever is last."""
        now = time.monotonic()
        if now - self._checked >= HEARTBEAT_INTERVAL:
            self._checked = now
            for rank, (count, _) in self._seen.items():
                latest = self.store.add(heartbeat_key(rank, self.prefix), 0)
                if latest != count:
                    self._seen[rank] = (latest, now)
        for rank in self._seen if among is None else among:
            if now - self._seen[rank][1] > HEARTBEAT_TIMEOUT:
                return rank
        return None
