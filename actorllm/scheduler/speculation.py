"""Speculative decoding's Scheduler side: n-gram proposals (prompt lookup), when a row
may carry them, and the counters of what the Worker accepted. With a draft model the
proposals are placeholders: the Worker's draft fills them (worker/draft.py).

The Scheduler owns each sequence's tokens, so proposals are made here, while planning: a
decode row runs ``[last token, drafts...]`` (``StepPlan.num_drafts``), the Worker
verifies the drafts against the model and returns the accepted ones plus one token of
its own (``StepResult.num_sampled``). docs/architecture.md, "Speculative decoding".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from itertools import repeat

import numpy as np

from actorllm.config import SpeculativeConfig
from actorllm.scheduler.sequence import Sequence
from actorllm.wire.steps import StepPlan, StepResult

#: After a proposal of which nothing was accepted, a row proposes nothing for 2, 4, 8, ...
#: steps (at most this many): text the proposer cannot predict costs few drafting steps.
MAX_BACKOFF = 64
#: What a draft_model row carries where its drafts go: the Scheduler never knows them.
DRAFT_PLACEHOLDER = 0


def propose_ngram(tokens: Seq[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: for n from ``n_max`` down to ``n_min``, the tokens (at most ``k``)
    that followed the latest earlier occurrence of the last n tokens; [] if none occurs."""
    length = len(tokens)
    top = min(n_max, length - 1)
    if k < 1 or top < max(n_min, 1):
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    # Every occurrence of a suffix ends at an earlier copy of the last token: only those
    # are extended backwards (a row pays this every step, usually for no proposal).
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    run = np.ones(len(ends), dtype=np.int64)  # each one's match length, up to ``top``
    alive = ends >= 1
    for m in range(1, top):
        idx = np.flatnonzero(alive)
        if not len(idx):
            break
        at = ends[idx] - m
        same = arr[at] == arr[length - 1 - m]
        run[idx[same]] += 1
        alive[idx] = same & (at >= 1)
    if not len(run) or run.max() < n_min:
        return []
    i = int(ends[np.flatnonzero(run == run.max())[-1]]) + 1
    return arr[i:i + k].tolist()


def may_speculate(seq: Sequence) -> bool:
    """Rows that need every token's logprobs, the prompt's, or a grammar run without
    speculation (docs/architecture.md)."""
    p = seq.params
    return (p.logprobs is None and p.prompt_logprobs is None and p.structured is None
            and p.pooling is None)


class Speculation:
    """The proposer and its counters (owned by the Scheduler's Batch)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.draft_tokens = 0  # proposed
        self.accepted_tokens = 0  # ... and accepted
        self.num_drafts = 0  # rows that carried proposals (mean accepted length's divisor)
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def per_row(self, running: int) -> int:
        """The most drafts a row may carry with ``running`` sequences in the batch (0:
        none): ``num_speculative_tokens``, cut to an even share of the step's draft
        tokens, and 0 from ``disable_by_batch_size`` sequences up."""
        c = self.config
        if c.disable_by_batch_size is not None and running >= c.disable_by_batch_size:
            return 0
        if c.max_draft_tokens_per_step is None:
            return c.num_speculative_tokens
        return min(c.num_speculative_tokens, c.max_draft_tokens_per_step // max(running, 1))

    def wants(self, seq: Sequence, running: int) -> bool:
        """Whether ``seq``'s next decode row would carry drafts once its tokens are all
        known (with ``running`` sequences): not in back-off, a share of the step's draft
        budget, room before ``max_tokens``. Under overlap such a row is not planned ahead
        (``Batch._plan_running``): planned ahead, its last token in flight, it could not
        get a proposal."""
        left = seq.max_tokens - len(seq.output_ids) - seq.samples_in_flight - 1
        return not seq.spec_skip and left >= 1 and self.per_row(running) >= 1 \
            and may_speculate(seq)

    def step_without_proposal(self, seq: Sequence) -> None:
        """``seq`` runs a decode step with no proposal asked for (in back-off, or planned
        ahead under overlap): one step of its back-off passes."""
        seq.spec_skip = max(seq.spec_skip - 1, 0)

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """Drafts for ``seq``'s next decode row (at most ``room`` tokens); [] for none.
        Never past ``max_tokens``: a step emits at most drafts + 1 tokens."""
        if seq.spec_skip:
            self.step_without_proposal(seq)
            return []
        k = min(self.config.num_speculative_tokens, room,
                seq.max_tokens - len(seq.output_ids) - 1)
        if k < 1 or not may_speculate(seq):
            return []
        if self.config.method == "draft_model":
            # The Worker's draft model fills these placeholders before the target runs.
            return [DRAFT_PLACEHOLDER] * k
        return propose_ngram(seq.prompt_ids + seq.output_ids, k,
                             self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def verdict(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a row's verdict; a row whose proposals keep failing backs off."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.num_drafts += 1
        for p in range(accepted):
            self.accepted_per_pos[p] += 1
        if accepted:
            seq.spec_misses = 0
        else:
            seq.spec_misses += 1
            seq.spec_skip = min(2 ** seq.spec_misses, MAX_BACKOFF)


def count_error(plan: StepPlan, result: StepResult) -> str | None:
    """Why ``result``'s tokens cannot be ``plan``'s (a Worker bug), or None."""
    rows = sum(plan.sample)
    counts = result.num_sampled
    if counts and (len(counts) != rows or sum(counts) != len(result.token_ids)
                   or min(counts) < 1):
        return f"{len(result.token_ids)} tokens in rows of {counts} for {rows} sampling rows"
    if not counts and len(result.token_ids) != rows:
        return f"{len(result.token_ids)} tokens for {rows} sampling rows"
    return None


def drafts_of(plan: StepPlan) -> Iterable[int]:
    """Each row's draft count."""
    return plan.num_drafts or repeat(0, len(plan.rids))


def row_tokens(result: StepResult) -> Iterator[tuple[int, ...]]:
    """The tokens of each sampling row of ``result``, in row order (one each without
    speculation; ``num_sampled[j]`` with it)."""
    ids = result.token_ids
    if not result.num_sampled:
        for t in ids:
            yield (t,)
        return
    at = 0
    for n in result.num_sampled:
        yield tuple(ids[at:at + n])
        at += n
