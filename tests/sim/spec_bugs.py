"""Planted bugs of speculative decoding (``SimConfig.speculative``), as ``bugs.py``'s:
each overrides one ordinary method of the real Scheduler or of its Batch, or (with
``SimConfig.draft_model``) of the scripted Worker's draft model (sim/scripted_draft.py),
which stands for worker/draft.py."""

from __future__ import annotations

from typing import Any

import attrs

from actorllm.scheduler.actor import Scheduler
from actorllm.scheduler.batch import Batch
from actorllm.scheduler.kv_pool import extend_hashes
from actorllm.scheduler.sequence import Sequence
from actorllm.scheduler.speculation import DRAFT_PLACEHOLDER, row_tokens
from actorllm.wire.messages import StepPlan, StepResult

from .scripted_draft import DraftingWorker


def _all_accepted(plan: StepPlan, result: StepResult) -> StepResult:
    """``result`` with every speculating row's drafts taken as accepted: the drafts the
    plan proposed, then the last token the Worker gave the row."""
    tokens: list[int] = []
    counts: list[int] = []
    t = 0
    rows = iter(row_tokens(result))
    for n, sampled, d in zip(plan.num_tokens, plan.sample, plan.num_drafts, strict=True):
        if sampled:
            row = next(rows)
            if d:
                row = (*plan.token_ids[t + n - d:t + n], row[-1])
            tokens.extend(row)
            counts.append(len(row))
        t += n
    return StepResult(result.step_id, tuple(tokens), num_sampled=tuple(counts))


class CommitRejectedDraft(Scheduler):
    """Invariant 7: a speculating row commits every draft it proposed, as if the Worker's
    verdict always were 'all accepted': a rejected draft reaches the output."""

    def on_result(self, result: StepResult) -> None:
        plan = self.in_flight[0] if self.in_flight else None
        if plan is not None and plan.step_id == result.step_id and plan.num_drafts \
                and result.num_sampled and result.error is None:
            result = _all_accepted(plan, result)
        super().on_result(result)


class FreeDraftBlocksEarly(Scheduler):
    """Invariant 3: a sequence that finishes (abort, stop string) while its draft step is
    in flight gives back at once the blocks that hold only draft positions, which that
    step is still writing."""

    def _finish(self, seq: Sequence, *args: Any, **kwargs: Any) -> None:
        if seq.drafting and seq.in_flight:
            keep = self.pool.blocks_for(seq.num_computed + 1)
            extra = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.pool.free(reversed(extra))
        super()._finish(seq, *args, **kwargs)


class _HashDraftsBatch(Batch):
    def _draft(self, seq: Sequence, budget: int) -> int:
        n = super()._draft(seq, budget)
        if seq.drafts:
            # The bug: the blocks a row's drafts complete are hashed while planning, over
            # the drafts, before any verdict; a rejected draft's hash stays.
            tokens = [*seq.prompt_ids, *seq.output_ids, *seq.drafts]
            extend_hashes(seq.block_hashes, tokens, self.pool.block_size, len(tokens))
        return n


class HashRejectedDraft(Scheduler):
    """Invariant 9: a block hash computed over a rejected draft token (the block would be
    cached under tokens the sequence does not hold)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        old = self.batch
        self.batch = _HashDraftsBatch(
            old.pool, old.ledger, max_num_seqs=old.max_num_seqs,
            max_num_batched_tokens=old.max_num_batched_tokens, priority=old.priority,
            speculation=old.speculation)


class UnfilledPlaceholder(DraftingWorker):
    """Invariant 9 (draft_model): the target runs the packed ids before the draft's
    tokens were put in them, so the K/V at the draft positions is computed over the
    placeholders while the verdict accepts the draft's tokens."""

    def _run_kv(self, plan: StepPlan, tables: dict[str, tuple[int, ...]],
                failed: bool = False) -> None:
        if plan.num_drafts:
            ids, at = list(plan.token_ids), 0
            for n, d in zip(plan.num_tokens, plan.num_drafts, strict=True):
                ids[at + n - d:at + n] = [DRAFT_PLACEHOLDER] * d
                at += n
            plan = attrs.evolve(plan, token_ids=tuple(ids))
        super()._run_kv(plan, tables, failed)


class DraftSkipsLastPass(DraftingWorker):
    """Invariant 9 (draft_model): the draft's last pass, which only writes d_K's K/V, is
    skipped as useless; when all K drafts are accepted the next step's draft reads that
    position from its cache, where nothing was written."""

    def _written(self, n: int, d: int) -> int:
        return n - 1 if d else n


SPEC_BUGS: dict[str, type[Any]] = {
    "worker.bug_unfilled_placeholder": UnfilledPlaceholder,
    "worker.bug_draft_skips_last_pass": DraftSkipsLastPass,
    "scheduler.bug_commit_rejected_draft": CommitRejectedDraft,
    "scheduler.bug_free_draft_blocks_early": FreeDraftBlocksEarly,
    "scheduler.bug_hash_rejected_draft": HashRejectedDraft,
}
