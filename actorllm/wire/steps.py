"""The Scheduler <-> Worker edge: a step's plan and its result, as columns.

A decode step of many sequences builds no object per sequence: ``StepPlan`` and
``StepResult`` hold one tuple per field with one entry per row (a sequence's share of the
step); what is per request and rare (``NewSeqData``, prompt logprobs, sampled logprobs)
is sparse. ``ScheduledSeq`` and ``SampledToken`` are a row and a token as objects, for
tests and tools; they never travel. Re-exported by :mod:`actorllm.wire.messages`, the
codec's one list of messages.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from actorllm.wire.sampling import SamplingParams


@attrs.frozen
class NewSeqData:
    """What the Worker needs to sample a sequence it has not seen (or lost to preemption)."""

    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...] = ()


#: In ``StepPlan.token_ids``: the token the Worker sampled for this row's rid last.
FEED_LAST_SAMPLE = -1


@attrs.frozen
class AheadRows:
    """The decode rows of a StepPlan planned while the step before still samples for them
    (overlap scheduling) whose start or drafts only the Worker can settle: a row whose
    step in flight carries drafts starts after however many of them it accepts, and a
    row that speculates gets its drafts from the Worker's n-gram lookup over its tokens,
    the last of which only the Worker holds yet (docs/architecture.md, "Speculating
    under overlap").

    Such a row's ``StepPlan.token_ids`` are ``FEED_LAST_SAMPLE`` and then ``num_drafts``
    placeholders, its ``start_pos`` where it starts if the step in flight accepts every
    draft (its blocks are reserved to there). The Worker starts it after its last
    sample, runs as many drafts as its lookup gives and ``caps`` allows, and says so in
    ``StepResult.ahead_drafted`` and ``ahead_kinds``. Columns, one entry per ahead row
    (``rows``, plan rows in order) unless said: ``caps`` has ``n_max - n_min + 1`` per
    row, the drafts to run when the longest match found is ``n_min``, ``n_min + 1``, ...
    tokens long; the row's tokens the Worker lacks for the lookup, known to the
    Scheduler, are ``hist_num[j]`` of ``hist_tokens`` (flat), from position ``hist_from[j]``
    (what the Worker holds for the rid)."""

    rows: tuple[int, ...] = ()
    caps: tuple[int, ...] = ()
    hist_from: tuple[int, ...] = ()
    hist_num: tuple[int, ...] = ()
    hist_tokens: tuple[int, ...] = ()
    n_min: int = 1
    n_max: int = 1


@attrs.frozen
class StepPlan:
    """Scheduler -> Worker: one iteration, as columns with one entry per row (a sequence's
    share of the step), so a decode step of many sequences builds no object per sequence.

    ``token_ids`` is flat, ``num_tokens[i]`` of them per row (a prefill chunk, or the last
    token; ``FEED_LAST_SAMPLE`` in a step planned ahead, overlap scheduling). ``new_blocks``
    is flat too, ``num_new_blocks[i]`` per row: the block ids appended to the row's block
    table since the Worker last saw the rid (its whole table with a ``NewSeqData``). Rare
    per-row data are sparse: ``new`` for the rows at ``new_rows`` (a rid the Worker has not
    seen, or lost to preemption: its block table starts afresh), and prompt logprobs from
    position ``lp_from[j]`` (>= 1, to the last one the chunk predicts) for row
    ``lp_rows[j]``. ``drop``: rids whose Worker state (sampling state, block table) may go.
    ``num_drafts`` (empty: no row speculates): per row, how many of its tokens are draft
    tokens proposed by the Scheduler (the row's last ones, after its last known token);
    the Worker verifies them (speculative decoding, docs/architecture.md). ``ahead``:
    rows the Worker starts and drafts for (:class:`AheadRows`).
    """

    step_id: int
    rids: tuple[str, ...] = ()
    num_tokens: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()
    start_pos: tuple[int, ...] = ()  # per row: tokens already in the KV cache
    sample: tuple[bool, ...] = ()  # False for a prefill chunk short of the prompt's end
    num_new_blocks: tuple[int, ...] = ()
    new_blocks: tuple[int, ...] = ()
    new_rows: tuple[int, ...] = ()
    new: tuple[NewSeqData, ...] = ()
    lp_rows: tuple[int, ...] = ()
    lp_from: tuple[int, ...] = ()
    drop: tuple[str, ...] = ()
    num_drafts: tuple[int, ...] = ()
    ahead: AheadRows | None = None

    @property
    def num_rows(self) -> int:
        return len(self.rids)

    @property
    def seqs(self) -> tuple[ScheduledSeq, ...]:
        """The rows as objects (for tests, traces and rare paths; the hot paths read the
        columns)."""
        news = dict(zip(self.new_rows, self.new, strict=True))
        lps = dict(zip(self.lp_rows, self.lp_from, strict=True))
        rows = []
        t = b = 0
        for i, rid in enumerate(self.rids):
            n, nb = self.num_tokens[i], self.num_new_blocks[i]
            rows.append(ScheduledSeq(rid, self.token_ids[t:t + n], self.start_pos[i],
                                     self.new_blocks[b:b + nb], self.sample[i], news.get(i),
                                     lps.get(i)))
            t, b = t + n, b + nb
        return tuple(rows)

    def sampled_rids(self) -> list[str]:
        """The rids of the sampling rows, in the order of ``StepResult.token_ids``."""
        return [rid for rid, s in zip(self.rids, self.sample, strict=True) if s]

    @classmethod
    def of_rows(cls, step_id: int, rows: Iterable[ScheduledSeq],
                drop: tuple[str, ...] = ()) -> StepPlan:
        """The plan of these rows (tests and tools; the Scheduler fills columns itself)."""
        cols: tuple[list[Any], ...] = tuple([] for _ in range(10))
        rids, num, ids, start, sample, nnb, blocks, new_rows, new, lp_rows = cols
        lp_from: list[int] = []
        for i, r in enumerate(rows):
            rids.append(r.rid)
            num.append(len(r.token_ids))
            ids.extend(r.token_ids)
            start.append(r.start_pos)
            sample.append(r.sample)
            nnb.append(len(r.new_blocks))
            blocks.extend(r.new_blocks)
            if r.new is not None:
                new_rows.append(i)
                new.append(r.new)
            if r.prompt_logprobs_from is not None:
                lp_rows.append(i)
                lp_from.append(r.prompt_logprobs_from)
        return cls(step_id, *(tuple(c) for c in cols), tuple(lp_from), drop)


@attrs.frozen
class ScheduledSeq:
    """One row of a StepPlan as an object: not a message (``StepPlan.seqs`` builds them,
    ``StepPlan.of_rows`` takes them)."""

    rid: str
    token_ids: tuple[int, ...]
    start_pos: int
    new_blocks: tuple[int, ...]  # appended to its block table since the Worker last saw it
    sample: bool
    new: NewSeqData | None = None
    prompt_logprobs_from: int | None = None


@attrs.frozen
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class SampledToken:
    """One sampled token with its rid: not a message (``StepResult.sampled`` builds them)."""

    rid: str
    token_id: int
    logprob: TokenLogprob | None = None


@attrs.frozen
class PromptLogprobs:
    """The logprobs of one rid's prompt positions ``start, start + 1, ...`` from one step."""

    rid: str
    start: int
    logprobs: tuple[TokenLogprob, ...]


@attrs.frozen
class PooledHidden:
    """A pooling sequence's pooled final hidden state (not normalized), once its prompt
    is computed: the last position's, or the mean over all positions. Sparse, as prompt
    logprobs are: only an embedding request's last prefill step has one."""

    rid: str
    values: tuple[float, ...]


@attrs.frozen
class StepResult:
    """Worker -> Scheduler. ``token_ids``: one per sampling row of the plan, in row order;
    ``logprobs[j]`` belongs to ``token_ids[logprob_rows[j]]`` (only rows that asked).
    ``error`` set means the step failed and sampled nothing."""

    step_id: int
    token_ids: tuple[int, ...] = ()
    error: str | None = None
    forward_s: float = 0.0
    sample_s: float = 0.0
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    logprob_rows: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    pack_s: float = 0.0  # packing the plan into tensors (not counted in forward_s)
    pooled: tuple[PooledHidden, ...] = ()  # rows whose prompt this step completed
    # Sampling rows whose grammar refused the drawn token (text/structured.GrammarRefused),
    # with why: those requests fail alone; the rest of the step stands.
    refused_rows: tuple[int, ...] = ()
    refused: tuple[str, ...] = ()
    # Speculative decoding (empty: one token per sampling row): per sampling row, how many
    # of ``token_ids`` are its (the accepted drafts, then the Worker's own token).
    num_sampled: tuple[int, ...] = ()
    # Seconds the Worker's thread sat idle waiting for this plan after its previous step
    # (0: the plan was queued before that step ended). The Scheduler passes it on in its
    # stats, so the write pacing (server/pacing.py) learns by message that the engine
    # waits for the loop that plans, in any topology.
    plan_wait_s: float = 0.0
    # Per row of the plan's AheadRows: the drafts the Worker ran (its lookup's, at most
    # its caps) and the length of the match they came from (0: none found).
    ahead_drafted: tuple[int, ...] = ()
    ahead_kinds: tuple[int, ...] = ()

    def sampled(self, plan: StepPlan) -> tuple[SampledToken, ...]:
        """The tokens as objects with their rids (tests and tools), given the step's plan
        (a speculating row's several tokens each with its rid)."""
        lps = dict(zip(self.logprob_rows, self.logprobs, strict=True))
        if self.num_sampled:
            rids = [rid for rid, n in zip(plan.sampled_rids(), self.num_sampled, strict=True)
                    for _ in range(n)]
            return tuple(SampledToken(rid, tok) for rid, tok in zip(rids, self.token_ids,
                                                                    strict=True))
        return tuple(SampledToken(rid, tok, lps.get(j)) for j, (rid, tok) in enumerate(
            zip(plan.sampled_rids(), self.token_ids, strict=True)))

    @classmethod
    def of_tokens(cls, plan: StepPlan, tokens: Iterable[SampledToken], **fields: Any
                  ) -> StepResult:
        """The result that samples ``tokens`` (by rid) for ``plan``'s sampling rows (tests)."""
        by_rid = {t.rid: t for t in tokens}
        got = [by_rid[rid] for rid in plan.sampled_rids() if rid in by_rid]
        rows = tuple(j for j, t in enumerate(got) if t.logprob is not None)
        return cls(plan.step_id, tuple(t.token_id for t in got),
                   logprob_rows=rows, logprobs=tuple(got[j].logprob for j in rows), **fields)
