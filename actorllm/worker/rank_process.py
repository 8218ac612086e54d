"""A tensor-parallel rank's process (``actorllm rank``): join, load, serve steps, leave.

Every rank runs this, whether its driver started it (``--watch-stdin``: EOF on stdin
means the driver is gone) or another host did (the standard rendezvous variables in
its environment). See :mod:`actorllm.worker.ranks` for the driver's side and
:mod:`actorllm.wire.rendezvous` for the store they meet in.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from typing import Any, NoReturn

import torch

from actorllm.model import KVCache, LlamaForCausalLM
from actorllm.model.parallel import TensorParallel
from actorllm.wire.rendezvous import (
    SPEC,
    joined_key,
    rank_env,
    rank_store,
    start_heartbeat,
    status_key,
)
from actorllm.worker.ranks import (
    COLLECTIVE_TIMEOUT,
    EXIT_ORPHANED,
    RankSpec,
    dist_backend,
    rank_device,
    receive_batch,
)

log = logging.getLogger(__name__)

# Set once the driver has told this rank to stop. The driver then closes its store and
# (for a rank it started) our stdin, and either may reach the heartbeat or the stdin
# thread before the main thread has left: that is the expected end, so exit 0. (The
# driver waits for our "stopped" status first, so this is only the fallback.)
_stopped = threading.Event()


def _exit_when_orphaned() -> None:
    """EOF on stdin: the driver closed the group or died. Leave at once."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        leave(0 if _stopped.is_set() else EXIT_ORPHANED)


def _driver_lost(why: str) -> NoReturn:
    if _stopped.is_set():
        leave(0)
    log.error("the tensor-parallel driver is gone (%s); leaving", why)
    leave(EXIT_ORPHANED)


def leave(code: int) -> NoReturn:
    """Exit without the interpreter's finalization: the process group's C++ threads are
    still alive, and destroying them there aborts the process (SIGABRT, "terminate
    called without an active exception"), whether the group is broken or not."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _build(spec: RankSpec, tp: TensorParallel, local_rank: int
           ) -> tuple[LlamaForCausalLM, list[KVCache], Any, torch.device]:
    from actorllm.model import load_config, load_model
    from actorllm.model.llama import allocate_kv_caches, head_dim_of
    from actorllm.ops import select_backend
    from actorllm.ops.cpu_linear import pack_linears

    device = rank_device(spec.device, local_rank)
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


def serve_rank(model: str | None = None, *, timeout: float = 300.0,
               num_threads: int | None = None, watch_stdin: bool = False) -> NoReturn:
    """A rank's process (``actorllm rank``), with torch.distributed's variables in its
    environment: join the driver's store, build the shard it describes, serve steps
    until the driver goes. ``model`` overrides the driver's path (another host may keep
    the checkpoint elsewhere); ``num_threads`` the driver's per-rank threads.

    Exits the process with 0 when the driver closes the group, with EXIT_ORPHANED when
    it is lost; raises a one-line ``ValueError`` when the rank cannot start (after
    telling the driver why, once it has joined). The caller should then leave with
    :func:`leave` too: the heartbeat's thread may be inside the store's C++ client.
    """
    addr, port, rank, world = rank_env()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    if watch_stdin:
        threading.Thread(target=_exit_when_orphaned, daemon=True).start()
    store = rank_store(addr, port, timeout)
    if store.add(joined_key(rank), 1) > 1:
        raise ValueError(f"rank {rank} has already joined the driver at {addr}:{port}")
    start_heartbeat(store, rank, _driver_lost)  # also while loading: the driver may die
    try:
        store.wait([SPEC])
        spec = RankSpec(**json.loads(store.get(SPEC)))
        if spec.world != world:
            raise ValueError(f"WORLD_SIZE={world}, but the driver runs {spec.world} ranks")
        if model is not None:
            spec = dataclasses.replace(spec, model=model)
        if num_threads is not None or not watch_stdin:  # the driver's count is its host's
            spec = dataclasses.replace(spec, num_threads=num_threads)
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        built = _build(spec, TensorParallel(rank, world), local_rank)
    except Exception as exc:
        log.debug("rank %d failed to load", rank, exc_info=True)
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        store.set(status_key(rank), f"failed: {why}")
        raise ValueError(why) from None
    model_, kv, backend, device = built
    store.set(status_key(rank), "ready")
    log.info("rank %d of %d ready (%s, model %s)", rank, world, device, spec.model)
    try:
        torch.distributed.init_process_group(dist_backend(device), store=store, rank=rank,
                                             world_size=world, timeout=COLLECTIVE_TIMEOUT)
        with torch.inference_mode():
            while (batch := receive_batch(device)) is not None:
                model_(batch, kv, backend)
    except Exception as exc:  # the driver died, or broke a step
        _driver_lost(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    _stopped.set()
    log.info("rank %d: the driver closed the group", rank)
    try:  # the driver closes the store and our stdin once every rank has said this
        store.set(status_key(rank), "stopped")
    except Exception:  # it gave up waiting and closed them: we are leaving anyway
        log.debug("could not acknowledge the stop", exc_info=True)
    leave(0)
