"""Tensor-parallel ranks: the driver's side (:class:`RankGroup`) and a rank's process.

With ``--tensor-parallel-size N`` the Worker's :class:`~actorllm.worker.runner.ModelRunner` is
rank 0, the *driver*; ranks 1..N-1 are processes (``actorllm rank``, started by the
driver or on other hosts) that each hold their shard of the weights
(:mod:`actorllm.model.parallel`) and of the KV cache, and do nothing but run the model
forward on what the driver broadcasts. The driver alone keeps sampling state, computes
logits and samples, so seeded sampling is the same as on one rank; the ranks own no
request state at all.

Per step, the driver broadcasts the packed :class:`~actorllm.model.ForwardBatch` over
torch.distributed (a 6-int header, then one int64 tensor holding every field), and all
ranks run the forward, meeting in two all-reduces per layer. The plan does not travel
over the ZeroMQ control channel: the ranks are already in a collective group with the
driver, the broadcast is one copy per rank of a few KB, it is ordered with the
all-reduces that follow it by construction, and a rank then needs no event loop,
no codec and no mailbox, only torch.

Rendezvous (:mod:`actorllm.wire.rendezvous`): the driver hosts the group's TCPStore and
starts ranks 1..K-1 itself (K = ``--tensor-parallel-local-ranks``, default all); ranks
K..N-1 are started on other hosts by ``actorllm rank`` with the standard
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``. Every rank, local or not, runs
the same code: join the store, read the driver's :class:`RankSpec` from it, load its
shard, say ``ready`` (or ``failed: why``), form the group. Backend: gloo on the CPU,
NCCL on CUDA.

No orphans. A local rank's stdin is a pipe from the driver; it exits at once when that
pipe reaches EOF, which happens when the driver closes the group or its process dies in
any way (PR_SET_PDEATHSIG would not do: the driver may start ranks from a worker
thread, and the signal fires when that *thread* exits). Every rank also exits when its
heartbeat to the driver's store fails, or when its collective loses the driver (gloo's
"connection closed"): that is how a remote rank leaves.

Death. :meth:`RankGroup.watch` (run by the Worker actor) raises :class:`RankDied`
within ``WATCH_INTERVAL`` of a local rank exiting, and within ``HEARTBEAT_TIMEOUT`` of
any rank's heartbeat stopping (a remote rank's death, a stopped process, a lost
network); the Worker actor then fails, and the engine is dead as when a child process
dies (``engine_dead``). A step that fails after its broadcast leaves the ranks out of
step with the driver, so it is fatal too.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import trio

from actorllm.exit_codes import describe_exit
from actorllm.model import ForwardBatch, KVCache, LlamaForCausalLM
from actorllm.wire.rendezvous import (
    HEARTBEAT_TIMEOUT,
    SPEC,
    HeartbeatMonitor,
    Rendezvous,
    driver_store,
    joined_key,
    status,
)

log = logging.getLogger(__name__)

WATCH_INTERVAL = 0.1  # how often the driver looks for a dead rank
# Ranks wait in a broadcast for the next step for as long as the engine is idle, so the
# group's timeout must outlast any idle spell; dead peers are noticed by closed sockets
# and by watch(), not by this timeout.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
_HEADER = 6  # tokens, seqs, block-table width, sampled rows, max_seqlen_q, max_seqlen_k
EXIT_ORPHANED = 4


class RankDied(RuntimeError):
    """A tensor-parallel rank exited, or a step left the ranks out of step."""


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds (put in the rendezvous store as JSON for every rank)."""

    model: str
    world: int
    num_blocks: int
    block_size: int
    dtype: str  # torch dtype name: float32, bfloat16, float16
    device: str
    attention_backend: str
    num_threads: int | None


def dist_backend(device: torch.device) -> str:
    """gloo on the CPU, NCCL on CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str, local_rank: int) -> torch.device:
    """A rank's device: the same CPU, or the ``local_rank``-th GPU from the driver's."""
    dev = torch.device(device)
    return torch.device("cuda", (dev.index or 0) + local_rank) if dev.type == "cuda" else dev


# --- the per-step broadcast ----------------------------------------------------------


def broadcast_batch(batch: ForwardBatch) -> None:
    """Driver: send ``batch`` to every rank (two broadcasts: header, then payload)."""
    dev = batch.input_ids.device
    seqs, width = batch.block_tables.shape
    header = torch.tensor([batch.input_ids.numel(), seqs, width, batch.sample_indices.numel(),
                           batch.max_seqlen_q, batch.max_seqlen_k], dtype=torch.int64)
    torch.distributed.broadcast(header.to(dev), src=0)
    payload = torch.cat([batch.input_ids, batch.positions, batch.slot_mapping,
                         batch.block_tables.reshape(-1).long(), batch.seq_lens.long(),
                         batch.cu_seqlens_q.long(), batch.sample_indices])
    torch.distributed.broadcast(payload, src=0)


def broadcast_stop(device: torch.device) -> None:
    """Driver: tell every rank the group is closing (a header of -1 tokens)."""
    torch.distributed.broadcast(torch.full((_HEADER,), -1, dtype=torch.int64, device=device),
                                src=0)


def receive_batch(device: torch.device) -> ForwardBatch | None:
    """Rank: the driver's next batch (blocks while the engine is idle); None when the
    driver closes the group."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    torch.distributed.broadcast(header, src=0)
    tokens, seqs, width, sampled, max_q, max_k = header.tolist()
    if tokens < 0:
        return None
    sizes = [tokens, tokens, tokens, seqs * width, seqs, seqs + 1, sampled]
    payload = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    torch.distributed.broadcast(payload, src=0)
    ids, pos, slots, tables, lens, cu, sample = payload.split(sizes)
    return ForwardBatch(
        input_ids=ids, positions=pos, slot_mapping=slots,
        block_tables=tables.int().view(seqs, width), seq_lens=lens.int(),
        cu_seqlens_q=cu.int(), sample_indices=sample, max_seqlen_q=max_q,
        max_seqlen_k=max_k,
    )


