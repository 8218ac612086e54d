"""One request as the Scheduler sees it, and what it decides about it alone.

The Scheduler (actorllm/scheduler/actor.py) owns every :class:`Sequence`: the queues, the pool
and the finish decisions across requests live there; what depends on one sequence only
(its tokens, the next chunk's wire form, its stop conditions) lives here.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from actorllm.lifecycle.table import State, View, load_spec
from actorllm.scheduler.columns import PlanColumns
from actorllm.scheduler.kv_pool import extend_hashes, hash_block
from actorllm.wire.messages import (
    FEED_LAST_SAMPLE,
    DetokSetup,
    FinishReason,
    NewSeqData,
    PooledHidden,
    PromptLogprobs,
    SamplingParams,
    TokenLogprob,
    TokenOut,
)


class PromptLogprobsGap(Exception):
    """The Worker's prompt logprobs skipped positions still owed (a Worker bug)."""


@attrs.define(eq=False)
class Sequence:
    """Lives from ``enqueue`` to ``free``. Its state is the Scheduler's ledger view."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_ids: frozenset[int]
    arrival_time: float = 0.0
    output_ids: list[int] = attrs.Factory(list)
    block_table: list[int] = attrs.Factory(list)
    num_computed: int = 0  # tokens whose K/V are in the cache (steps returned)
    num_scheduled: int = 0  # ... or will be once the steps in flight return
    in_flight: int = 0  # steps in flight that schedule it (the fence)
    samples_in_flight: int = 0  # tokens those steps will sample for it
    worker_knows: bool = False  # the Worker holds its sampling state and block table
    blocks_sent: int = 0  # how much of block_table the Worker has (StepPlan.new_blocks)
    detok_spec_sent: bool = False
    return_prompt_ids: bool = False  # its first output carries its prompt's ids
    first_scheduled: float | None = None
    incarnation: int = 0  # numbers the rid's incarnations; StopMatched echoes it
    # With params.prompt_logprobs: the first prompt position not yet reported (position 0
    # is reported, as None, with the first result). Survives preemption, so a recompute
    # reports only what is still owed and no position is reported twice.
    prompt_lps_next: int = 0
    # Prefix caching: the hashes of its full blocks so far (kv.extend_hashes grows it),
    # how many of its blocks it has registered as cached, and how many prompt tokens the
    # cache gave it at its first admission (the response's ``cached_tokens``).
    block_hashes: list[bytes] = attrs.Factory(list)
    num_registered: int = 0
    num_cached_tokens: int | None = None
    pooled: tuple[float, ...] = ()  # a pooling request's vector, once the Worker sent it
    # Speculative decoding (scheduler/speculation.py): the drafts the next schedule_into
    # sends (placeholders for a row planned ahead, with the drafts the Worker may run per
    # kind of match, ``ahead_caps``), the drafts the steps in flight carry for it (how
    # many tokens they yield is unknown until they return: ``num_scheduled`` counts them
    # all), how many of its tokens the Worker's lookup holds (AheadRows), the
    # backoff of a row whose proposals do not pay, and its acceptance estimates: decayed
    # counts of drafts accepted and tried, per n-gram match length (index 0: a draft
    # model's), the match length of its proposal in flight, and for the n-gram lookup
    # its tokens, each token's positions in them and (the first ``spec_known`` of) its
    # tokens as an array (``ngram.history``, ``ngram.history_array``).
    drafts: list[int] = attrs.Factory(list)
    ahead_caps: list[int] = attrs.Factory(list)
    drafts_in_flight: int = 0
    worker_hist: int = 0
    spec_misses: int = 0
    spec_skip: int = 0
    spec_idle: int = 0  # steps it sits out, nothing paying (Speculation._sit_out) ...
    spec_idle_key: tuple[int, int, int] = (0, 0, 0)  # ... while these stay the same
    spec_hits: list[float] = attrs.Factory(list)
    spec_tries: list[float] = attrs.Factory(list)
    spec_n: int = 0
    spec_tokens: list[int] = attrs.Factory(list)
    spec_where: dict[int, list[int]] = attrs.Factory(dict)
    spec_history: np.ndarray = attrs.Factory(lambda: np.empty(0, dtype=np.int64))
    spec_known: int = 0
    # The Scheduler's view of the rid (``status`` reads it); the Scheduler passes its
    # ledger's, a Sequence built alone gets a fresh one.
    view: View = attrs.Factory(lambda self: View(load_spec(), "scheduler", self.rid),
                               takes_self=True)

    @property
    def status(self) -> State:
        """WAITING, RUNNING, PREEMPTED or FINISHED: where the Scheduler's last event put it."""
        assert self.view.local is not None, self.view
        return self.view.local

    @property
    def drafting(self) -> bool:
        """Whether a step in flight carries drafts for it."""
        return bool(self.drafts_in_flight)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def owes_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.prompt_lps_next < len(
            self.prompt_ids)

    def skippable_prefix(self) -> int:
        """How many leading tokens may come from a prefix cache instead of being computed.

        Reporting position p's logprob needs the logits of position p - 1, so while prompt
        logprobs are owed only the tokens before ``prompt_lps_next - 1`` may be skipped
        (none before the first report); otherwise all of them. The Scheduler's prefix
        cache obeys it (``blocks.cache_hits``; docs/architecture.md).
        """
        if self.owes_prompt_logprobs:
            return max(self.prompt_lps_next - 1, 0)
        if self.params.pooling in ("mean", "cls"):
            return 0  # the first position's hidden state is pooled: it must be computed
        return self.num_tokens

    @property
    def priority(self) -> int:
        return self.params.priority

    def hashes(self, block_size: int) -> list[bytes]:
        """The hashes of all its full blocks (prompt and output tokens)."""
        n, p, hashes = self.num_tokens, len(self.prompt_ids), self.block_hashes
        if n // block_size * block_size <= p:
            extend_hashes(hashes, self.prompt_ids, block_size, n)
            return hashes
        # Past the prompt: only the new blocks' tokens are gathered, not the whole sequence
        # (a decode completes a block every block_size steps; copying it all each time grew
        # with its length). The same hashes as extend_hashes over prompt + output.
        for i in range(len(hashes), n // block_size):
            lo, hi = i * block_size, (i + 1) * block_size
            if hi <= p:
                block = self.prompt_ids[lo:hi]
            elif lo >= p:
                block = self.output_ids[lo - p:hi - p]
            else:
                block = self.prompt_ids[lo:] + self.output_ids[:hi - p]
            hashes.append(hash_block(hashes[-1] if hashes else None, block))
        return hashes

    def token(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: it holds no blocks (they went back; registered ones
        stay cached, so its recompute may be a cache hit)."""
        assert not self.in_flight
        self.block_table = []
        self.num_computed = self.num_scheduled = 0
        self.num_registered = 0

    @property
    def num_unscheduled(self) -> int:
        """Tokens to run that no step has been given yet, counting those still to be
        sampled by the steps in flight (a step planned ahead feeds them forward) and, as
        ``num_scheduled`` does, their drafts as if all were accepted."""
        return self.num_tokens + self.samples_in_flight + self.drafts_in_flight \
            - self.num_scheduled

    def may_plan_ahead(self, past_drafts: bool = False) -> bool:
        """Whether a step may be planned for it before the one in flight returns: not if
        the tokens in flight may already reach ``max_tokens`` (it may end there), nor
        past drafts in flight unless ``past_drafts`` (the Worker then starts the row:
        AheadRows)."""
        return (past_drafts or not self.drafts_in_flight) and len(self.output_ids) \
            + self.samples_in_flight + self.drafts_in_flight < self.max_tokens

    def step_returned(self, sampled: bool, drafts: int = 0) -> None:
        """A step that scheduled it has returned (with a result or an error). Its drafts
        are unscheduled: the accepted ones are counted back as they are committed
        (``take_tokens``); the K/V written for rejected ones is overwritten later."""
        self.in_flight -= 1
        self.samples_in_flight -= sampled
        if drafts:
            self.drafts_in_flight -= drafts
            self.num_scheduled -= drafts

    def take_tokens(self, tokens: tuple[int, ...]) -> tuple[int, str | None, int | None]:
        """A speculating row's tokens (accepted drafts, then the Worker's own), each
        appended and checked as ``finish_after`` does, up to the first that ends it:
        (tokens appended, finish reason, stop token). Each accepted draft appended has
        its K/V in the cache, so it counts as scheduled again (the caller counts it
        computed: ``min(appended, len(tokens) - 1)``)."""
        reason: str | None = None
        stop: int | None = None
        appended = 0
        for token in tokens:
            reason, stop = self.finish_after(token)
            appended += 1
            if reason is not None:
                break
        self.num_scheduled += min(appended, len(tokens) - 1)
        return appended, reason, stop

    def schedule_into(self, cols: PlanColumns, n: int) -> None:
        """Append the next ``n`` tokens as the Worker gets them to the plan's columns: the
        block ids it has not seen yet, and NewSeqData (with the whole table) the first time.

        A token that a step in flight is still to sample goes as ``FEED_LAST_SAMPLE``:
        the Worker feeds the one it sampled for this rid last.
        """
        if self.samples_in_flight and (self.drafts or self.drafts_in_flight):
            self._schedule_ahead_into(cols, n)
            return
        start = self.num_scheduled
        known = self.num_tokens
        row = len(cols.rids)
        drafts = self.drafts
        if drafts:  # n counts them: the known last token, then the proposals
            assert n == len(drafts) + 1 and start + 1 == known and not self.samples_in_flight
            cols.num_drafts.extend([0] * (row - len(cols.num_drafts)))
            cols.num_drafts.append(len(drafts))
            n = 1
        if not self.worker_knows:
            cols.new_rows.append(row)
            cols.new.append(
                NewSeqData(self.params, tuple(self.prompt_ids), tuple(self.output_ids)))
            self.worker_knows = True
            self.blocks_sent = self.worker_hist = 0  # its state starts afresh at the Worker
        if self.owes_prompt_logprobs:
            # This chunk's rows predict positions start + 1 .. start + n; ask only for the
            # prompt positions among them that were not reported before a preemption.
            lo = max(self.prompt_lps_next, start + 1)
            if lo <= min(start + n, len(self.prompt_ids) - 1):
                cols.lp_rows.append(row)
                cols.lp_from.append(lo)
        if start + n > known:
            # Only ever the one token a step in flight samples, and only that step's.
            assert start + n == known + 1 == start + 1 and self.samples_in_flight, self
            cols.token_ids.append(FEED_LAST_SAMPLE)
        elif n == 1:
            cols.token_ids.append(self.token(start))
        else:
            p = len(self.prompt_ids)
            if start + n <= p:
                cols.token_ids.extend(self.prompt_ids[start:start + n])
            else:
                cols.token_ids.extend(self.token(i) for i in range(start, start + n))
        # max_tokens 0 (prompt scoring): the prefill runs, nothing is sampled.
        sample = start + n == known + self.samples_in_flight and self.max_tokens > 0
        if drafts:
            cols.token_ids.extend(drafts)
            n += len(drafts)
            self.drafts_in_flight += len(drafts)
            self.drafts = []
        self._add_row(cols, start, n, sample)

    def _schedule_ahead_into(self, cols: PlanColumns, n: int) -> None:
        """``schedule_into`` of a decode row planned ahead that the Worker starts or drafts
        for (an AheadRows row): ``FEED_LAST_SAMPLE`` and ``n - 1`` draft placeholders, from
        where it starts if the steps in flight accept all their drafts; with drafts, the
        tokens the Worker's lookup lacks (all it may need: the step in flight samples
        for no other)."""
        k = len(self.drafts)
        assert n == 1 + k and self.worker_knows and not self.owes_prompt_logprobs, self
        row, known = len(cols.rids), self.num_tokens
        cols.ahead_rows.append(row)
        cols.ahead_caps.extend(self.ahead_caps if k else [0] * cols.kinds)
        cols.hist_from.append(self.worker_hist)
        if k:
            cols.num_drafts.extend([0] * (row - len(cols.num_drafts)))
            cols.num_drafts.append(k)
            sent = self.worker_hist
            cols.hist_num.append(known - sent)
            cols.hist_tokens.extend(self.prompt_ids[sent:])
            cols.hist_tokens.extend(self.output_ids[max(sent - len(self.prompt_ids), 0):])
            self.worker_hist = known
        else:
            cols.hist_num.append(0)
        cols.token_ids.append(FEED_LAST_SAMPLE)
        cols.token_ids.extend(self.drafts)
        self.drafts, self.ahead_caps = [], []
        self.drafts_in_flight += k
        self._add_row(cols, self.num_scheduled, n, True)

    def _add_row(self, cols: PlanColumns, start: int, n: int, sample: bool) -> None:
        """The row's own columns, its new block ids, and its counters of what flies."""
        self.num_scheduled += n
        self.in_flight += 1
        self.samples_in_flight += sample
        cols.rids.append(self.rid)
        cols.num_tokens.append(n)
        cols.start_pos.append(start)
        cols.sample.append(sample)
        table = self.block_table
        cols.num_new_blocks.append(len(table) - self.blocks_sent)
        if len(table) > self.blocks_sent:
            cols.new_blocks.extend(table[self.blocks_sent:])
            self.blocks_sent = len(table)

    def finish_after(self, token: int) -> tuple[str | None, int | None]:
        """Append a sampled token; returns (finish reason, stop token) if it ends the sequence."""
        self.output_ids.append(token)
        n_out = len(self.output_ids)
        p = self.params
        if n_out >= p.min_tokens:
            if token in self.eos_ids and not p.ignore_eos:
                return FinishReason.STOP, None
            if token in p.stop_token_ids:
                return FinishReason.STOP, token
        if n_out >= self.max_tokens:
            return FinishReason.LENGTH, None
        return None, None

    def take_prompt_logprobs(self, got: PromptLogprobs | None) -> dict[str, Any] | None:
        """A step's prompt logprobs for it, as TokenOut fields; None if nothing is new.

        Positions already reported (before a preemption) are skipped, so each position
        reaches the client exactly once; the first piece opens with position 0 (None)
        and carries the prompt's token ids. Raises PromptLogprobsGap.
        """
        entries: list[TokenLogprob | None] = []
        fields: dict[str, Any] = {}
        if self.prompt_lps_next == 0:
            entries.append(None)
            fields["prompt_token_ids"] = tuple(self.prompt_ids)
            self.prompt_lps_next = 1
        if got is not None:
            skip = self.prompt_lps_next - got.start
            if skip < 0:
                raise PromptLogprobsGap(f"prompt logprobs resumed at position {got.start}, "
                                        f"expected {self.prompt_lps_next}")
            fresh = got.logprobs[skip:]
            entries.extend(fresh)
            self.prompt_lps_next += len(fresh)
        return {"prompt_logprobs": tuple(entries), **fields} if entries else None

    def final_output(self, reason: str, stop_reason: Any, error: str | None,
                     token: TokenOut | None = None) -> TokenOut:
        """Its last TokenOut: the finish reason, merged with this step's ``token`` if any."""
        queued = None
        if self.first_scheduled is not None and self.arrival_time:
            queued = max(self.first_scheduled - self.arrival_time, 0.0)
        out = TokenOut(self.rid, finish_reason=reason, stop_reason=stop_reason, error=error,
                       queue_s=queued, cached_tokens=self.num_cached_tokens,
                       pooled=self.pooled, **self.first_output_fields())
        if token is None:
            return out
        return attrs.evolve(out, token_ids=token.token_ids, logprobs=token.logprobs,
                            spec=token.spec or out.spec, prompt_logprobs=token.prompt_logprobs,
                            prompt_token_ids=token.prompt_token_ids or out.prompt_token_ids)

    def first_output_fields(self) -> dict[str, Any]:
        """What only the rid's first output carries, as TokenOut fields (none after it):
        what the Detokenizer needs for it, and the prompt's ids if they were asked for."""
        if self.detok_spec_sent:
            return {}
        self.detok_spec_sent = True
        p = self.params
        fields: dict[str, Any] = {"spec": DetokSetup(
            p.stop, p.include_stop_str_in_output, p.skip_special_tokens,
            len(self.prompt_ids), self.incarnation)}
        if self.return_prompt_ids:
            fields["prompt_token_ids"] = tuple(self.prompt_ids)
        return fields



def take_prompt_pieces(running: list[Sequence], reported: tuple[PromptLogprobs, ...],
                       pooled: tuple[PooledHidden, ...] = ()
                       ) -> tuple[dict[str, dict[str, Any]], list[tuple[Sequence, str]]]:
    """A step's prompt logprobs for the running sequences it named, per rid as TokenOut
    fields, and the sequences whose report had a gap (with why). The step's pooled
    vectors are kept on their sequences (their finish carries them)."""
    by_rid = {r.rid: r for r in reported}
    vectors = {p.rid: p.values for p in pooled}
    pieces: dict[str, dict[str, Any]] = {}
    gaps: list[tuple[Sequence, str]] = []
    for seq in running:
        seq.pooled = vectors.get(seq.rid, seq.pooled)
        if not seq.owes_prompt_logprobs:
            continue
        try:
            piece = seq.take_prompt_logprobs(by_rid.get(seq.rid))
        except PromptLogprobsGap as gap:
            gaps.append((seq, str(gap)))
            continue
        if piece is not None:
            pieces[seq.rid] = piece
    return pieces, gaps
