"""Wiring: build the mailboxes, start the five actors in one nursery, hand out an API.

This is the ``single`` topology: every actor in this process, every edge a trio
memory channel. (The multi-process topologies replace some edges with ZeroMQ
and move actors to child processes; the actors do not change.)

    async with open_engine(EngineConfig(model=...)) as engine:
        async for out in engine.generate(GenerateRequest(...)):
            ...
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from actorllm.config import EngineConfig, ModelInfo, read_model_info
from actorllm.detokenizer import Detokenizer, hf_decode_fn
from actorllm.frontend import Frontend, OutputCollector, RequestOutput
from actorllm.lifecycle import load_spec
from actorllm.mailbox import Mailbox
from actorllm.messages import (
    DetokenizerInput,
    FrontendInput,
    GenerateRequest,
    SchedulerInput,
    TokenizerInput,
    WorkerInput,
)
from actorllm.metrics import EngineMetrics
from actorllm.scheduler import Scheduler
from actorllm.tokenizer import PromptEncoder, Tokenizer, load_hf_tokenizer
from actorllm.trace import Tracer

log = logging.getLogger(__name__)


class Resources:
    """What is slow to build and may outlive one engine run: tokenizer, weights, caches."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.info: ModelInfo = read_model_info(config.model, config.max_model_len)
        self.hf_tokenizer: Any = load_hf_tokenizer(config.model)
        from actorllm.worker import ModelRunner  # torch: only where a Worker lives

        self.runner = ModelRunner(
            config.model,
            num_blocks=config.num_kv_blocks,
            block_size=config.block_size,
            kv_cache_bytes=None if config.num_kv_blocks is not None else config.kv_cache_memory,
            device=config.device,
            dtype=_torch_dtype(config.dtype),
            attention_backend=config.attention_backend,
        )
        capacity = self.runner.num_blocks * config.block_size
        if capacity < self.info.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({self.runner.num_blocks} blocks of "
                f"{config.block_size}), less than one sequence of max_model_len "
                f"{self.info.max_model_len}: raise --num-kv-blocks or lower --max-model-len"
            )


def _torch_dtype(name: str | None) -> Any:
    if name is None:
        return None
    import torch

    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {name}") from None


class AsyncEngine:
    """The API layer's handle on a running engine. Talks to the Frontend only."""

    def __init__(self, config: EngineConfig, resources: Resources, frontend: Frontend,
                 actors: dict[str, Any], mailboxes: dict[str, Mailbox[Any]]) -> None:
        self.config = config
        self.resources = resources
        self.info = resources.info
        self.tokenizer = resources.hf_tokenizer
        self.frontend = frontend
        self.metrics: EngineMetrics = frontend.metrics
        self.actors = actors
        self.mailboxes = mailboxes
        self.alive = True
        self._counter = itertools.count()

    def new_rid(self, prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:12]}-{next(self._counter)}"

    async def submit(self, request: GenerateRequest) -> OutputCollector:
        """Register and dispatch; read the returned collector for outputs."""
        return await self.frontend.submit(request)

    async def abort(self, rid: str) -> None:
        await self.frontend.abort(rid)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream deltas for one request; leaving early (or being cancelled) aborts it."""
        collector = await self.frontend.submit(request)
        try:
            async for out in collector:
                yield out
        finally:
            if not collector.finished:
                with trio.CancelScope(shield=True):
                    await self.frontend.abort(request.rid)

    def drain_problems(self) -> list[str]:
        """Everything still held anywhere (invariant 4); empty when the engine is idle."""
        problems: list[str] = []
        for actor in self.actors.values():
            problems += actor.drain_problems()
        problems += [f"mailbox {m.name} holds {m.depth}" for m in self.mailboxes.values()
                     if m.depth]
        return problems

    async def wait_drained(self, timeout: float = 10.0) -> list[str]:
        """Wait until nothing is held (or the timeout passes); returns what is left."""
        with trio.move_on_after(timeout):
            while self.drain_problems():
                await trio.sleep(0.005)
        return self.drain_problems()

    def update_gauges(self) -> None:
        """Copy the latest Scheduler stats and mailbox depths into the metrics."""
        s, m = self.frontend.stats, self.metrics
        m.num_requests_running.set(s.num_running)
        m.num_requests_waiting.set(s.num_waiting)
        m.kv_cache_usage_perc.set(s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total
                                  else 0.0)
        for box in self.mailboxes.values():
            m.mailbox_depth.labels(mailbox=box.name).set(box.depth)
            m.mailbox_high_water.labels(mailbox=box.name).set(box.high_water)


@asynccontextmanager
async def open_engine(config: EngineConfig | None = None, *,
                      resources: Resources | None = None) -> AsyncIterator[AsyncEngine]:
    """Start every actor of the ``single`` topology; stop them all on exit."""
    config = config or EngineConfig()
    if resources is None:
        resources = await trio.to_thread.run_sync(Resources, config)
    tracer = None
    if config.trace:
        tracer = Tracer(config.trace, hops=config.trace_hops)
        tracer.header(config.model, config.as_dict(), load_spec().version)
    cap = config.mailbox_capacity
    boxes: dict[str, Mailbox[Any]] = {
        "tokenizer": Mailbox[TokenizerInput]("tokenizer", TokenizerInput, cap),
        "scheduler": Mailbox[SchedulerInput]("scheduler", SchedulerInput, cap),
        "worker": Mailbox[WorkerInput]("worker", WorkerInput, 2),
        "detokenizer": Mailbox[DetokenizerInput]("detokenizer", DetokenizerInput, cap),
        "frontend": Mailbox[FrontendInput]("frontend", FrontendInput, cap),
    }
    if tracer is not None and tracer.hops:
        for box in boxes.values():
            box.hop_hook = lambda name, kind, msg: tracer.hop(name, name, kind, msg)
    from actorllm.worker import Worker

    frontend = Frontend(boxes["frontend"], boxes["tokenizer"], tracer=tracer)
    actors: dict[str, Any] = {
        "frontend": frontend,
        "tokenizer": Tokenizer(PromptEncoder(resources.hf_tokenizer, resources.info),
                               boxes["tokenizer"], boxes["scheduler"], boxes["frontend"], tracer),
        "scheduler": Scheduler(
            boxes["scheduler"], boxes["worker"], boxes["detokenizer"],
            num_blocks=resources.runner.num_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, tracer=tracer,
        ),
        "worker": Worker(resources.runner, boxes["worker"], boxes["scheduler"]),
        "detokenizer": Detokenizer(hf_decode_fn(resources.hf_tokenizer), boxes["detokenizer"],
                                   boxes["frontend"], boxes["scheduler"]),
    }
    engine = AsyncEngine(config, resources, frontend, actors, boxes)
    try:
        async with trio.open_nursery() as nursery:
            for name, actor in actors.items():
                nursery.start_soon(actor.run, name=f"actor:{name}")
            try:
                yield engine
            finally:
                engine.alive = False
                nursery.cancel_scope.cancel()
    finally:
        if tracer is not None:
            tracer.close()