# --- the driver's side ----------------------------------------------------------------


class RankGroup:
    """Ranks 1..world-1 of one driver: the local ones started when it is made, all of
    them joined by :meth:`connect`.

    One group per process at a time (torch.distributed's default group). ``broken``
    names why the group can no longer run a step, once it cannot. ``rendezvous``
    defaults to every rank on this host (:meth:`Rendezvous.for_driver`).
    """

    def __init__(self, spec: RankSpec, rendezvous: Rendezvous | None = None) -> None:
        if torch.distributed.is_initialized():
            raise ValueError("this process already belongs to a torch.distributed group "
                             "(one tensor-parallel ModelRunner per process)")
        self.spec = spec
        self.rdv = rendezvous or Rendezvous.for_driver(spec.world)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.broken: str | None = None
        self._connected = False
        self._closed = False
        self._monitor: HeartbeatMonitor | None = None
        self.store: Any = driver_store(self.rdv)  # torch.distributed.TCPStore
        self.port = self.store.port
        self.store.set(SPEC, json.dumps(dataclasses.asdict(spec)))
        env = dict(os.environ)
        # The rank must import this very actorllm, installed or not: put the directory
        # that holds the actorllm package (this file is actorllm/worker/ranks.py) first
        # on its path (not actorllm/ itself, whose kernels/ would shadow a library's).
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port),
                   WORLD_SIZE=str(spec.world))
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        argv = [sys.executable, "-m", "actorllm", "rank", "--watch-stdin",
                "--log-level", str(level)]
        try:
            for rank in range(1, self.rdv.local_ranks):
                self.procs.append(subprocess.Popen(
                    argv, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdin=subprocess.PIPE))
                log.info("started tensor-parallel rank %d (pid %d)", rank, self.procs[-1].pid)
        except BaseException:
            self.close()
            raise
        if self.rdv.remote:
            log.warning("waiting for tensor-parallel ranks %d..%d at %s (actorllm rank)",
                        self.rdv.local_ranks, spec.world - 1, self.rdv.where(self.port))

    @property
    def pids(self) -> list[int]:
        """Process ids of the local ranks 1..local_ranks-1."""
        return [p.pid for p in self.procs]

    def _local(self, rank: int) -> subprocess.Popen[bytes] | None:
        """Rank ``rank``'s process, when this driver started it; None for a remote one."""
        return self.procs[rank - 1] if rank < self.rdv.local_ranks else None

    def _where(self, rank: int) -> str:
        proc = self._local(rank)
        if proc is not None:
            return f"pid {proc.pid}"
        return f"remote, at {self.rdv.where(self.port)}"

    def _failed(self, rank: int) -> None:
        said = status(self.store, rank) if self.store is not None else None
        if said is not None and said.startswith("failed: "):
            raise ValueError(f"tensor-parallel rank {rank} failed to start: "
                             f"{said.removeprefix('failed: ')}")

    def connect(self, timeout: float | None = None) -> None:
        """Wait until every rank has loaded its shard, then form the group (as rank 0).

        Raises a one-line ``ValueError`` naming the rank that failed to start, or the
        first one not there after ``timeout`` (default: the rendezvous's).
        """
        assert self.store is not None
        timeout = self.rdv.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        waiting = set(range(1, self.spec.world))
        # A rank that joined and then died or stopped while loading (no process handle
        # when it is remote) is told by its heartbeat, not by the deadline.
        loading, joined = HeartbeatMonitor(self.store, range(1, self.spec.world)), set[int]()
        while waiting:
            for rank in sorted(waiting):
                if status(self.store, rank) == "ready":
                    waiting.discard(rank)
                    continue
                self._failed(rank)
                if rank not in joined and self.store.check([joined_key(rank)]):
                    joined.add(rank)
                    loading.touch(rank)
                if rank in joined and loading.stale([rank]) == rank:
                    raise ValueError(f"tensor-parallel rank {rank} ({self._where(rank)}) "
                                     f"joined, then sent no heartbeat for "
                                     f"{HEARTBEAT_TIMEOUT:g} s while loading")
                proc = self._local(rank)
                code = proc.poll() if proc is not None else None
                if code is not None:
                    self._failed(rank)  # it may have said why just before it exited
                    raise ValueError(f"tensor-parallel rank {rank} failed to start: exit "
                                     f"code {describe_exit(code)}")
            if waiting and time.monotonic() >= deadline:
                rank = min(waiting)
                if self.store.check([joined_key(rank)]):
                    raise ValueError(f"tensor-parallel rank {rank} not ready after {timeout:g} s")
                if rank < self.rdv.local_ranks:
                    raise ValueError(f"tensor-parallel rank {rank} did not start within "
                                     f"{timeout:g} s")
                raise ValueError(
                    f"tensor-parallel rank {rank} did not join the rendezvous at "
                    f"{self.rdv.where(self.port)} within {timeout:g} s (start `actorllm rank` "
                    f"with RANK={rank} WORLD_SIZE={self.spec.world} on its host)")
            if waiting:
                time.sleep(0.05)
        try:
            torch.distributed.init_process_group(
                dist_backend(rank_device(self.spec.device, 0)), store=self.store, rank=0,
                world_size=self.spec.world, timeout=COLLECTIVE_TIMEOUT)
        except Exception as exc:  # a rank said ready, then vanished
            raise ValueError(f"the tensor-parallel group did not form: "
                             f"{str(exc).splitlines()[0]}") from None
        self._connected = True
        self._monitor = HeartbeatMonitor(self.store, range(1, self.spec.world))
        log.info("tensor-parallel group of %d ranks formed on port %d", self.spec.world,
                 self.port)

    def forward(self, model: LlamaForCausalLM, batch: ForwardBatch,
                kv_caches: list[KVCache], backend: Any) -> torch.Tensor:
        """Broadcast ``batch`` and run this rank's share of the forward."""
        if self.broken is not None:
            raise RankDied(self.broken)
        try:
            broadcast_batch(batch)
            return model(batch, kv_caches, backend)
        except BaseException as exc:
            # The ranks may wait in an all-reduce this rank never reaches: no later step
            # can be trusted.
            self.broken = f"a tensor-parallel step failed: {type(exc).__name__}: {exc}"
            raise

    def dead(self) -> str | None:
        """Why the group is unusable: a local rank that exited, a rank whose heartbeat
        stopped, else a broken step, else None."""
        for rank, proc in enumerate(self.procs, 1):
            code = proc.poll()
            if code is not None:
                return (f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                        f"{describe_exit(code)}")
        if self._monitor is not None and not self._closed:
            rank = self._monitor.stale()
            if rank is not None:
                return (f"tensor-parallel rank {rank} ({self._where(rank)}) sent no heartbeat "
                        f"for {HEARTBEAT_TIMEOUT:g} s: it died, hung or lost the network")
        return self.broken

    async def watch(self) -> None:
        """Return never; raise :class:`RankDied` once a rank has exited or gone silent."""
        while True:
            reason = self.dead()
            if reason is not None and reason != self.broken:
                raise RankDied(reason)
            await trio.sleep(WATCH_INTERVAL)

    async def check(self) -> None:
        """After a step: raise :class:`RankDied` if it left the group broken (naming the
        rank whose death broke it, when one is seen dead soon: within a second for a
        local rank's exit, a heartbeat timeout for a remote rank)."""
        if self.broken is None:
            return
        wait = HEARTBEAT_TIMEOUT + 1.0 if self.rdv.remote else 1.0
        with trio.move_on_after(wait):
            while self.dead() == self.broken:
                await trio.sleep(0.02)
        raise RankDied(self.dead() or self.broken)

    def _await_stopped(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for every rank to say it has seen the stop (or,
        a local one, to exit)."""
        store = self.store
        assert store is not None

        def done(rank: int) -> bool:
            proc = self._local(rank)
            return (proc is not None and proc.poll() is not None) \
                or status(store, rank) == "stopped"

        deadline = time.monotonic() + timeout
        waiting = set(range(1, self.spec.world))
        while waiting and time.monotonic() < deadline:
            waiting = {r for r in waiting if not done(r)}
            if waiting:
                time.sleep(0.005)
        if waiting:
            log.warning("tensor-parallel ranks %s did not acknowledge the stop within %g s",
                        sorted(waiting), timeout)

    def close(self) -> None:
        """Stop every rank (the stop broadcast, acknowledged in the store; then EOF on a
        local rank's stdin, and SIGKILL 5 s after that), leave the group and close the
        store (a remote rank that missed the stop sees its heartbeat fail and exits)."""
        if self._closed:
            return
        told = False
        if self._connected and self.dead() is None:
            try:  # so that every rank, local or remote, exits 0 knowing why
                broadcast_stop(rank_device(self.spec.device, 0))
                told = True
            except Exception:
                log.debug("could not tell the ranks to stop", exc_info=True)
        self._closed = True
        if told:  # EOF on stdin or a closed store before a rank saw the stop would
            self._await_stopped(5.0)  # read to it as being orphaned (exit 4)
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank (pid %d) did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
        if self._connected and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self._monitor = None
        self.store = None  # the last reference: the store's server stops
