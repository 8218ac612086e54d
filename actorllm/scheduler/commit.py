"""How the Scheduler commits a step's result: the tokens each row sampled become its
sequence's, finished sequences finish, and what the Detokenizer hears waits in
``Outgoing``. A base of :class:`~actorllm.scheduler.actor.Scheduler`, kept apart for
size: it reads and writes the Scheduler's own state (declared below) and nothing else.

Two paths. Any result goes through ``on_result`` (the step returned: every row's
counters, the fence) and then ``_commit`` (each sampling row's tokens, logprobs, prompt
logprobs, refusals). A plain decode step's (:func:`plain_decode`) goes through
``_commit_decode``, one pass that makes the same changes in the same order per row.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from actorllm.lifecycle.table import State
from actorllm.lifecycle.trace import Tracer
from actorllm.scheduler.batch import Batch
from actorllm.scheduler.outgoing import Outgoing
from actorllm.scheduler.sequence import Sequence, take_prompt_pieces
from actorllm.scheduler.speculation import count_error, drafts_of, row_tokens
from actorllm.scheduler.totals import StepTotals
from actorllm.wire.messages import FEED_LAST_SAMPLE, StepPlan, StepResult

log = logging.getLogger(__name__)


class ResultCommit:
    """``on_result`` and what it calls; the Scheduler provides the state and the two
    terminal moves (``_finish``, ``_pass_fence``)."""

    seqs: dict[str, Sequence]
    in_flight: deque[StepPlan]
    fenced: list[Sequence]
    batch: Batch
    outgoing: Outgoing
    totals: StepTotals
    tracer: Tracer | None
    lp_live: int
    late_results_dropped: int
    ahead_tokens_dropped: int

    def _finish(self, seq: Sequence, event: str, reason: str, stop_reason: Any = None,
                error: str | None = None) -> None:
        raise NotImplementedError  # the Scheduler's

    def _pass_fence(self) -> bool:
        raise NotImplementedError  # the Scheduler's

    def on_result(self, result: StepResult) -> None:
        """Commit a step's result by walking its plan's columns."""
        # The Worker runs plans in order, so a result answers the oldest plan in flight.
        if not self.in_flight or result.step_id != self.in_flight[0].step_id:
            self.late_results_dropped += 1  # a duplicate or stale result: never an error
            log.debug("dropped result of step %d", result.step_id)
            return
        plan = self.in_flight.popleft()
        self.totals.add_result(result, len(plan.rids))
        error = result.error or count_error(plan, result)  # (a count: a Worker bug)
        if self.tracer is not None:
            self.tracer.record("result", actor="scheduler", step=result.step_id,
                               tokens=[[rid, *t] for rid, t in zip(
                                   plan.sampled_rids(), row_tokens(result), strict=False)],
                               error=error, forward_s=result.forward_s)
        if error is None and not self.fenced and plain_decode(plan, result, self.lp_live):
            self._commit_decode(plan, result.token_ids)
            return
        seqs = [self.seqs.get(rid) for rid in plan.rids]
        ok, running, computed = error is None, State.RUNNING, self.batch.computed
        for seq, n, sampled, drafts in zip(seqs, plan.num_tokens, plan.sample,
                                           drafts_of(plan), strict=True):
            if seq is None:
                continue
            seq.step_returned(sampled, drafts)
            if ok and seq.view.local is running:
                computed(seq, n - drafts)  # accepted drafts: in _commit
        if self._pass_fence():  # freed ones are gone: look the rids up again
            seqs = [self.seqs.get(rid) for rid in plan.rids]
        if error is not None:
            for seq in seqs:
                if seq is not None and seq.status is State.RUNNING:
                    self._finish(seq, "fail", "error", error=error)
            return
        self._commit(plan, seqs, result)

    def _commit_decode(self, plan: StepPlan, tokens: tuple[int, ...]) -> None:
        """:meth:`on_result` and :meth:`_commit` of a plain decode step (:func:`plain_decode`)
        in one pass over its rows: the same changes, each row's in the same order, in one
        loop with only the calls every row needs. Why: at 256 rows the two passes
        were ~0.3 ms of the loop's turn between two steps (issue 28). Only with nothing
        fenced: then no row's sequence has finished (a finished one in flight is fenced),
        and there is no fence to pass before the rows."""
        seqs, running, out = self.seqs, State.RUNNING, self.outgoing
        computed = self.batch.computed
        for rid, token, fed in zip(plan.rids, tokens, plan.token_ids, strict=True):
            seq = seqs.get(rid)
            if seq is not None:
                seq.step_returned(True)
            if seq is None or seq.view.local is not running:
                # Only where a sequence left without its fence (a bug the simulation
                # plants): dropped as _commit drops it, for the invariants to see.
                self._drop_row(fed)
                continue
            computed(seq, 1)
            reason, stop_reason = seq.finish_after(token)
            out.token(seq, token)
            if reason is not None:
                self._finish(seq, "finish", reason, stop_reason)

    def _drop_row(self, first_token: int) -> None:
        """A sampling row whose sequence no longer runs, by its first token: counted,
        never committed."""
        if first_token == FEED_LAST_SAMPLE:
            self.ahead_tokens_dropped += 1  # planned ahead past its end
        else:
            self.late_results_dropped += 1  # finished (abort, stop) while it ran

    def _ahead_verdicts(self, plan: StepPlan, seqs: list[Sequence | None],
                        result: StepResult) -> tuple[int, ...]:
        """Each row's drafts as the Worker ran them: for a row planned ahead (AheadRows)
        the lookup's, whose match length is the kind its verdict counts for, or which
        is passed over when it found a match none of whose drafts paid."""
        drafted = list(plan.num_drafts or (0,) * len(plan.rids))
        spec = self.batch.speculation
        assert plan.ahead is not None and spec is not None
        for i, d, n in zip(plan.ahead.rows, result.ahead_drafted, result.ahead_kinds,
                           strict=True):
            seq, drafted[i] = seqs[i], d
            if seq is None or seq.view.local is not State.RUNNING:
                continue
            if d:
                seq.spec_n = n
            elif n:
                spec.passed_over(seq, n)
        return tuple(drafted)

    def _commit(self, plan: StepPlan, seqs: list[Sequence | None], result: StepResult) -> None:
        """A step's tokens and prompt logprobs for the sequences still running (the
        tokens are a column aligned with the plan's sampling rows); refused rows fail."""
        running = State.RUNNING  # (a view's local is None once its sequence is freed)
        pieces: dict[str, dict[str, Any]] = {}
        if self.lp_live or result.pooled:  # (pooled: an embedding's vector, kept for its finish)
            pieces, gaps = take_prompt_pieces(
                [q for q in seqs if q is not None and q.view.local is running],
                result.prompt_logprobs, result.pooled)
            for seq, gap in gaps:
                # A Worker bug: no list with holes for the client; the others live on.
                log.error("%s: %s", seq.rid, gap)
                self._finish(seq, "fail", "error", error=gap)
        logprobs = dict(zip(result.logprob_rows, result.logprobs, strict=True))
        sampling = [i for i, sampled in enumerate(plan.sample) if sampled]
        drafted = self._ahead_verdicts(plan, seqs, result) if plan.ahead is not None \
            else plan.num_drafts
        refused = dict(zip(result.refused_rows, result.refused, strict=True))
        out, rows = self.outgoing, result.token_ids  # an int per row, unless rows speculated
        rows = row_tokens(result) if result.num_sampled else rows  # (then a tuple per row)
        for j, (i, tokens) in enumerate(zip(sampling, rows, strict=True)):
            seq = seqs[i]
            if seq is None or seq.view.local is not running:
                self._drop_row(plan.token_ids[sum(plan.num_tokens[:i])])
                continue
            if refused and j in refused:  # its grammar refused the draw (a masking bug)
                self._finish(seq, "fail", "error", error=refused[j])
                continue
            piece = pieces.pop(seq.rid, None) if pieces else None  # (rare: both)
            lp = logprobs.get(j) if logprobs else None
            if type(tokens) is int:  # the hot path: no object for the row
                reason, stop_reason = seq.finish_after(tokens)
                out.token(seq, tokens, lp, piece)
            else:  # speculation
                n, reason, stop_reason = self.batch.take(seq, tokens, drafted[i] if drafted
                                                         else 0)
                out.tokens(seq, tokens if n == len(tokens) else tokens[:n], lp, piece)
            if reason is not None:
                self._finish(seq, "finish", reason, stop_reason)
        if not pieces and all(plan.sample):
            return  # (a row that scores its prompt only never samples)
        for seq in seqs:
            if seq is None or seq.view.local is not running:
                continue
            piece = pieces.pop(seq.rid, None)
            if piece is not None:  # a prefill chunk that sampled nothing
                self.outgoing.piece(seq, piece)
            if seq.max_tokens == 0 and seq.num_computed == seq.num_tokens and not seq.in_flight:
                self._finish(seq, "finish", "length")  # the prompt is scored: nothing to sample


def plain_decode(plan: StepPlan, result: StepResult, lp_live: int) -> bool:
    """Whether ``result`` answers a plain decode step: every row one token that samples
    (so no drafts), and nothing rare in the result (logprobs, refusals, prompt
    logprobs, pooled states) or owed by a live sequence (prompt logprobs)."""
    n = len(plan.rids)
    return (len(plan.token_ids) == n == len(result.token_ids) and not lp_live
            and not (result.num_sampled or result.logprob_rows or result.refused_rows
                     or result.prompt_logprobs or result.pooled))
