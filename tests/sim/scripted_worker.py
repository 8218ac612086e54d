"""A Worker the test drives: steps complete (or fail) only when the test says so.

It speaks the real Worker's protocol (``StepPlan`` in, ``StepResult`` out) and keeps
the same per-rid sampling state the real one keeps (``new`` creates it, ``forget``
drops it), so invariant 4 can ask it to be empty after a drain. It never samples:
the token for a position is a hash of (rid, position) plus a salt the test picks, over
a small vocabulary of ordinary tokens, so the test can steer outputs into stop
strings and end-of-sequence without a model. Asked for prompt logprobs, it reports
exactly the positions the plan asks for, each as ``-position`` (see ``prompt_score``).

It keeps each rid's block table as the real one does (the persistent batch of
worker/packing.py): a plan's ``new_blocks`` are appended to its rows' tables, a
``NewSeqData`` row starts its table afresh, ``drop`` forgets it. Every read and write of a
step goes through those tables, so a diff the Scheduler gets wrong (or a table the Worker
keeps when it must not) lands on the wrong slots and is caught below.

It also keeps a reference KV cache, the oracle of invariant 9: each slot holds the prefix
(token ids up to and including its position) whose K/V a real model would have written
there. Before a step runs, every slot the step reads (the positions before each
sequence's new tokens, through its block table) must hold that sequence's own prefix,
so a prefix-cache hit on the wrong block, or on one overwritten since, is caught. A
failed step writes garbage into its slots, as a real one may have half done. (Stricter
than a GPU, where a step's writes land before its reads: no step may read what the same
step writes for another sequence.)

A row planned ahead that the Worker starts or drafts for (``StepPlan.ahead``) is resolved
as worker/ahead.py does it: it starts after the rid's last sample (at most where the
Scheduler planned it), and its drafts are the n-gram lookup's over the rid's tokens,
as many as its caps allow; the tokens the Scheduler sends for the lookup must be the
rid's own, from where the last ones ended.

A speculating row (``StepPlan.num_drafts``) is verified by script: the salt and the rid
decide how many drafts it accepts, then it emits a token of its own (never the next
draft). The slots its rejected drafts were written to become garbage, so a later read
of them before they are written again is caught, and ``emitted`` (what it sampled or
accepted, per position) is what the outputs and every later fed token must agree with.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Sequence

import attrs
import trio

from actorllm.text.ngram import lookup_ngram
from actorllm.wire.mailbox import Inbox, Outbox
from actorllm.wire.messages import (
    FEED_LAST_SAMPLE,
    PromptLogprobs,
    ScheduledSeq,
    StepPlan,
    StepResult,
    TokenLogprob,
)


def scripted_token(vocab: Sequence[int], rid: str, position: int, salt: int = 0) -> int:
    """The token the scripted Worker samples for ``rid`` at ``position`` (deterministic)."""
    return vocab[(zlib.crc32(f"{rid}/{position}".encode()) + salt) % len(vocab)]


def prompt_score(position: int) -> float:
    """The logprob the scripted Worker reports for prompt position ``position``."""
    return -float(position)


class ScriptedWorker:
    """The actor. ``answer``/``fail`` settle the oldest plan it has received; ``duplicate``
    and ``late`` send results the Scheduler must drop."""

    def __init__(self, inbox: Inbox[StepPlan], results: Outbox[StepResult],
                 vocab: Sequence[int], eos_id: int, block_size: int = 4) -> None:
        self.inbox, self.results = inbox, results
        self.block_size = block_size
        self.kv: dict[int, tuple[int, ...] | None] = {}  # slot -> prefix (None: garbage)
        self.contexts: dict[str, list[int]] = {}  # rid -> its tokens, as the plans told
        self.kv_errors: list[str] = []  # invariant 9; the World reports them
        self.vocab, self.eos_id = tuple(vocab), eos_id
        # Received, not yet answered; with each row's whole block table as of that step.
        self.pending: deque[tuple[StepPlan, dict[str, tuple[int, ...]]]] = deque()
        self.tables: dict[str, list[int]] = {}  # rid -> its block table, from the diffs
        self._free_rows: list[list[int]] = []  # rows let go, for the next rids (slots)
        self.known: set[str] = set()  # rids whose sampling state it holds (like the real one)
        self.prompts: dict[str, tuple[int, ...]] = {}  # from NewSeqData, for prompt logprobs
        self.sent: list[StepResult] = []  # every result, duplicates and stale ones included
        self.outgoing: deque[StepResult] = deque()  # decided, not yet on the wire
        self._wake = trio.Event()
        self.protocol_errors: list[str] = []
        # rid -> (position, token) of its last sample, for plans that feed it forward.
        self.last_sample: dict[str, tuple[int, int]] = {}
        self.fed_forward = 0
        # Speculation: rid -> position -> the token it emitted there (this incarnation);
        # rows verified, and those that rejected a draft.
        self.emitted: dict[str, dict[int, int]] = {}
        self.drafts_verified = self.drafts_rejected = self.drafts_all_accepted = 0
        # Rows planned ahead: rid -> the tokens the Scheduler sent for its lookups; the
        # rows that drafted.
        self.ahead_tokens: dict[str, list[int]] = {}
        self.ahead_drafting = 0

    async def run(self) -> None:
        """Receive plans in one task, send results in order from another."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sender)
            async for plan in self.inbox:
                self.on_plan(plan)

    async def _sender(self) -> None:
        while True:
            while self.outgoing:
                await self.results.send(self.outgoing[0])
                self.outgoing.popleft()
            await self._wake.wait()
            self._wake = trio.Event()

    def on_plan(self, plan: StepPlan) -> None:
        """Apply ``new``/``forget`` and the block-table diffs as ``worker.runner.ModelRunner``
        does; queue the step."""
        self._drop(plan, last_step=False)
        rows = plan.seqs
        tables = {}
        for s in rows:
            if s.new is not None:
                self.known.add(s.rid)
                self.prompts[s.rid] = s.new.prompt_token_ids
                self.contexts[s.rid] = [*s.new.prompt_token_ids, *s.new.output_token_ids]
                if not s.new.output_token_ids:  # a new incarnation (not back from preemption)
                    self.emitted[s.rid] = {}
                self._forget_table(s.rid)  # back after preemption: its table starts afresh
            elif s.rid not in self.known:
                self.protocol_errors.append(
                    f"step {plan.step_id} schedules {s.rid!r} without NewSeqData, "
                    "but the Worker holds no state for it")
            table = self.tables.get(s.rid)
            if table is None:  # a rid it has not seen: the next free row (a slot)
                table = self.tables[s.rid] = self._free_rows.pop() if self._free_rows else []
            table.extend(s.new_blocks)
            tables[s.rid] = tuple(table)
        self._drop(plan, last_step=True)
        self.pending.append((plan, tables))

    def _drop(self, plan: StepPlan, last_step: bool) -> None:
        """Let go of the rids in ``plan.drop``: before the step those it does not run,
        after it those it runs one last time (as ModelRunner does)."""
        runs = {s.rid for s in plan.seqs if s.new is None}
        for rid in plan.drop:
            if (rid in runs) == last_step:
                self.known.discard(rid)
                self._forget_table(rid)

    def _forget_table(self, rid: str) -> None:
        """``rid``'s row is emptied and free for another rid (as a Worker slot is)."""
        row = self.tables.pop(rid, None)
        if row is not None:
            row.clear()
            self._free_rows.append(row)

    # --- what the test calls (inside the trio run); results leave in call order ---------

    def answer(self, salt: int = 0, eos_mask: int = 0) -> StepResult:
        """Take the oldest plan and build its result; bit i of ``eos_mask``: seq i samples eos."""
        plan, tables = self.pending.popleft()
        plan, ahead = self._resolve_ahead(plan)
        for s in plan.seqs:
            if s.new is not None:
                self.last_sample.pop(s.rid, None)  # a fresh state: nothing sampled yet
            if FEED_LAST_SAMPLE in s.token_ids:
                self._check_fed(plan.step_id, s.rid, s.start_pos, s.token_ids)
        plan = self._fill(plan, tables, salt)  # (a draft model's proposals, if any)
        self._run_kv(plan, tables)
        tokens: list[int] = []
        counts: list[int] = []
        drafts = plan.num_drafts or (0,) * plan.num_rows
        sampling = [(s, d) for s, d in zip(plan.seqs, drafts, strict=True) if s.sample]
        for i, (s, d) in enumerate(sampling):
            row = self._verify(s, d, salt, tables[s.rid]) if d else []
            pos = s.start_pos + len(s.token_ids) - d + len(row)
            tid = self.eos_id if eos_mask >> i & 1 else scripted_token(self.vocab, s.rid, pos, salt)
            if len(row) < d and tid == s.token_ids[len(s.token_ids) - d + len(row)]:
                tid = self.vocab[(self.vocab.index(tid) + 1) % len(self.vocab)] \
                    if tid in self.vocab else self.vocab[0]  # a rejection emits another token
            row.append(tid)
            for k, t in enumerate(row):
                self.emitted.setdefault(s.rid, {})[pos - len(row) + 1 + k] = t
            tokens.extend(row)
            counts.append(len(row))
            self.last_sample[s.rid] = (pos, tid)
        reports = []
        for s in plan.seqs:
            if s.prompt_logprobs_from is None:
                continue
            prompt = self.prompts[s.rid]
            lo = max(s.prompt_logprobs_from, s.start_pos + 1)
            hi = min(s.start_pos + len(s.token_ids), len(prompt) - 1)
            reports.append(PromptLogprobs(s.rid, lo, tuple(
                TokenLogprob(prompt[p], prompt_score(p)) for p in range(lo, hi + 1))))
        return self._record(StepResult(plan.step_id, tuple(tokens),
                                       prompt_logprobs=tuple(reports),
                                       num_sampled=tuple(counts) if plan.num_drafts else (),
                                       ahead_drafted=ahead[0], ahead_kinds=ahead[1]))

    def _resolve_ahead(self, plan: StepPlan
                       ) -> tuple[StepPlan, tuple[tuple[int, ...], tuple[int, ...]]]:
        """``plan`` with its ahead rows started and drafted for (see the module docstring),
        and per such row the drafts it runs and the match length they came from."""
        for s in plan.seqs:
            if s.new is not None:
                self.ahead_tokens.pop(s.rid, None)  # its Worker state starts afresh
        a = plan.ahead
        if a is None:
            return plan, ((), ())
        kinds = a.n_max - a.n_min + 1
        ids, num, start = [], list(plan.num_tokens), list(plan.start_pos)
        drafts_of = list(plan.num_drafts or (0,) * plan.num_rows)
        drafted: list[int] = []
        found: list[int] = []
        rows = dict(zip(a.rows, range(len(a.rows)), strict=True))
        at = sent_at = 0
        for i, (rid, n) in enumerate(zip(plan.rids, plan.num_tokens, strict=True)):
            row = plan.token_ids[at:at + n]
            at += n
            j = rows.get(i)
            if j is None:
                ids.extend(row)
                continue
            held = self.ahead_tokens.setdefault(rid, [])
            sent = a.hist_tokens[sent_at:sent_at + a.hist_num[j]]
            sent_at += a.hist_num[j]
            if a.hist_from[j] != len(held) or row[0] != FEED_LAST_SAMPLE:
                self.protocol_errors.append(
                    f"step {plan.step_id}: {rid!r} planned ahead as {row}, its lookup tokens "
                    f"sent from {a.hist_from[j]} where {len(held)} are held")
            held.extend(sent)
            pos, token = self.last_sample.get(rid, (plan.start_pos[i], -1))
            caps = a.caps[j * kinds:(j + 1) * kinds]
            drafts: list[int] = []
            match = 0
            start[i] = pos  # (after a failed step, -1: a stand-in where that step ended)
            if token != -1:
                tokens = [*self.contexts.get(rid, [])[:pos], token]
                if pos > plan.start_pos[i] or held != tokens[:len(held)]:
                    self.protocol_errors.append(
                        f"step {plan.step_id}: {rid!r} planned ahead from {plan.start_pos[i]}"
                        f" with lookup tokens {held}; its last sample is at {pos}, its "
                        f"tokens {tokens}")
                if max(caps):
                    drafts, match = lookup_ngram(tokens, max(caps), a.n_min, a.n_max)
                    drafts = drafts[:caps[match - a.n_min]] if match else []
            self.ahead_drafting += bool(drafts)
            ids.extend((FEED_LAST_SAMPLE, *drafts))
            num[i], drafts_of[i] = 1 + len(drafts), len(drafts)
            drafted.append(len(drafts))
            found.append(match)
        plan = attrs.evolve(plan, token_ids=tuple(ids), num_tokens=tuple(num),
                            start_pos=tuple(start), ahead=None,
                            num_drafts=tuple(drafts_of) if any(drafts_of) else ())
        return plan, (tuple(drafted), tuple(found))

    def _fill(self, plan: StepPlan, tables: dict[str, tuple[int, ...]],
              salt: int) -> StepPlan:
        """The plan the target runs: this one (n-gram drafts come in the plan; a draft
        model's Worker fills its placeholders here: sim/scripted_draft.py)."""
        return plan

    def _verify(self, s: ScheduledSeq, d: int, salt: int, table: Sequence[int]) -> list[int]:
        """The drafts a speculating row accepts (decided by the salt and the rid). The
        rejected ones leave garbage where they were written and leave the context; the
        accepted ones must be the tokens whose K/V the step wrote there."""
        accepted = (salt + zlib.crc32(s.rid.encode())) % (d + 1)
        self.drafts_verified += 1
        self.drafts_rejected += accepted < d
        self.drafts_all_accepted += accepted == d
        first_draft = s.start_pos + len(s.token_ids) - d
        keep = first_draft + accepted  # positions before it hold accepted tokens
        ctx = self.contexts.get(s.rid, [])
        del ctx[keep:]
        for p in range(keep, s.start_pos + len(s.token_ids)):
            self.kv[self._slot(table, p)] = None
        tokens = list(s.token_ids[len(s.token_ids) - d:][:accepted])
        if ctx[first_draft:keep] != tokens:
            self.kv_errors.append(f"{s.rid!r} accepts drafts {tokens} at positions "
                                  f"{first_draft}.., but their K/V was computed over "
                                  f"{ctx[first_draft:keep]}")
        return tokens

    def check_outputs(self, rid: str, committed: Sequence[int]) -> str | None:
        """Why ``rid``'s committed outputs are not what this Worker emitted, or None."""
        emitted, prompt = self.emitted.get(rid), self.prompts.get(rid)
        if emitted is None or prompt is None:
            return None
        for i, token in enumerate(committed):
            want = emitted.get(len(prompt) + i)
            if want is not None and want != token:
                return (f"{rid!r} committed {token} as output {i}, the Worker emitted {want} "
                        f"there (a rejected draft?)")
        return None

    def _check_fed(self, step: int, rid: str, start: int, ids: tuple[int, ...]) -> None:
        """A fed-forward row must start with it (then drafts, if planned ahead), at the
        position this Worker sampled last for the rid, in a step after the one that
        sampled it (as ModelRunner checks). After a failed step the real Worker feeds a
        stand-in (token -1 here): the Scheduler has failed those sequences and drops
        whatever the later step makes for them."""
        last = self.last_sample.get(rid)
        if ids[0] != FEED_LAST_SAMPLE or FEED_LAST_SAMPLE in ids[1:] or last is None \
                or last[0] != start:
            self.protocol_errors.append(
                f"step {step} feeds {rid!r} its last sample at position {start} "
                f"(tokens {ids}), but its last sample was {last}")
        self.fed_forward += 1
    def _slot(self, table: Sequence[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _check_reads(self, kv: dict[int, tuple[int, ...] | None], table: Sequence[int],
                     ctx: Sequence[int], upto: int, reader: str) -> None:
        """A kv error for the first of positions ``0 .. upto - 1`` whose K/V in ``kv`` (the
        target's cache, or a draft model's) was not computed over ``ctx`` up to it."""
        for p in range(upto):
            got = kv.get(self._slot(table, p))
            if got != tuple(ctx[: p + 1]):
                self.kv_errors.append(
                    f"{reader} reads position {p} from block {table[p // self.block_size]}, "
                    f"which holds the K/V of {got} instead of {tuple(ctx[: p + 1])}")
                return

    def _run_kv(self, plan: StepPlan, tables: dict[str, tuple[int, ...]],
                failed: bool = False) -> None:
        """Check what the step reads against the reference KV cache, then write its new
        tokens' prefixes (garbage if it failed). A row reads and writes through its block
        table as the diffs built it."""
        writes: list[tuple[int, tuple[int, ...] | None]] = []
        for s in plan.seqs:
            table = tables[s.rid]
            end = s.start_pos + len(s.token_ids)
            if len(table) * self.block_size < end:
                self.kv_errors.append(f"step {plan.step_id}: {s.rid!r} runs to position "
                                      f"{end - 1}, its block table {table} ends before")
                continue
            ctx = self.contexts.setdefault(s.rid, [])
            for i, tok in enumerate(s.token_ids):
                if tok == FEED_LAST_SAMPLE:  # checked by _check_fed; -1 after a failed step
                    tok = self.last_sample.get(s.rid, (0, -1))[1]
                p = s.start_pos + i
                want = self.emitted.get(s.rid, {}).get(p)
                if want is not None and tok != want and tok != -1 and p < s.start_pos + len(
                        s.token_ids) - (plan.num_drafts[plan.rids.index(s.rid)]
                                        if plan.num_drafts else 0):
                    self.kv_errors.append(f"step {plan.step_id}: {s.rid!r} position {p} is "
                                          f"fed token {tok}; the Worker emitted {want} there")
                if p == len(ctx):
                    ctx.append(tok)
                elif p > len(ctx) or ctx[p] != tok:
                    self.kv_errors.append(f"step {plan.step_id}: {s.rid!r} position {p} "
                                          f"is token {tok}, its context says {ctx[p:p + 1]}")
            # A rid a failed step named (its stand-in, -1): the Scheduler failed it, and a
            # step planned ahead still runs it on whatever the cache holds (dropped unread).
            failed = self.last_sample.get(s.rid, (0, 0))[1] == -1
            if not failed:
                self._check_reads(self.kv, table, ctx, s.start_pos,
                                  f"step {plan.step_id}: {s.rid!r}")
            for i in range(len(s.token_ids)):
                p = s.start_pos + i
                writes.append((self._slot(table, p),
                               None if failed else tuple(ctx[: p + 1])))
        self.kv.update(writes)

    def fail(self) -> StepResult:
        """Take the oldest plan; its step failed (sampled nothing)."""
        plan, tables = self.pending.popleft()
        plan, _ = self._resolve_ahead(plan)
        self._run_kv(plan, tables, failed=True)
        for s in plan.seqs:  # sampled nothing: a later step may feed these a stand-in
            self.last_sample[s.rid] = (s.start_pos + len(s.token_ids), -1)
        return self._record(StepResult(plan.step_id, error="scripted step failure"))

    def duplicate(self) -> StepResult:
        """The last result again (a retransmission)."""
        return self._record(self.sent[-1])

    def late(self, back: int) -> StepResult:
        """A result for a step answered ``back`` results ago, with tokens it never had."""
        old = self.sent[-1 - back % len(self.sent)]
        tokens = tuple(self.vocab[0] for _ in old.token_ids)
        return self._record(StepResult(old.step_id, tokens))

    def _record(self, result: StepResult) -> StepResult:
        self.sent.append(result)
        self.outgoing.append(result)
        self._wake.set()
        return result

    def drain_problems(self) -> list[str]:
        problems = list(self.protocol_errors)
        if self.outgoing:
            problems.append(f"worker has {len(self.outgoing)} results not yet sent")
        if self.pending:
            problems.append(
                f"worker holds unanswered steps {[p.step_id for p, _ in self.pending]}")
        if self.known:
            problems.append(f"worker holds sampling state for {sorted(self.known)}")
        if self.tables:
            problems.append(f"worker holds block tables for {sorted(self.tables)}")
        return problems
