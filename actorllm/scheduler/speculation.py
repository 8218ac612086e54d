"""Speculative decoding's Scheduler side: n-gram proposals (prompt lookup), when a row
may carry them and how many (a per-row policy by expected gain), and the counters of
what the Worker accepted. With a draft model the proposals are placeholders: the
Worker's draft fills them (worker/draft.py).

The Scheduler owns each sequence's tokens, so proposals are made here, while planning: a
decode row runs ``[last token, drafts...]`` (``StepPlan.num_drafts``), the Worker
verifies the drafts against the model and returns the accepted ones plus one token of
its own (``StepResult.num_sampled``). A row planned ahead of the step that samples its
last token (overlap scheduling) is the exception: only the Worker will know that token,
so it looks the drafts up (``AheadRows``) and this module only says how many it may run
for each kind of match (:meth:`Speculation.propose_ahead`). The cost model is
draft_cost.py's. docs/architecture.md, "Speculative decoding".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from itertools import repeat

from actorllm.config import SpeculativeConfig
from actorllm.scheduler.draft_cost import BLOCK_COST, DRAFT_COST, best_drafts, pays_from
from actorllm.scheduler.ngram import lookup_row
from actorllm.scheduler.sequence import Sequence
from actorllm.wire.steps import StepPlan, StepResult

#: A row whose proposals do not pay (no draft count gains by :func:`draft_gain`) proposes
#: nothing for 2, 4, 8, ... steps (at most this many): text nothing predicts costs few
#: drafting steps.
MAX_BACKOFF = 64
#: What a draft_model row carries where its drafts go: the Scheduler never knows them.
DRAFT_PLACEHOLDER = 0
#: A row's acceptance estimate: drafts accepted / tried, counted with this decay per
#: verdict (so it follows the row's recent text), from a prior of PRIOR_HITS / PRIOR_TRIES.
DECAY = 0.75
PRIOR_HITS, PRIOR_TRIES = 1.0, 2.0
#: An estimate that does not pay moves this far back towards the prior each time its
#: proposal is passed over, so a row probes again after a while.
RECOVER = 0.1
#: A row none of whose kinds of match pays sits out the steps until the first would
#: (its estimates forgiven in one go), at most this many, instead of asking every step.
MAX_IDLE = 64


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
        self.backoffs = 0  # times a row backed off (the simulation checks it is reached)
        # A new row's estimate: PRIOR_HITS of PRIOR_TRIES (the simulation starts its rows
        # more pessimistic, so that one miss backs a row off and hypothesis reaches it).
        self.prior = (PRIOR_HITS, PRIOR_TRIES)
        # The batch's rows at the latest proposal: what a verdict's "does any kind still
        # pay" is judged against.
        self.rows = 1
        # Every row's verdicts per kind of match, decayed as a row's own are: whether a
        # kind a row never tried is worth a probe draft beside many rows (_probes).
        size = self._size = 1 if config.method == "draft_model" \
            else config.prompt_lookup_max + 1
        self.seen_hits, self.seen_tries = [0.0] * size, [0.0] * size
        # Per (cap, rows): the estimates below which no draft count pays and above which
        # one does (_paying), so that asking "does any kind pay" of every row at every
        # step costs a comparison per kind, not a cost-model evaluation.
        self._bounds: dict[tuple[int, int], tuple[float, float]] = {}
        self._block = BLOCK_COST if config.max_draft_tokens_per_step is not None else 0.0
        # The kinds of match a row keeps estimates for: n-gram lengths, or the draft's.
        self._kinds = range(1) if config.method == "draft_model" else range(
            config.prompt_lookup_min, config.prompt_lookup_max + 1)

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
        budget, room before ``max_tokens``, a kind of match that may pay. With a draft
        model, under overlap, such a row is not planned ahead (``Batch._waits_for_verdict``:
        its draft needs its start); one that nothing of pays is, and keeps the overlap
        (``step_without_proposal`` forgives it meanwhile). N-gram rows are planned ahead
        either way (:meth:`propose_ahead`)."""
        left = seq.max_tokens - len(seq.output_ids) - seq.samples_in_flight - 1
        cap = min(self.config.num_speculative_tokens, self.per_row(running), left)
        return not seq.spec_skip and not seq.spec_idle and cap >= 1 and may_speculate(seq) \
            and self._pays(seq, cap, self._rows(running))

    def step_without_proposal(self, seq: Sequence) -> None:
        """``seq`` runs a decode step with no proposal asked for (in back-off, or planned
        ahead under overlap): one step of its back-off or idling passes, or its estimates
        are forgiven a bit."""
        if seq.spec_skip:
            seq.spec_skip -= 1
        elif seq.spec_idle:  # (forgiven for these steps already: _sit_out)
            seq.spec_idle -= 1
        elif seq.spec_tries:
            self._forgive(seq)

    def propose(self, seq: Sequence, room: int, rows: int = 1) -> list[int]:
        """Drafts for ``seq``'s next decode row (at most ``room`` tokens) in a step of
        ``rows`` rows; [] for none. As many as pay by the row's acceptance estimate for
        this kind of match and by what drafts cost beside that many rows
        (:func:`best_drafts`), at most K; never past ``max_tokens``: a step emits at most
        drafts + 1 tokens."""
        gate = self._gate(seq, room, rows, self.config.method != "draft_model")
        if gate is None:
            return []
        cap, rows = gate
        if self.config.method == "draft_model":
            # The Worker's draft model fills these placeholders before the target runs.
            drafts, n = [DRAFT_PLACEHOLDER] * cap, 0
        else:
            drafts, n = lookup_row(seq, cap, self.config.prompt_lookup_min,
                                   self.config.prompt_lookup_max)
            if not drafts:
                return []
        self.rows = rows
        k = self._count(seq, n, cap, rows)
        if not k:
            self.passed_over(seq, n)
            return []
        seq.spec_n = n
        return drafts[:k]

    def _gate(self, seq: Sequence, room: int, rows: int, judged: bool
              ) -> tuple[int, int] | None:
        """What a proposal asks first: ``(cap, rows)``, the most drafts ``seq``'s row may
        carry (at most ``room``, never past ``max_tokens`` counting every token in flight
        as accepted) and the batch's ``rows`` as the cost model sees them; None where it
        proposes nothing now: idling, in back-off, no room, a row that may not speculate,
        or (``judged``) no kind of match that may pay, when it sits out."""
        if seq.spec_idle:
            # First, on the step's inputs: one comparison a row. (Its cap also falls near
            # max_tokens; a lower cap pays less: sitting out stays right.)
            if seq.spec_idle_key == (room, rows, self.num_drafts):
                seq.spec_idle -= 1
                return None
            seq.spec_idle = 0  # (what it was judged by changed: judged again now)
        if seq.spec_skip:
            self.step_without_proposal(seq)
            return None
        cap = min(self.config.num_speculative_tokens, room, seq.max_tokens
                  - len(seq.output_ids) - seq.samples_in_flight - seq.drafts_in_flight - 1)
        if cap < 1 or not may_speculate(seq):
            return None
        key, rows = (room, rows, self.num_drafts), self._rows(rows)
        if judged and not self._pays(seq, cap, rows):
            # Nothing can pay: the lookup (a scan of the row's history) is skipped, until
            # forgiving the estimates a bit each step would make a kind pay.
            self._sit_out(seq, cap, rows)
            seq.spec_idle_key = key
            return None
        return cap, rows

    def _count(self, seq: Sequence, n: int, cap: int, rows: int) -> int:
        """How many of at most ``cap`` drafts from a match of length ``n`` pay for
        ``seq`` by its estimate (:func:`best_drafts`); one to probe a kind of match never
        tried (beside many rows the prior alone does not pay, and an estimate only moves
        by trying)."""
        k = best_drafts(self._alpha(seq, n), cap, self._cost, rows, self._block)
        if not k and seq.spec_tries[n] == self.prior[1] and self._probes(n, cap, rows):
            k = 1
        return k

    @property
    def ahead(self) -> bool:
        """Whether a row planned ahead may speculate: its drafts then come from the
        Worker's lookup (AheadRows), which n-gram drafts can; a draft model's pass
        needs the row's start, so such a row waits for its verdict instead."""
        return self.config.method == "ngram"

    @property
    def lookup(self) -> tuple[int, int]:
        """The n-gram lengths tried, shortest and longest."""
        return self.config.prompt_lookup_min, self.config.prompt_lookup_max

    def propose_ahead(self, seq: Sequence, room: int, rows: int) -> list[int]:
        """For ``seq``'s decode row planned ahead (a step in flight still samples for it,
        so only the Worker will know its last tokens), in a step of ``rows`` rows, with
        room for ``room`` drafts: per kind of match, n-gram length ``prompt_lookup_min``
        up, how many drafts the Worker runs if its lookup finds that kind (AheadRows'
        ``caps``; all 0: none). As :meth:`propose` decides it, the lookup aside: the
        same back-off, idling, cap (past every token in flight, its drafts all accepted)
        and cost model."""
        gate = self._gate(seq, room, rows, True)
        if gate is None:
            return [0] * len(self._kinds)
        cap, rows = gate
        self.rows = rows
        return [self._count(seq, m, cap, rows) for m in self._kinds]

    def passed_over(self, seq: Sequence, n: int) -> None:
        """A match of length ``n`` was found for ``seq`` but no draft from it pays now:
        its estimate is forgiven a bit (otherwise it would never be tried again)."""
        hits, tries = seq.spec_hits, seq.spec_tries
        hits[n] += RECOVER * (self.prior[0] - hits[n])
        tries[n] += RECOVER * (self.prior[1] - tries[n])

    def _pays(self, seq: Sequence, cap: int, rows: int) -> bool:
        """Whether some kind of match could give ``seq`` drafts now (at most ``cap``,
        beside ``rows`` rows): one never tried that is worth a probe, or one whose
        estimate pays."""
        if not seq.spec_tries:
            self._alpha(seq, 0)  # (the counts, on a row's first proposal)
        hits, tries = seq.spec_hits, seq.spec_tries
        prior = self.prior[1]
        for m in self._kinds:
            if (tries[m] == prior and self._probes(m, cap, rows)) \
                    or self._paying(hits[m] / tries[m], cap, rows):
                return True
        return False

    def _probes(self, n: int, cap: int, rows: int) -> bool:
        """Whether a row spends a probe draft on a kind of match it never tried (length
        ``n``), beside ``rows`` rows: while the rows' verdicts on that kind so far are
        fewer than a prior's worth, or say it pays there. Why: every row probing every
        kind cost a step with drafts each (about 65 of 510 steps at 4 rows on the
        benchmark's random prompts, 6-9 % of its throughput for no gain); a workload's
        rows mostly share their acceptance, so a few rows' probes speak for the rest."""
        tries = self.seen_tries[n]
        return tries < self.prior[1] or self._paying(self.seen_hits[n] / tries, cap, rows)

    def _paying(self, alpha: float, cap: int, rows: int) -> bool:
        """``best_drafts(alpha, cap, cost, rows) > 0``: a draft count pays at this
        estimate. The gain of every count grows with ``alpha``, so it does above one
        estimate and not below: that bound, found once per (cap, rows), settles almost
        every call."""
        bounds = self._bound(cap, rows)
        if alpha <= bounds[0]:
            return False
        return alpha >= bounds[1] or bool(best_drafts(alpha, cap, self._cost, rows,
                                                      self._block))

    def _sit_out(self, seq: Sequence, cap: int, rows: int) -> None:
        """``seq``, none of whose kinds pays now, proposes nothing for the steps until
        one would (``Sequence.spec_idle``) while its room, ``rows`` and the verdicts seen
        stay as they are (``Sequence.spec_idle_key``, set by the caller), its estimates
        forgiven for all of them at once: as asking every step and forgiving a bit each
        time would, at the cost of one check a step (at 4
        rows on random text that asking was most of the policy's ~5 us a row).

        After j forgives an estimate is ``(H + a x) / (T + b x)``, ``x = (1 - RECOVER)^j``,
        ``a``, ``b`` its distance from the prior ``H`` of ``T``; it pays once above
        :func:`pays_from`'s ``lo``: ``x (a - lo b) > lo T - H``. A kind never tried
        waits for a verdict (the rows' verdicts decide its probe)."""
        if not seq.spec_tries:
            self._alpha(seq, 0)
        hits, tries = seq.spec_hits, seq.spec_tries
        big, small = self.prior
        lo = self._bound(cap, rows)[0]
        keep = 1.0 - RECOVER
        steps = MAX_IDLE
        for m in self._kinds:
            a, b = hits[m] - big, tries[m] - small
            c, d = a - lo * b, lo * small - big
            if (a or b) and d < 0:  # (d >= 0: the prior itself does not pay)
                steps = min(steps, 1 if c > d else int(math.log(d / c) / math.log(keep)) + 1)
        x = keep ** steps
        for m in self._kinds:
            hits[m] = big + (hits[m] - big) * x
            tries[m] = small + (tries[m] - small) * x
        seq.spec_idle = steps - 1  # (while the key the caller sets holds)

    def _bound(self, cap: int, rows: int) -> tuple[float, float]:
        """:func:`pays_from`, found once per (cap, rows)."""
        bounds = self._bounds.get((cap, rows))
        if bounds is None:
            bounds = self._bounds[cap, rows] = pays_from(cap, self._cost, rows, self._block)
        return bounds

    def _forgive(self, seq: Sequence) -> None:
        """Move every kind's estimate a bit back towards the prior (a row none of whose
        kinds pays proposes nothing, so it would never try one again)."""
        if not seq.spec_tries:
            self._alpha(seq, 0)
        hits, tries = seq.spec_hits, seq.spec_tries
        for m in self._kinds:
            hits[m] += RECOVER * (self.prior[0] - hits[m])
            tries[m] += RECOVER * (self.prior[1] - tries[m])

    def _rows(self, rows: int) -> int:
        """The batch's rows as the cost model sees them: only where a step's drafts are
        bounded (the CPU, where it was measured); unbounded (a GPU's default) a row
        counts as alone."""
        return rows if self.config.max_draft_tokens_per_step is not None else 1

    @property
    def _cost(self) -> float:
        return DRAFT_COST[self.config.method]

    def _alpha(self, seq: Sequence, n: int) -> float:
        """The row's estimate that a draft from a match of length ``n`` is accepted."""
        if not seq.spec_tries:
            seq.spec_hits, seq.spec_tries = [self.prior[0]] * self._size, \
                [self.prior[1]] * self._size
        return seq.spec_hits[n] / seq.spec_tries[n]

    def verdict(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a row's verdict and update its estimate; a row whose proposal had nothing
        accepted and none of whose kinds of match tried so far pays backs off."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.num_drafts += 1
        for p in range(accepted):
            self.accepted_per_pos[p] += 1
        n = seq.spec_n
        self._alpha(seq, n)
        # Tried: the accepted drafts and the first rejected one (the rest were not reached).
        seq.spec_hits[n] = DECAY * seq.spec_hits[n] + accepted
        seq.spec_tries[n] = DECAY * seq.spec_tries[n] + accepted + (accepted < drafted)
        self.seen_hits[n] = DECAY * self.seen_hits[n] + accepted
        self.seen_tries[n] = DECAY * self.seen_tries[n] + accepted + (accepted < drafted)
        if accepted:
            seq.spec_misses = 0
            return
        # Only if no kind of match it has tried pays: a short match failing must not
        # stop a long one that pays (a miss of the lookup costs nothing anyway).
        if not any(self._paying(h / t, self.config.num_speculative_tokens, self.rows)
                   for h, t in zip(seq.spec_hits, seq.spec_tries, strict=True)
                   if t != self.prior[1]):
            seq.spec_misses += 1
            seq.spec_skip = min(2 ** seq.spec_misses, MAX_BACKOFF)
            self.backoffs += 1


def count_error(plan: StepPlan, result: StepResult) -> str | None:
    """Why ``result``'s tokens cannot be ``plan``'s (a Worker bug), or None."""
    rows = sum(plan.sample)
    counts = result.num_sampled
    if counts and (len(counts) != rows or sum(counts) != len(result.token_ids)
                   or min(counts) < 1):
        return f"{len(result.token_ids)} tokens in rows of {counts} for {rows} sampling rows"
    if not counts and len(result.token_ids) != rows:
        return f"{len(result.token_ids)} tokens for {rows} sampling rows"
    ahead = len(plan.ahead.rows) if plan.ahead is not None else 0
    if len(result.ahead_drafted) != ahead or len(result.ahead_kinds) != ahead:
        return f"drafts of {len(result.ahead_drafted)} rows for {ahead} rows planned ahead"
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
