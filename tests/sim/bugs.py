"""Planted bugs: deliberately wrong variants of the actors, for tests that must fail.

Production modules carry no switches for these. Each bug is a mixin that overrides one
ordinary method of the real actor (``Frontend._check_unique``, ``Scheduler._pass_fence``,
...) or hands it a faulty part through its constructor (the Frontend's ``pacing``, the
Scheduler's ``pool``); the
simulation (``SimConfig.bugs``) builds each actor from its class plus the mixins named
for it, so the rest of the actor is the real code. tests/test_planted_bugs.py shows that
the harness catches each; the names are ``"<actor>.bug_<what>"``.
"""

from __future__ import annotations

from typing import Any

import trio

from actorllm.detokenizer.actor import DecodeState, Detokenizer
from actorllm.frontend.actor import Frontend
from actorllm.frontend.collector import OutputCollector
from actorllm.frontend.readers import Flow, ReaderPacing
from actorllm.frontend.state import RequestState
from actorllm.scheduler.actor import Scheduler
from actorllm.scheduler.batch import Batch
from actorllm.scheduler.kv_pool import BlockPool
from actorllm.scheduler.policy import arrival_victim
from actorllm.scheduler.sequence import Sequence
from actorllm.tokenizer.actor import Tokenizer, input_chars
from actorllm.wire.messages import GenerateRequest, StepPlan
from actorllm.wire.outputs import Merged

from .scripted_worker import ScriptedWorker
from .spec_bugs import SPEC_BUGS


class RegisterAfterDispatch(Frontend):
    """Invariant 1: the GenerateRequest leaves before the rid is registered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._late: dict[str, tuple[OutputCollector, dict[str, Any]]] = {}

    def _register(self, rid: str, collector: OutputCollector, **leaf: Any) -> None:
        self._late[rid] = (collector, leaf)

    async def _dispatch(self, rid: str, msg: GenerateRequest) -> None:
        await self.tokenizer.send(msg)
        collector, leaf = self._late.pop(rid)
        super()._register(rid, collector, **leaf)
        self.ledger.fire(rid, "dispatch")


class ReuseLiveRid(Frontend):
    """Invariant 2: a rid accepted while it is still live."""

    def _check_unique(self, rids: list[str]) -> None:
        pass


class SkipChildAbort(Frontend):
    """Invariant 5: aborting a n>1 parent reaches only its first live child."""

    def _abort_targets(self, st: RequestState) -> list[RequestState]:
        return super()._abort_targets(st)[:1]


class EndParentEarly(Frontend):
    """Invariant 6: a n>1 parent gathered when its first child is released."""

    def _gatherable(self, parent: RequestState) -> bool:
        return True


class FreeBeforeFence(Scheduler):
    """Invariant 3: a finished sequence's blocks freed while a step still reads them."""

    def _finish(self, seq: Sequence, *args: Any, **kwargs: Any) -> None:
        super()._finish(seq, *args, **kwargs)
        if seq in self.fenced:  # the bug: it goes back without waiting for the fence
            self.fenced.remove(seq)
            self._free(seq)


class FenceOneStep(Scheduler):
    """Invariant 3 with two steps in flight: a fenced sequence freed when the first of the
    steps that name it returns, while the step planned ahead still reads its blocks."""

    def _pass_fence(self) -> bool:
        fenced, self.fenced = self.fenced, []
        for seq in fenced:
            self._free(seq)
        return bool(fenced)


def _planted_batch(base: Scheduler, batch_class: type[Batch]) -> None:
    """Give a Scheduler just built a batch of ``batch_class``, with the same settings."""
    old = base.batch
    base.batch = batch_class(old.pool, old.ledger, max_num_seqs=old.max_num_seqs,
                             max_num_batched_tokens=old.max_num_batched_tokens,
                             priority=old.priority, speculation=old.speculation)


class _RereportBatch(Batch):
    def drop_kv(self, seq: Sequence) -> None:
        super().drop_kv(seq)
        if seq.prompt_lps_next:
            seq.prompt_lps_next = 1


