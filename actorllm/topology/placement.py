"""Placement: which actor lives in which process, its mailboxes, and the actors on them.

Sockets. All live in one private 0700 directory (:class:`~actorllm.wire.transport.IpcDir`),
removed when the engine stops. An inbox that hears from another process is a
:class:`~actorllm.wire.transport.ZmqInbox` bound at ``<dir>/<actor>.sock``; each edge that
leaves a process is its own PUSH socket connected there, so every edge keeps its
FIFO order (an abort never overtakes its request). Edges inside a process stay
trio memory channels. (Control traffic between parent and child has sockets of its
own: see :mod:`actorllm.topology.child`.)

Data parallelism (``data_parallel_size`` N > 1, the ``engine`` placement only): the
``engine`` role is replicated as children ``engine0`` .. ``engine{N-1}``, each with its
own Scheduler inbox at ``scheduler{r}.sock``; a sender in the main process holds one
outbox per replica for each edge into a Scheduler (:meth:`Wiring.outs`), and every
replica pushes into the one Detokenizer inbox. Replicas on other hosts
(``local_replicas`` < N, :mod:`actorllm.topology.remote`): the outboxes to them wait
unconnected (``Wiring.deferred``) until each replica says where it listens.

Every process builds its part of the graph the same way, ``single`` included:
:class:`Wiring` for the mailboxes, then :func:`build_actors` from the :class:`Parts`
that process loaded. So the actors do not know where their peers live.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from actorllm.config import EngineConfig, ModelInfo
from actorllm.cpus import usable_cpus
from actorllm.lifecycle.table import ACTORS
from actorllm.lifecycle.trace import Tracer
from actorllm.wire.mailbox import Mailbox, Outbox
from actorllm.wire.messages import (
    DetokenizerInput,
    FrontendInput,
    MailboxStat,
    SchedulerInput,
    SchedulerStats,
    TokenizerInput,
    WorkerInput,
)
from actorllm.wire.transport import IpcDir, ZmqInbox, ZmqOutbox

MAIN = "main"

PLACEMENTS: dict[str, dict[str, str]] = {
    "single": dict.fromkeys(ACTORS, MAIN),
    "engine": {"frontend": MAIN, "tokenizer": MAIN, "detokenizer": MAIN,
               "scheduler": "engine", "worker": "engine"},
    "pipeline": {"frontend": MAIN, "tokenizer": MAIN, "scheduler": "engine",
                 "worker": "engine", "detokenizer": "detokenizer"},
}

# (sender, receiving inbox): every edge of DESIGN.md section 1.
EDGES: tuple[tuple[str, str], ...] = (
    ("frontend", "tokenizer"),
    ("tokenizer", "scheduler"),
    ("tokenizer", "frontend"),
    ("scheduler", "worker"),
    ("scheduler", "detokenizer"),
    ("worker", "scheduler"),
    ("detokenizer", "frontend"),
    ("detokenizer", "scheduler"),
)

INBOX_TYPES: dict[str, Any] = {
    "tokenizer": TokenizerInput,
    "scheduler": SchedulerInput,
    "worker": WorkerInput,
    "detokenizer": DetokenizerInput,
    "frontend": FrontendInput,
}

WORKER_CAPACITY = 2  # one step in flight, one queued: more would only add latency


REPLICATED = "engine"  # the role data parallelism replicates


def child_roles(topology: str, replicas: int = 1) -> tuple[str, ...]:
    """The child processes a topology needs, in start order (``replicas`` > 1: the
    ``engine`` role becomes ``engine0`` .. ``engine{replicas-1}``)."""
    roles = dict.fromkeys(r for r in PLACEMENTS[topology].values() if r != MAIN)
    if replicas > 1 and REPLICATED in roles:
        return tuple(x for r in roles for x in (
            [f"{r}{i}" for i in range(replicas)] if r == REPLICATED else [r]))
    return tuple(roles)


def split_role(role: str) -> tuple[str, int | None]:
    """``"engine1"`` -> ``("engine", 1)``; a role that is not a replica -> ``(role, None)``."""
    base = role.rstrip("0123456789")
    return base, (int(role[len(base):]) if base != role else None)


# --- one process's mailboxes and actors ------------------------------------------------


class Wiring:
    """The mailboxes of one process in one topology.

    ``inboxes[actor]`` for each actor placed here: a :class:`ZmqInbox` (with a bound
    socket) when some sender lives elsewhere, else a plain :class:`Mailbox`.
    ``out(sender, target)``: the target's inbox when it is local, else a
    :class:`ZmqOutbox` of its own for that edge; ``outs(sender, target)``: one per
    replica of the target (``replicas`` > 1 and the target lives in a replica).
    Replicas ``local_replicas`` and above live on other hosts: their outboxes are made
    unconnected, listed in ``deferred`` by socket name (see :meth:`connect_remote`).
    """

    def __init__(self, role: str, topology: str, capacity: int, ipc: IpcDir | None,
                 replicas: int = 1, local_replicas: int | None = None) -> None:
        place = PLACEMENTS[topology]
        self.role = role
        role, replica = split_role(role)
        sock = f"{{}}{replica}.sock" if replica is not None else "{}.sock"
        self.inboxes: dict[str, Mailbox[Any]] = {}
        self.outboxes: dict[tuple[str, str], Outbox[Any]] = {}
        self.fanout: dict[tuple[str, str], list[Outbox[Any]]] = {}
        self.remote_inboxes: list[ZmqInbox[Any]] = []
        self.remote_outboxes: list[ZmqOutbox[Any]] = []
        self.deferred: dict[str, list[ZmqOutbox[Any]]] = {}
        local = replicas if local_replicas is None else local_replicas
        try:
            for actor in ACTORS:
                if place[actor] != role:
                    continue
                cap = WORKER_CAPACITY if actor == "worker" else capacity
                if any(place[s] != role for s, t in EDGES if t == actor):
                    assert ipc is not None, "a multi-process topology needs an IpcDir"
                    inbox: Mailbox[Any] = ZmqInbox(actor, INBOX_TYPES[actor], cap,
                                                   ipc.endpoint(sock.format(actor)))
                    self.remote_inboxes.append(inbox)  # type: ignore[arg-type]
                else:
                    inbox = Mailbox(actor, INBOX_TYPES[actor], cap)
                self.inboxes[actor] = inbox
            for sender, target in EDGES:
                if place[sender] != role:
                    continue
                if place[target] == role:
                    self.outboxes[(sender, target)] = self.inboxes[target]
                    continue
                assert ipc is not None
                names = [f"{target}.sock"]
                if replicas > 1 and place[target] == REPLICATED:
                    names = [f"{target}{r}.sock" for r in range(replicas)]
                boxes: list[Outbox[Any]] = []
                for i, name in enumerate(names):
                    here = len(names) == 1 or i < local
                    box: ZmqOutbox[Any] = ZmqOutbox(
                        ipc.endpoint(name) if here else None, INBOX_TYPES[target],
                        name=f"{sender}->{target}" + (str(i) if len(names) > 1 else ""),
                        hwm=capacity)
                    self.remote_outboxes.append(box)
                    if not here:
                        self.deferred.setdefault(name, []).append(box)
                    boxes.append(box)
                self.outboxes[(sender, target)] = boxes[0]
                self.fanout[(sender, target)] = boxes
        except BaseException:
            self.close()
            raise

    def out(self, sender: str, target: str) -> Outbox[Any]:
        """Where ``sender`` sends to ``target``."""
        return self.outboxes[(sender, target)]

    def outs(self, sender: str, target: str) -> list[Outbox[Any]]:
        """Where ``sender`` sends to each replica of ``target`` (one outbox without data
        parallelism), indexed by replica."""
        return self.fanout.get((sender, target), [self.outboxes[(sender, target)]])

    def connect_remote(self, endpoints: dict[str, str]) -> None:
        """Connect the deferred outboxes to a remote replica's inboxes, ``{socket name:
        endpoint}`` as it published them (``scheduler1.sock`` -> ``tcp://...``)."""
        for name, endpoint in endpoints.items():
            for box in self.deferred.get(name, []):
                box.connect(endpoint)

    def problems(self) -> list[str]:
        """Messages still waiting in this process's mailboxes (invariant 4)."""
        return [f"mailbox {m.name} holds {m.depth}" for m in self.inboxes.values() if m.depth]

    def stats(self) -> tuple[MailboxStat, ...]:
        """Depth and high-water mark of each inbox, for the parent's metrics."""
        return tuple(MailboxStat(m.name, m.depth, m.high_water) for m in self.inboxes.values())

    @property
    def rejected(self) -> int:
        """Frames refused by this process's data sockets so far."""
        return sum(box.rejected for box in self.remote_inboxes)

    def close(self) -> None:
        """Close this process's sockets (memory channels need nothing)."""
        for box in self.remote_outboxes:
            box.close()
        for inbox in self.remote_inboxes:
            inbox.close()


@attrs.define
class Parts:
    """What the actors of one process are built from (each process loads only its own)."""

    info: ModelInfo | None = None
    hf_tokenizer: Any = None
    runner: Any = None  # actorllm.worker.runner.ModelRunner
    decode: Any = None  # actorllm.detokenizer.actor.DecodeFn



def build_runner(config: EngineConfig, info: ModelInfo) -> Any:
    """The ModelRunner for ``config``; ValueError if its KV cache cannot hold one sequence."""
    from actorllm.wire.rendezvous import Rendezvous  # torch: only where a Worker lives
    from actorllm.worker.runner import ModelRunner

    runner = ModelRunner(
        config.model,
        model_impl=config.model_impl,
        draft_model=config.speculative.model if config.speculative else None,
        num_blocks=config.num_kv_blocks,
        block_size=config.block_size,
        kv_cache_bytes=None if config.num_kv_blocks is not None else config.kv_cache_memory,
        device=config.device, dtype=_torch_dtype(config.dtype),
        attention_backend=config.attention_backend,
        cuda_graph_rows=config.max_num_seqs if config.cuda_graphs else 0,
        num_threads=worker_threads(config),
        large_step_threads=large_step_threads(config),
        info=info,
        tensor_parallel_size=config.tensor_parallel_size,
        rendezvous=Rendezvous.for_driver(config.tensor_parallel_size,
                                         config.tensor_parallel_local_ranks,
                                         config.tensor_parallel_timeout)
        if config.tensor_parallel_size > 1 else None,
    )
    capacity = runner.num_blocks * config.block_size
    if capacity < info.max_model_len:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({runner.num_blocks} blocks of "
            f"{config.block_size}), less than one sequence of max_model_len "
            f"{info.max_model_len}: raise --num-kv-blocks or lower --max-model-len"
        )
    return runner


# With overlap on the CPU, a Scheduler in a process of its own plans no step ahead within
# this long of an arrival (Scheduler.quiet_s; docs/architecture.md). Not in `single`,
# where it cost TPOT and bought nothing, nor on CUDA (not measured).
ARRIVAL_QUIET_S = 0.1


def arrival_quiet_s(config: EngineConfig) -> float:
    """``Scheduler.quiet_s`` for ``config``: ARRIVAL_QUIET_S or 0."""
    own = PLACEMENTS[config.topology]["scheduler"] != MAIN
    return ARRIVAL_QUIET_S if own and config.overlap and config.device.startswith("cpu") else 0.0


def worker_threads(config: EngineConfig) -> int | None:
    """Torch threads for the Worker's process (for each rank with tensor parallelism):
    ``--cpu-threads`` when given; else, on the CPU, one per core it may run on less one,
    left to the event loop that serves HTTP (another process's, or in ``single`` under
    ``actorllm serve`` the Worker's own process's), shared among the ranks (and among
    the replicas of data parallelism on this host, at least one each); else None
    (torch's default, or ``ModelRunner``'s cores / N).

    On a few cores an OpenMP thread that shares its core with another busy thread stalls
    every parallel region it is part of: on 2 cores the ``engine`` topology gave 735
    output tok/s with 2 Worker threads and 1,087 with 1, and ``single`` under ``serve``,
    with decode steps in one op (ops/cpu_step.py), 2,476-3,090 with 1 thread for
    ordinary steps against 2,047-2,429 with 2 (docs/architecture.md).
    """
    if config.cpu_threads is not None:
        return config.cpu_threads
    if _leaves_a_core(config):
        # With data parallelism the replicas share the cores: each gets its part.
        cores = (usable_cpus() - 1) // config.local_replicas
        return max(1, cores // config.tensor_parallel_size)
    return None


def large_step_threads(config: EngineConfig) -> int | None:
    """Torch threads for a prefill-sized step (``ops/threads.LARGE_STEP_TOKENS`` tokens or
    more) where :func:`worker_threads` left a core to an event loop: the cores this
    replica may run on, that one included (a long step leaves the loop little to do).
    None (the same as every step's) with ``--cpu-threads`` or tensor parallelism."""
    if config.cpu_threads is not None or config.tensor_parallel_size > 1:
        return None
    if _leaves_a_core(config):
        return max(1, usable_cpus() // config.local_replicas)
    return None


def _leaves_a_core(config: EngineConfig) -> bool:
    """Whether the Worker's ordinary steps leave a core to an event loop: on the CPU, in a
    process of its own, or in the process that serves HTTP with one rank (tensor-parallel
    ranks are processes of their own, sized by ``ModelRunner``). Beside an offline
    engine's loop (``LLM``, ``actorllm run``) the Worker keeps every core: that loop has
    little to do, and offline output tok/s measured 3,515-4,190 with 2 threads against
    2,819-3,002 with 1."""
    if config.device != "cpu":
        return False
    return PLACEMENTS[config.topology]["worker"] != MAIN or config.worker_beside_http


def _torch_dtype(name: str | None) -> Any:
    if name is None:
        return None
    import torch

    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {name}") from None


def build_actors(role: str, wiring: Wiring, config: EngineConfig, parts: Parts,
                 tracer: Tracer | None) -> dict[str, Any]:
    """The actors placed in ``role`` by ``config.topology``, wired to ``wiring``
    (``role`` may name a data-parallel replica, ``engine1``)."""
    from actorllm.detokenizer.actor import Detokenizer
    from actorllm.frontend.actor import Frontend
    from actorllm.scheduler.actor import Scheduler
    from actorllm.tokenizer.actor import PromptEncoder, Tokenizer

    place = PLACEMENTS[config.topology]
    inbox, out = wiring.inboxes, wiring.out
    role, replica = split_role(role)
    actors: dict[str, Any] = {}
    if place["frontend"] == role:
        from actorllm.frontend.readers import FlowLimits

        limits = FlowLimits(config.max_pending_bytes_per_request, config.max_pending_bytes,
                            config.stream_timeout)
        actors["frontend"] = Frontend(inbox["frontend"], out("frontend", "tokenizer"),
                                      tracer=tracer, limits=limits,
                                      replicas=config.data_parallel_size)
    if place["tokenizer"] == role:
        assert parts.info is not None
        actors["tokenizer"] = Tokenizer(PromptEncoder(parts.hf_tokenizer, parts.info),
                                        inbox["tokenizer"], out("tokenizer", "scheduler"),
                                        out("tokenizer", "frontend"), tracer,
                                        schedulers=wiring.outs("tokenizer", "scheduler"))
    if place["scheduler"] == role:
        actors["scheduler"] = Scheduler(
            inbox["scheduler"], out("scheduler", "worker"), out("scheduler", "detokenizer"),
            num_blocks=parts.runner.num_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_steps_in_flight=2 if config.overlap else 1, tracer=tracer,
            enable_prefix_caching=config.enable_prefix_caching,
            scheduling_policy=config.scheduling_policy, quiet_s=arrival_quiet_s(config),
            speculative=config.speculative and config.speculative.for_device(config.device),
        )
        actors["scheduler"].replica = replica or 0
    if place["worker"] == role:
        from actorllm.topology.warmup import warmup_for
        from actorllm.worker.actor import Worker  # torch: only where a Worker lives

        warmup = warmup_for(config, parts.info, parts.runner, large_step_threads(config))
        actors["worker"] = Worker(parts.runner, inbox["worker"], out("worker", "scheduler"),
                                  warmup=warmup)
    if place["detokenizer"] == role:
        actors["detokenizer"] = Detokenizer(parts.decode, inbox["detokenizer"],
                                            out("detokenizer", "frontend"),
                                            out("detokenizer", "scheduler"),
                                            schedulers=wiring.outs("detokenizer", "scheduler"))
    return actors


def actor_problems(actors: dict[str, Any]) -> list[str]:
    """What the actors still hold (invariant 4): each actor's own ``drain_problems``."""
    problems: list[str] = []
    for actor in actors.values():
        problems += actor.drain_problems()
    return problems


def set_hop_hooks(wiring: Wiring, tracer: Tracer | None) -> None:
    """Record every delivery into this process's inboxes, when the trace asks for hops."""
    if tracer is not None and tracer.hops:
        for box in wiring.inboxes.values():
            box.hop_hook = lambda name, kind, msg: tracer.hop(name, name, kind, msg)


def waits_for_loop(stats: Callable[[], SchedulerStats],
                   mailboxes: dict[str, Mailbox[Any]]) -> bool:
    """Whether the engine waits for this process's event loop now, for the write pacing
    (``server/pacing.py``): a Worker waited for the plan of its latest step (``stats()``,
    the Scheduler's latest ``SchedulerStats`` as the Frontend received them: the Worker
    says so in its ``StepResult`` and the Scheduler passes it on, in this process or
    across ZeroMQ alike), or work waits in this process's Tokenizer, Detokenizer or
    Frontend inbox (the loop is behind the requests or the steps)."""
    if stats().worker_waited:
        return True
    return any(box.depth for name in ("tokenizer", "detokenizer", "frontend")
               if (box := mailboxes.get(name)) is not None)
