"""Tensor-parallel ranks: the driver's side (:class:`RankGroup`) and a rank's process.

With ``--tensor-parallel-size N`` the Worker's :class:`~actorllm.worker.ModelRunner` is
rank 0, the *driver*; it starts ranks 1..N-1 as processes (``python -m actorllm.ranks``)
that each hold their shard of the weights (:mod:`actorllm.model.parallel`) and of the KV
cache, and do nothing but run the model forward on what the driver broadcasts. The
driver alone keeps sampling state, computes logits and samples, so seeded sampling is
the same as on one rank; the ranks own no request state at all.

Per step, the driver broadcasts the packed :class:`~actorllm.model.ForwardBatch` over
torch.distributed (a 6-int header, then one int64 tensor holding every field), and all
ranks run the forward, meeting in two all-reduces per layer. The plan does not travel
over the ZeroMQ control channel: the ranks are already in a collective group with the
driver, the broadcast is one copy per rank of a few KB, it is ordered with the
all-reduces that follow it by construction, and a rank then needs no event loop,
no codec and no mailbox, only torch.

Rendezvous is torch.distributed's standard one: the driver binds a free loopback port
and gives each rank ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` in its
environment (``init_method="env://"``). Backend: gloo on the CPU, NCCL on CUDA.

No orphans. A rank's stdin is a pipe from the driver; it exits at once when that pipe
reaches EOF, which happens when the driver closes the group or its process dies in any
way (PR_SET_PDEATHSIG would not do: the driver may start ranks from a worker thread,
and the signal fires when that *thread* exits). A rank that loses a peer mid-collective
gets gloo's "connection closed" error and exits too.

Death. :meth:`RankGroup.watch` (run by the Worker actor) raises :class:`RankDied`
within ``WATCH_INTERVAL`` of a rank exiting; the Worker actor then fails, and the
engine is dead as when a child process dies (``engine_dead``). A step that fails
after its broadcast leaves the ranks out of step with the driver, so it is fatal too.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import trio

from actorllm.exit_codes import describe_exit
from actorllm.model import ForwardBatch, KVCache, LlamaForCausalLM
from actorllm.model.parallel import TensorParallel

log = logging.getLogger(__name__)

WATCH_INTERVAL = 0.1  # how often the driver looks for a dead rank
READY_TIMEOUT = 300.0  # loading a large shard can take minutes; a failure reports at once
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
    """What every rank builds (sent to each rank process as JSON)."""

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


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: the same CPU, or the ``rank``-th GPU from the driver's."""
    dev = torch.device(device)
    return torch.device("cuda", (dev.index or 0) + rank) if dev.type == "cuda" else dev


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def receive_batch(device: torch.device) -> ForwardBatch:
    """Rank: the driver's next batch (blocks while the engine is idle)."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    torch.distributed.broadcast(header, src=0)
    tokens, seqs, width, sampled, max_q, max_k = header.tolist()
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
    """Ranks 1..world-1 of one driver: started when it is made, joined by :meth:`connect`.

    One group per process at a time (torch.distributed's default group). ``broken``
    names why the group can no longer run a step, once it cannot.
    """

    def __init__(self, spec: RankSpec) -> None:
        if torch.distributed.is_initialized():
            raise ValueError("this process already belongs to a torch.distributed group "
                             "(one tensor-parallel ModelRunner per process)")
        self.spec = spec
        self.port = _free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.broken: str | None = None
        self._connected = False
        self._closed = False
        env = dict(os.environ)
        # The rank must import this very actorllm, installed or not.
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port),
                   WORLD_SIZE=str(spec.world))
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        argv = [sys.executable, "-m", "actorllm.ranks", json.dumps(asdict(spec)), str(level)]
        try:
            for rank in range(1, spec.world):
                self.procs.append(subprocess.Popen(
                    argv, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE))
                log.info("started tensor-parallel rank %d (pid %d)", rank, self.procs[-1].pid)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..world-1."""
        return [p.pid for p in self.procs]

    def connect(self, timeout: float = READY_TIMEOUT) -> None:
        """Wait until every rank has loaded its shard, then form the group (as rank 0).

        Raises a one-line ``ValueError`` naming the rank that failed to start.
        """
        waiting = {p.stdout.fileno(): (rank, p) for rank, p in enumerate(self.procs, 1)
                   if p.stdout is not None}
        lines: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ValueError(f"tensor-parallel rank {min(r for r, _ in waiting.values())} "
                                 f"not ready after {timeout:g} s")
            readable, _, _ = select.select(list(waiting), [], [], min(left, 0.5))
            for fd in readable:
                rank, proc = waiting[fd]
                chunk = os.read(fd, 4096)
                lines[rank] = lines.get(rank, b"") + chunk
                said = [x.strip() for x in lines[rank].decode(errors="replace").splitlines()]
                if "ready" in said:
                    del waiting[fd]
                elif not chunk or any(x.startswith("failed: ") for x in said):
                    code = proc.wait()  # it says why, then exits; or it died silently
                    why = next((x.removeprefix("failed: ") for x in said
                                if x.startswith("failed: ")), f"exit code {describe_exit(code)}")
                    raise ValueError(f"tensor-parallel rank {rank} failed to start: {why}")
        torch.distributed.init_process_group(
            dist_backend(rank_device(self.spec.device, 0)),
            init_method=f"tcp://127.0.0.1:{self.port}", rank=0, world_size=self.spec.world,
            timeout=COLLECTIVE_TIMEOUT)
        self._connected = True
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
        """Why the group is unusable: a rank that exited, else a broken step, else None."""
        for rank, proc in enumerate(self.procs, 1):
            code = proc.poll()
            if code is not None:
                return (f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                        f"{describe_exit(code)}")
        return self.broken

    async def watch(self) -> None:
        """Return never; raise :class:`RankDied` once a rank has exited."""
        while True:
            reason = self.dead()
            if reason is not None and reason != self.broken:
                raise RankDied(reason)
            await trio.sleep(WATCH_INTERVAL)

    async def check(self) -> None:
        """After a step: raise :class:`RankDied` if it left the group broken (naming the
        rank whose exit broke it, when one exits within a second)."""
        if self.broken is None:
            return
        with trio.move_on_after(1.0):
            while self.dead() == self.broken:
                await trio.sleep(0.02)
        raise RankDied(self.dead() or self.broken)

    def close(self) -> None:
        """Stop every rank (EOF on its stdin; SIGKILL after 5 s) and leave the group."""
        if self._closed:
            return
        self._closed = True
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
            if proc.stdout is not None:
                proc.stdout.close()
        if self._connected and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# --- a rank's process -----------------------------------------------------------------


def _exit_when_orphaned() -> None:
    """EOF on stdin: the driver closed the group or died. Leave at once."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        os._exit(EXIT_ORPHANED)


def _say(line: str) -> None:
    sys.stdout.write(line.replace("\n", " ") + "\n")
    sys.stdout.flush()


def _build(spec: RankSpec, tp: TensorParallel
           ) -> tuple[LlamaForCausalLM, list[KVCache], Any, torch.device]:
    from actorllm.model import load_config, load_model
    from actorllm.model.llama import allocate_kv_caches, head_dim_of
    from actorllm.ops import select_backend
    from actorllm.ops.cpu_linear import pack_linears

    device = rank_device(spec.device, tp.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    dtype = getattr(torch, spec.dtype)
    config = load_config(spec.model)
    backend = select_backend(spec.attention_backend, device, dtype=dtype,
                             head_dim=head_dim_of(config), block_size=spec.block_size)
    model = load_model(spec.model, dtype=dtype, device=device, config=config, tp=tp)
    if device.type == "cpu":
        pack_linears(model)
    kv = allocate_kv_caches(config, spec.num_blocks, spec.block_size, dtype, device, tp)
    return model, kv, backend, device


def main(argv: list[str] | None = None) -> int:
    """A rank's process: ``python -m actorllm.ranks SPEC_JSON LOG_LEVEL`` with the
    torch.distributed variables in its environment."""
    args = sys.argv[1:] if argv is None else argv
    spec = RankSpec(**json.loads(args[0]))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    threading.Thread(target=_exit_when_orphaned, daemon=True).start()
    logging.basicConfig(level=args[1] if len(args) > 1 else "WARNING",
                        format=f"%(asctime)s %(levelname)s [rank {rank} %(process)d] "
                               "%(name)s: %(message)s")
    tp = TensorParallel(rank, world)
    try:
        model, kv, backend, device = _build(spec, tp)
    except Exception as exc:
        log.exception("rank %d failed to load", rank)
        _say(f"failed: {str(exc).strip() or type(exc).__name__}")
        return 1
    _say("ready")
    try:
        torch.distributed.init_process_group(dist_backend(device), init_method="env://",
                                             rank=rank, world_size=world,
                                             timeout=COLLECTIVE_TIMEOUT)
        with torch.inference_mode():
            while True:
                model(receive_batch(device), kv, backend)
    except Exception:
        log.exception("rank %d failed", rank)
        return 1


if __name__ == "__main__":
    sys.exit(main())