class RereportPromptLogprobs(Scheduler):
    """Invariant 7: a recompute after preemption reports prompt logprobs again."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _planted_batch(self, _RereportBatch)


# The prefix cache's bugs live in the pool: each is planted as a Scheduler given a wrong
# pool through its ``pool`` argument.


def _planted_pool(pool_class: type[BlockPool], kwargs: dict[str, Any]) -> dict[str, Any]:
    return {**kwargs, "pool": pool_class(kwargs["num_blocks"], kwargs.get("block_size", 16),
                                         kwargs.get("enable_prefix_caching", True))}


class _CachesSharedBlockPool(BlockPool):
    def free(self, blocks: Any) -> None:
        blocks = list(blocks)
        super().free(blocks)
        for b in blocks:  # the bug: a cached block stays evictable while others hold it
            if b in self.refs and b in self.hash_of:
                self._cached[b] = None


class CacheSharedBlock(Scheduler):
    """Invariant 8: a shared cached block becomes evictable when one holder lets go."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **_planted_pool(_CachesSharedBlockPool, kwargs))


class _KeepEvictedHashPool(BlockPool):
    def _evict(self, block: int) -> None:
        pass  # the bug: the block is reused, its old hash still names it


class KeepEvictedHash(Scheduler):
    """Invariant 9: an evicted block is overwritten while its hash still finds it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **_planted_pool(_KeepEvictedHashPool, kwargs))


class _ShareWithoutReferencePool(BlockPool):
    def share(self, blocks: Any) -> None:
        # The bug: a hit on a block in use takes no reference of its own.
        super().share([b for b in blocks if b not in self.refs])


class ShareWithoutReference(Scheduler):
    """Invariant 10: a prefix-cache hit on a block in use does not count its new holder."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **_planted_pool(_ShareWithoutReferencePool, kwargs))


class EmitAfterStop(Detokenizer):
    """Invariant 2: text delivered after the stop string matched."""

    def _emitting(self, st: DecodeState) -> bool:
        return True


class _KeepSlotBatch(Batch):
    def apply_pauses(self) -> None:
        running = list(self.running)
        super().apply_pauses()
        self.running[:] = running


class PauseKeepsSlot(Scheduler):
    """Invariant 11: a paused sequence stays in the running batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _planted_batch(self, _KeepSlotBatch)


class _NeverResumePacing(ReaderPacing):
    def resume(self, col: OutputCollector, flow: Flow) -> None:
        pass  # the bug: the reader caught up, its request stays paused


class NeverResume(Frontend):
    """Invariant 11: a reader that catches up is never resumed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, pacing=_NeverResumePacing, **kwargs)


class _DropOnPausePacing(ReaderPacing):
    def pace(self, col: OutputCollector) -> None:
        super().pace(col)
        if self.paused(col):
            col._pending.clear()  # the bug: what waited for the reader is gone


