"""The scripted Worker with a draft model (``SimConfig.draft_model``: the method
``draft_model``), as worker/draft.py does it: the Scheduler's plans carry placeholders
(``DRAFT_PLACEHOLDER``) where a speculating row's drafts go, and the Worker fills them
before the target runs.

Every step, before the target, the simulated draft runs over the whole plan: each row's
known tokens (a fed-forward token resolved first), then, for a speculating row at
position p, its proposals d1..dK at p+1..p+K. Its proposals are scripted tokens of their
own (a salt apart from the target's); the verdict stays the base Worker's (the test's
salt picks how many are accepted), and the accepted ones are the draft's tokens, which
then reach the output and every later fed token.

The draft keeps its own cache, indexed by the same block ids and slots as the target's
(``draft_kv``, the same oracle as ``kv``): before the draft reads a row's earlier
positions each must hold that row's prefix, so a position the draft never wrote (its last
pass skipped: d_K's K/V missing when every draft is accepted), or one whose rejected
draft was not written again, is caught as invariant 9, as the target's are.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from actorllm.scheduler.speculation import DRAFT_PLACEHOLDER
from actorllm.wire.messages import FEED_LAST_SAMPLE, ScheduledSeq, StepPlan, StepResult

from .scripted_worker import ScriptedWorker, scripted_token

DRAFT_SALT = 0x5EED  # the draft's tokens are its own, not the target's


class DraftingWorker(ScriptedWorker):
    """The actor, with a draft model's proposals and cache."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.draft_kv: dict[int, tuple[int, ...] | None] = {}  # slot -> prefix (None: garbage)
        self.drafts_filled = 0  # speculating rows whose placeholders the draft replaced

    def _fill(self, plan: StepPlan, tables: dict[str, tuple[int, ...]],
              salt: int) -> StepPlan:
        """Run the draft over ``plan``: check what it reads in its cache, write what it
        computes, and return the plan with each speculating row's placeholders replaced
        by the draft's proposals (what the target then runs and verifies)."""
        ids = list(plan.token_ids)
        drafts = plan.num_drafts or (0,) * plan.num_rows
        writes: list[tuple[int, tuple[int, ...] | None]] = []
        at = 0
        for s, d in zip(plan.seqs, drafts, strict=True):
            n, table = len(s.token_ids), tables[s.rid]
            if len(table) * self.block_size >= s.start_pos + n:  # (else _run_kv reports it)
                proposals = self._propose(plan.step_id, s, d, salt)
                writes += self._draft_passes(plan.step_id, s, d, proposals, table)
                ids[at + n - d:at + n] = proposals
            at += n
        self.draft_kv.update(writes)
        return attrs.evolve(plan, token_ids=tuple(ids))

    def _propose(self, step: int, s: ScheduledSeq, d: int, salt: int) -> list[int]:
        """The draft's greedy tokens for a row's ``d`` placeholders."""
        if any(t != DRAFT_PLACEHOLDER for t in s.token_ids[len(s.token_ids) - d:]):
            self.protocol_errors.append(f"step {step}: {s.rid!r}'s drafts "
                                        f"{s.token_ids[-d:]} are not placeholders")
        self.drafts_filled += d > 0
        first = s.start_pos + len(s.token_ids) - d
        return [scripted_token(self.vocab, s.rid, first + j, salt + DRAFT_SALT)
                for j in range(d)]

    def _draft_passes(self, step: int, s: ScheduledSeq, d: int, proposals: list[int],
                      table: Sequence[int]) -> list[tuple[int, tuple[int, ...] | None]]:
        """The draft's reads (checked) and writes for one row: its known tokens, then
        one pass per draft, the last writing d_K (read once all K are accepted)."""
        n = len(s.token_ids)
        last = self.last_sample.get(s.rid)
        stale = last is not None and last[1] == -1  # a failed step's stand-in (as _run_kv)
        ctx = self.contexts.get(s.rid, [])
        known = [last[1] if t == FEED_LAST_SAMPLE and last is not None else t
                 for t in s.token_ids[:n - d]]
        if not stale:
            self._check_reads(self.draft_kv, table, ctx, s.start_pos,
                              f"step {step}: the draft model of {s.rid!r}")
        tokens = [*ctx[:s.start_pos], *known, *proposals]
        return [(self._slot(table, p), None if stale else tuple(tokens[:p + 1]))
                for p in range(s.start_pos, s.start_pos + self._written(n, d))]

    def _written(self, n: int, d: int) -> int:
        """How many of a row's ``n`` positions the draft writes: all of them (the known
        tokens, and d1..dK in its K passes)."""
        return n

    def _verify(self, s: ScheduledSeq, d: int, salt: int, table: Sequence[int]) -> list[int]:
        """The base verdict; the draft's K/V of the rejected positions is garbage too."""
        accepted = super()._verify(s, d, salt, table)
        end = s.start_pos + len(s.token_ids)
        for p in range(end - d + len(accepted), end):
            self.draft_kv[self._slot(table, p)] = None
        return accepted

    def fail(self) -> StepResult:
        """A failed step: the draft may have half run, so its slots are garbage too."""
        plan, tables = self.pending[0]
        for s in plan.seqs:
            table = tables[s.rid]
            for p in range(s.start_pos, min(s.start_pos + len(s.token_ids),
                                            len(table) * self.block_size)):
                self.draft_kv[self._slot(table, p)] = None
        return super().fail()
