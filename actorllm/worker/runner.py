"""The Worker's ModelRunner: one StepPlan in, one StepResult out, synchronously.

The runner owns the model weights, the paged KV cache tensors (one k/v pair per
layer, ``[num_blocks, block_size, num_kv_heads, head_dim]``) and the persistent batch:
each held rid's block table (worker/packing.py) and sampling columns (params plus token
history, for penalties and seeded draws: worker/sampling_batch.py), in one slot. It
never decides anything: the Scheduler says which tokens to run, where their K/V
go, which rows to sample and which prompt positions to score; the runner packs that
into a :class:`ForwardBatch`, runs the model, scores and samples. A failing step
becomes ``StepResult(error=...)``. The actor around it is :mod:`actorllm.worker.actor`.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from pathlib import Path

import attrs
import numpy as np
import torch
from transformers import PretrainedConfig

from actorllm.config import ModelInfo, read_model_info
from actorllm.cpus import worker_share
from actorllm.model import ForwardBatch, KVCache, load_config, load_model, model_impl_of
from actorllm.model.llama import allocate_kv_caches, head_dim_of
from actorllm.model.loader import check_device_dtype
from actorllm.model.parallel import TensorParallel, check_tensor_parallel
from actorllm.ops import select_backend
from actorllm.ops.cpu_linear import pack_linears
from actorllm.ops.cpu_step import load_decode_step, load_sampler
from actorllm.ops.threads import StepThreads, single_threaded
from actorllm.text.structured import MaskFiller
from actorllm.wire.rendezvous import Rendezvous
from actorllm.wire.steps import PromptLogprobs, StepPlan, StepResult
from actorllm.worker.ahead import AheadLookup
from actorllm.worker.cuda_graphs import DecodeGraphs, check_graphs
from actorllm.worker.draft import DraftModel, draft_block_bytes
from actorllm.worker.filters import GREEDY_BELOW
from actorllm.worker.grammars import Grammars
from actorllm.worker.packing import BlockTables, every_token_samples, one_token_rows, pack_plan
from actorllm.worker.pooling import Pooler, pooled_norm
from actorllm.worker.ranks import RankGroup, RankSpec
from actorllm.worker.sampler import prompt_logprobs
from actorllm.worker.sampling_batch import SamplingBatch, SamplingState
from actorllm.worker.sizing import default_num_blocks, keep_heap, torch_threads
from actorllm.worker.speculative import commit_others, drawn_temperatures, no_draw, verify_step

log = logging.getLogger(__name__)


class ModelRunner:
    """Weights, KV cache and per-rid sampling state of one model; runs one step at a time.

    ``num_blocks`` or ``kv_cache_bytes`` sizes the cache (neither: a default budget).
    ``dtype`` defaults to fp32 on CPU and bf16 on CUDA. ``num_threads`` sets torch's
    intra-op threads for the process (None: leave torch's default, one per core);
    ``large_step_threads`` those of a prefill-sized step (None: the same; ops/threads.py).
    ``execute`` is synchronous and must be called from one thread at a time. ``info`` is
    the engine's one :class:`ModelInfo` (read from ``model_dir`` when not given), so the
    Worker refuses and stops on exactly what the Tokenizer and the Scheduler do.
    ``tensor_parallel_size`` > 1 makes this runner the driver of that many ranks
    (:mod:`actorllm.worker.ranks`), meeting at ``rendezvous`` (default: all on this host);
    :meth:`close` stops them. ``draft_model``: a speculative draft's directory (worker/draft.py).
    ``cuda_graph_rows`` > 0: decode steps of up to that many rows replay CUDA graphs
    (worker/cuda_graphs.py). Counters: ``one_op_steps`` (decode steps run by the one
    op), ``logits_in_op_steps`` (... and their logits), ``drawn_in_op_steps`` (... tokens).
    """

    one_op_draft_steps = 0  # steps run by decode_step with speculating rows (per instance)

    def __init__(
        self,
        model_dir: str | Path,
        *,
        num_blocks: int | None = None,
        block_size: int = 16,
        kv_cache_bytes: int | None = None,
        device: str = "cpu", dtype: torch.dtype | None = None,
        attention_backend: str = "auto",
        num_threads: int | None = None,
        large_step_threads: int | None = None,
        info: ModelInfo | None = None,
        tensor_parallel_size: int = 1, rendezvous: Rendezvous | None = None,
        model_impl: str = "auto",
        draft_model: str | None = None,
        cuda_graph_rows: int = 0,
    ) -> None:
        if num_blocks is not None and kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.device = torch.device(device)
        config = load_config(model_dir, model_impl)  # model_impl: auto, native or transformers
        check_tensor_parallel(config, tensor_parallel_size)
        tp = TensorParallel(0, tensor_parallel_size)  # this runner is rank 0, the driver
        num_threads = torch_threads(tp, self.device, num_threads)
        keep_heap(self.device)  # the next step reuses this one's pages (worker/sizing.py)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        with single_threaded():  # the probe's ops start no OpenMP team in this thread
            check_device_dtype(self.device, self.dtype)  # one line, not a failure mid-load
        # The shape lets `auto` fall back to torch where no kernel fits, and compiles the
        # kernels now rather than inside the first step.
        self.backend = select_backend(attention_backend, self.device, dtype=self.dtype,
                                      head_dim=head_dim_of(config), block_size=block_size)
        self.backend_name: str = self.backend.name
        self.vocab_size: int = config.vocab_size
        info = info if info is not None else read_model_info(model_dir)
        self.max_model_len: int = info.max_model_len
        self.eos_token_ids: tuple[int, ...] = info.eos_token_ids
        self.block_size, self._model_dir = block_size, str(model_dir)
        self.grammars = Grammars(self._model_dir, self.vocab_size, self.eos_token_ids)
        self.masks = MaskFiller(self.vocab_size, self.device)  # its thread: on first use
        # Per rank: its share of the KV heads, in the same block layout on every rank.
        num_kv_heads, head_dim = tp.kv_heads(config.num_key_value_heads), head_dim_of(config)
        num_layers = config.num_hidden_layers
        block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * self.dtype.itemsize
        if num_blocks is None:
            num_blocks = default_num_blocks(  # a draft model's blocks share the budget
                self.device, self.max_model_len, block_size, kv_cache_bytes,
                block_bytes + draft_block_bytes(draft_model, block_size, self.dtype))
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks: int = num_blocks
        # Ranks 1..N-1 load their shards while this process loads its own (actorllm.worker.ranks).
        self.ranks: RankGroup | None = RankGroup(RankSpec(
            str(model_dir), tp.world, num_blocks, block_size,
            str(self.dtype).removeprefix("torch."), device, self.backend_name, num_threads,
        ), rendezvous) if tp.enabled else None
        # The step thread's team, per step; with tensor parallelism no share, no choice by cost.
        solo = not tp.enabled
        self.threads = StepThreads(self.device.type, large=large_step_threads,
                                   share=worker_share() if solo else None, choose=solo)
        self._load(model_dir, config, tp, draft_model, cuda_graph_rows)
        self.pooler = Pooler()  # embedding requests' pooled hidden states
        # The persistent batch: each held rid's block table and sampling columns, one slot.
        self.tables = BlockTables(num_blocks, block_size, self.max_model_len)
        fused = load_sampler() if self.device.type == "cpu" else None
        self.sampling = SamplingBatch(self.vocab_size, self.device, self.eos_token_ids, fused=fused)
        # Rids of the last step if it failed: a feed of their last sample gets a stand-in.
        self._failed_rids: frozenset[str] = frozenset()
        self.ahead = AheadLookup()  # rows planned ahead: what their lookups read
        self.fed_forward = 0  # rows that fed a sampled token forward (overlap scheduling)
        self.one_op_steps = self.logits_in_op_steps = self.drawn_in_op_steps = 0
        log.info("model runner: %s (%s) on %s x%d (%s, %s attention, %s%s), %d KV blocks "
                 "of %d tokens (%.1f MiB per rank)", config.architectures[0],
                 model_impl_of(config), self.device, tp.world,
                 self.dtype, self.backend_name,
                 "linears laid out at load" if self.packed_linears else "torch linears",
                 ", decode steps in one op" if self.decode_step is not None else "",
                 num_blocks, block_size, num_blocks * block_bytes / 2**20)

    def _load(self, model_dir: str | Path, config: PretrainedConfig, tp: TensorParallel,
              draft_model: str | None, graph_rows: int) -> None:
        """Weights and KV cache here, and the ranks connected; on failure the ranks stop."""
        try:
            check_graphs(graph_rows, self.device, tp.enabled, model_impl_of(config))
            with single_threaded():  # no OpenMP team in this thread: see ops/threads.py
                self.model = load_model(model_dir, dtype=self.dtype, device=self.device,
                                        config=config, tp=tp)
                self.packed_linears = pack_linears(self.model) \
                    if self.device.type == "cpu" and model_impl_of(config) == "native" else 0
                self.kv_caches: list[KVCache] = allocate_kv_caches(
                    config, self.num_blocks, self.block_size, self.dtype, self.device, tp)
                self.draft = DraftModel(draft_model, config, self.kv_caches,
                                        self.backend) if draft_model else None
            # A busy server's steps are mostly decode: on the CPU they run as one op call
            # (ops/cpu_step.py), which releases the GIL once instead of once per op.
            self.decode_step = load_decode_step(self.model, self.backend) \
                if self.device.type == "cpu" and not tp.enabled else None
            self.graphs = DecodeGraphs(lambda b: self.model(b, self.kv_caches, self.backend),
                graph_rows, self.max_model_len, self.block_size, self.device) \
                if graph_rows else None
            if self.ranks is not None:
                self.ranks.connect()
                weakref.finalize(self, self.ranks.close)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (also done when the runner is collected)."""
        if self.ranks is not None:
            self.ranks.close()

    def drop_all(self) -> None:
        """Drop every rid's sampling state (a new Scheduler starts from nothing)."""
        self.sampling.clear()
        self.grammars.clear()
        self.tables.clear()
        self.ahead.clear()
        self.pooler.clear()
        self.threads.end_run()

    @property
    def num_states(self) -> int:
        """How many rids have sampling state here (for tests and leak checks)."""
        return len(self.sampling)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: forward every scheduled token, sample the ``sample=True`` rows.

        Never raises: a failure is logged and returned as ``StepResult(error=...)``.
        """
        try:
            with torch.inference_mode():
                result = self._execute(plan)
        except Exception as exc:
            log.exception("step %d failed", plan.step_id)
            self._failed_rids = frozenset(plan.rids)
            return StepResult(step_id=plan.step_id, error=f"{type(exc).__name__}: {exc}")
        self._failed_rids = frozenset()
        return result

    def _execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        last_step = self._take_news_and_drops(plan)
        result = StepResult(step_id=plan.step_id)
        sample_s = pack_s = 0.0
        drafted: tuple[int, ...] = ()
        kinds: tuple[int, ...] = ()
        if plan.ahead is not None:  # started and drafted for here (worker/ahead.py)
            plan, drafted, kinds = self.ahead.resolve(
                plan, self.tables.slot_of, self.sampling.cols, self._failed_rids)
        if plan.rids:
            rows = self.tables.apply(plan)  # before any check: the diffs are always kept
            slots = rows[np.asarray(plan.sample, dtype=bool)]  # the sampling rows' slots
            self.sampling.check_known(plan, rows, slots)
            # The constrained rows' masks are computed in a thread during the forward pass
            # (their matchers are past every token sampled so far); free batches skip it.
            masks = self.masks.start([self.sampling.grammars[s] for s in slots.tolist()]) \
                if self.grammars else None
            try:
                tp = time.perf_counter()
                batch = self._pack(plan, rows)
                pack_s = time.perf_counter() - tp
                if self.draft is not None:  # its drafts replace the plan's placeholders
                    plan, batch = self.draft.fill(plan, batch)
                self.threads.use_for(batch.input_ids.shape[0], len(plan.num_tokens), t0)
                hidden, logits, drawn = self._forward(plan, batch, slots, masks is None)
            finally:
                if masks is not None:
                    masks.wait()  # no thread may touch a matcher after the step
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # so forward_s measures the forward
            t1 = time.perf_counter()
            prompt_lps: tuple[PromptLogprobs, ...] = ()
            if plan.lp_rows:
                joined = {plan.rids[i]: self.sampling.joined[int(rows[i])]
                          for i in plan.lp_rows}
                prompt_lps = prompt_logprobs(hidden, plan.seqs, joined,  # type: ignore[arg-type]
                                             self.model.compute_logits)
            pooled = self.pooler.take(hidden, plan, pooled_norm(self.model))
            verified, logits, drawn = verify_step(logits, drawn, plan, slots, self.sampling)
            self.ahead.ran(plan, verified)  # (what a row planned ahead next continues)
            if masks is not None:
                masks.apply(logits)
            result = attrs.evolve(self._sample(plan.step_id, logits, slots, verified, drawn),
                                  prompt_logprobs=prompt_lps, pooled=pooled,
                                  ahead_drafted=drafted, ahead_kinds=kinds)
            sample_s = time.perf_counter() - t1
        for rid in plan.drop:
            if rid in last_step:
                self._drop(rid)
        forward_s = time.perf_counter() - t0 - sample_s - pack_s
        return attrs.evolve(result, forward_s=forward_s, sample_s=sample_s, pack_s=pack_s)

    def _forward(self, plan: StepPlan, batch: ForwardBatch, slots: np.ndarray, free: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The forward pass, the sampling rows' logits and, when the op drew them, their
        tokens: ``(hidden, logits, tokens or None)``.

        Every step runs in the one op where it can, a prefill chunk a row per token
        (pack_plan's ``one_token``). A step whose every token samples, with no prompt
        logprobs or pooling to read the hidden states, gets its logits from the op
        (``hidden`` is then those logits, read by nobody); when nothing else touches them
        (``free``: no grammar; SamplingBatch.op_temperatures) the op draws the tokens too
        (a verify step's at every position, drafting rows greedy: drawn_temperatures)."""
        step = self.decode_step
        if step is not None and step.applies(batch := one_token_rows(plan, batch)):
            self.one_op_steps += 1
            self.one_op_draft_steps += bool(plan.num_drafts)
            if step.makes_logits and len(slots) == len(plan.rids) and not plan.lp_rows \
                    and not len(self.pooler) and every_token_samples(batch):
                self.logits_in_op_steps += 1
                temps = self.sampling.op_temperatures(slots) if free else None
                if temps is not None and plan.num_drafts:  # (a draw at each position)
                    temps = drawn_temperatures(temps, plan)
                if temps is not None:
                    self.drawn_in_op_steps += 1
                    tokens = step(batch, self.kv_caches, logits=True, greedy_below=GREEDY_BELOW,
                                  temperature=torch.from_numpy(temps), helper=self.threads.helper)
                    return tokens, tokens, tokens
                logits = step(batch, self.kv_caches, logits=True)
                return logits, logits, None
            hidden = step(batch, self.kv_caches)
        elif self.graphs is not None and self.graphs.applies(batch):
            hidden = self.graphs.run(batch)
        elif self.ranks is None:
            hidden = self.model(batch, self.kv_caches, self.backend)
        else:
            hidden = self.ranks.forward(self.model, batch, self.kv_caches, self.backend)
        return hidden, self.model.compute_logits(hidden[batch.sample_indices]), None

    def _sample(self, step_id: int, logits: torch.Tensor, slots: np.ndarray,
                verified: dict[int, list[int]], drawn: torch.Tensor | None) -> StepResult:
        """Sample the step's sampling rows (slots ``slots``), unless the op ``drawn`` them,
        and record their tokens; the rows in ``verified`` (speculation) were committed
        already and emit those tokens."""
        tokens, token_ids, lp_rows, lps = (drawn, drawn.tolist(), [], []) if drawn is not None \
            else no_draw(slots, verified) or self.sampling.sample(logits, slots, inplace=True)
        refused, ids, num_sampled = commit_others(self.sampling, slots, tokens, token_ids,
                                                  verified)
        return StepResult(
            step_id=step_id, token_ids=ids, logprob_rows=tuple(lp_rows), logprobs=tuple(lps),
            refused_rows=tuple(j for j, _ in refused), refused=tuple(why for _, why in refused),
            num_sampled=num_sampled)

    def _take_news_and_drops(self, plan: StepPlan) -> set[str]:
        """Apply the plan's drops and ``NewSeqData``; returns the rids running their last
        step. A rid both dropped and scheduled without ``new`` is running its last step: it
        is dropped afterwards. Every other drop (incl. one re-sent with ``new``) happens first."""
        last_step: set[str] = set()
        if plan.drop:
            news = {plan.rids[i] for i in plan.new_rows}
            last_step = {rid for rid in plan.rids if rid not in news}
            for rid in plan.drop:
                if rid not in last_step:
                    self._drop(rid)
        for i, new in zip(plan.new_rows, plan.new, strict=True):
            rid = plan.rids[i]
            held = self.tables.slot_of.get(rid)
            if held is not None:  # back after preemption: its old row is gone
                self.sampling.remove(held)
            self.tables.reset(rid)  # ... and so is its old table
            self.ahead.drop(rid)  # ... and its lookup's tokens
            self.pooler.start(rid, new)  # a recompute pools from the start again
            self.sampling.add(self.tables.slot_of[rid], SamplingState(
                new.params, new.prompt_token_ids, new.output_token_ids,
                self.grammars.fresh(rid, new),
            ))
        return last_step

    def _last_sample(self, rid: str, position: int) -> int:
        """The token this runner sampled for ``rid`` last, fed forward to ``position``.

        If the step that was to sample it failed, the Scheduler has failed the sequence
        and drops what this step makes for it: any token will do (its blocks are still
        fenced, so writing its K/V harms nobody).
        """
        if rid in self._failed_rids:
            return 0
        slot = self.tables.slot_of.get(rid)
        cols = self.sampling.cols
        if slot is None or not cols["occupied"][slot] or not cols["num_out"][slot]:
            raise ValueError(f"rid {rid!r}: fed its last sample, but none was sampled")
        expected = int(cols["prompt_len"][slot] + cols["num_out"][slot]) - 1
        if position != expected:
            raise ValueError(f"rid {rid!r}: its last sample is at position {expected}, "
                             f"fed to {position}")
        self.fed_forward += 1
        return int(cols["last_token"][slot])

    def _last_samples(self, plan: StepPlan, rows: np.ndarray, slots: np.ndarray,
                      positions: np.ndarray) -> np.ndarray:
        """``_last_sample`` for plan rows ``rows`` (at ``slots``) at once: a column read
        when every one of them checks out, else row by row (for the stand-ins and the
        errors)."""
        cols = self.sampling.cols
        num_out = cols["num_out"][slots]
        if not self._failed_rids and cols["occupied"][slots].all() and num_out.all() \
                and (cols["prompt_len"][slots] + num_out - 1 == positions).all():
            self.fed_forward += len(slots)
            return cols["last_token"][slots]
        return np.asarray([self._last_sample(plan.rids[i], p) for i, p in zip(
            rows.tolist(), positions.tolist(), strict=True)], dtype=np.int64)

    def _drop(self, rid: str) -> None:
        slot = self.tables.slot_of.get(rid)
        self.ahead.drop(rid)
        if slot is not None:
            self.sampling.remove(slot)
        self.pooler.drop(rid)
        self.tables.drop(rid)
        self.grammars.discard(rid)

    def _prepare(self, plan: StepPlan) -> ForwardBatch:
        """The plan's block-table diffs applied and the plan packed (worker/packing.py)."""
        return self._pack(plan, self.tables.apply(plan))

    def _pack(self, plan: StepPlan, rows: np.ndarray) -> ForwardBatch:
        return pack_plan(plan, self.tables, rows, self.max_model_len, self.device,
                         functools.partial(self._last_samples, plan),
                         self.decode_step is not None and self.draft is None)