class DropOnPause(Frontend):
    """Invariant 7: what a reader had not read is dropped when its request is paused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, pacing=_DropOnPausePacing, **kwargs)


class IgnoreForget(ScriptedWorker):
    """Invariant 4: the Worker keeps sampling state for freed rids."""

    def _drop(self, plan: StepPlan, last_step: bool) -> None:
        pass


class StaleBlockRow(ScriptedWorker):
    """Invariant 9: a block-table row let go (the rid dropped after an abort, a finish or a
    preemption) is handed to the next rid without being emptied: it reads stale blocks."""

    def _forget_table(self, rid: str) -> None:
        row = self.tables.pop(rid, None)
        if row is not None:
            self._free_rows.append(row)  # the bug: not cleared


PLANTED: dict[str, type[Any]] = {
    "frontend.bug_register_after_dispatch": RegisterAfterDispatch,
    "frontend.bug_reuse_live_rid": ReuseLiveRid,
    "frontend.bug_skip_child_abort": SkipChildAbort,
    "frontend.bug_end_parent_early": EndParentEarly,
    "scheduler.bug_free_before_fence": FreeBeforeFence,
    "scheduler.bug_fence_one_step": FenceOneStep,
    "scheduler.bug_rereport_prompt_logprobs": RereportPromptLogprobs,
    "scheduler.bug_cache_shared_block": CacheSharedBlock,
    "scheduler.bug_keep_evicted_hash": KeepEvictedHash,
    "scheduler.bug_share_without_reference": ShareWithoutReference,
    "detokenizer.bug_emit_after_stop": EmitAfterStop,
    "worker.bug_ignore_forget": IgnoreForget,
    "worker.bug_stale_block_row": StaleBlockRow,
    # flow control (SimConfig.flow)
    "scheduler.bug_pause_keeps_slot": PauseKeepsSlot,
    "frontend.bug_never_resume": NeverResume,
    "frontend.bug_drop_on_pause": DropOnPause,
}


class DroppingMerged(Merged):
    """Merging a delta into pending text loses what was pending."""

    def add(self, out: Any) -> None:
        if self.text:
            self.text.clear()
        super().add(out)


class DroppingCollector(OutputCollector):
    """collector.bug_drop_merged: a collector that folds with :class:`DroppingMerged`."""

    def _merged(self, index: int) -> Merged:
        p = self._pending.get(index)
        if p is None:
            p = self._pending[index] = DroppingMerged()
        return p


# Not an actor's: the harness (_watch_collector) makes each collector it watches one of
# these as it appears, before any output reaches it.
COLLECTOR_BUGS: dict[str, type[OutputCollector]] = {
    "collector.bug_drop_merged": DroppingCollector}


def actor_class(actor: str, base: type[Any], bugs: frozenset[str]) -> type[Any]:
    """``base``, or a class combining it with the bugs planted in ``actor``."""
    unknown = bugs - PLANTED.keys() - COLLECTOR_BUGS.keys()
    if unknown:
        raise ValueError(f"no planted bug {sorted(unknown)}")
    mixins = [PLANTED[b] for b in sorted(bugs) if b.split(".")[0] == actor]
    if not mixins:
        return base
    return type(f"Buggy{base.__name__}", (*mixins, base), {})


# --- the bugs of tests/test_simulation.py's newer configurations ---------------------------


class TokenizeBigAside(Tokenizer):
    """Invariant 5 (an abort never overtakes its request): big inputs are tokenized in a
    task of their own so the loop goes on with the next message, and an abort that came
    behind the request leaves before it. (SimConfig.inline_chars sends prompts there.)"""

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            async for msg in self.inbox:
                if isinstance(msg, GenerateRequest) and input_chars(msg) > self.inline_chars:
                    nursery.start_soon(self.handle, msg)
                else:
                    await self.handle(msg)


class LoseSkipsAnswered(Frontend):
    """Invariant 4 after the engine died: a request whose client was answered but whose
    blocks the Scheduler had not freed yet is left registered, waiting for a free that
    will never come (so is its rid, for ever)."""

    def lose_all(self, message: str, replica: int | None = None) -> int:
        kept = {rid: st for rid, st in self.registry.items()
                if st.responded and st.parent is None}
        for rid in kept:
            del self.registry[rid]
        try:
            return super().lose_all(message, replica)
        finally:
            self.registry.update(kept)


class TimeoutWithoutAbort(Frontend):
    """Invariant 5 with a stream timeout: the stalled reader gets its error, but the engine
    is never told, and generates for nobody until the request ends by itself."""

    def _abort_for_lag(self, leaves: list[RequestState]) -> None:
        pass


class _PreemptAheadBatch(Batch):
    def plan(self, ahead: bool) -> Any:
        # The bug: an urgent arrival preempts even while a step that names the victim runs
        # (the real plan() leaves that to the plain path, once the pipeline has drained).
        while self.priority and ahead and (
                v := arrival_victim(self.waiting, self.running, self.can_start)):
            self.running.remove(v)
            self.drop_kv(v)
            self.waiting.add(v, preempted=True)
            self.ledger.fire(v.rid, "preempt")
        return super().plan(ahead)


class PreemptAhead(Scheduler):
    """Invariant 3 with the priority policy and two steps in flight: an urgent arrival
    preempts a sequence whose blocks the step in flight still reads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _planted_batch(self, _PreemptAheadBatch)


PLANTED.update({
    # the Tokenizer's thread hop (SimConfig.inline_chars)
    "tokenizer.bug_tokenize_big_aside": TokenizeBigAside,
    # engine death (SimConfig.engine_death)
    "frontend.bug_lose_skips_answered": LoseSkipsAnswered,
    # stream timeout (SimConfig.flow with a stream_timeout)
    "frontend.bug_timeout_without_abort": TimeoutWithoutAbort,
    # priority with two steps in flight (SimConfig.scheduling_policy)
    "scheduler.bug_preempt_ahead": PreemptAhead,
    # speculative decoding (SimConfig.speculative)
    **SPEC_BUGS,
})
