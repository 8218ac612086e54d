"""The World's hooks: what it sees of messages, of the Scheduler and of each client's
collector as they happen (inside trio: they record violations, never raise)."""


from __future__ import annotations

from typing import Any

import trio
import trio.testing

from actorllm.lifecycle.table import State
from actorllm.scheduler.kv_pool import extend_hashes
from actorllm.scheduler.policy import order
from actorllm.wire.messages import (
    AbortRequest,
    FlowControl,
    StepResult,
    StopMatched,
)
from actorllm.wire.outputs import EndOfOutput, RequestError

from .bugs import COLLECTOR_BUGS
from .common import message_rids
from .recorder import Client, Incarnation, WorldFields


class Watches(WorldFields):
    """Mixed into :class:`~sim.world.World`."""

    # --- hooks (run inside trio: record, never raise) ----------------------------------------

    def _on_send(self, edge: str, msg: Any) -> Any:
        """A message leaves its sender (it may still wait for room before its wire)."""
        rids = message_rids(msg)
        for rid in rids:
            if rid not in self.rec.current:
                self.report("1", f"{type(msg).__name__} for {rid!r} was sent on {edge} before "
                            "the Frontend registered it")
        if edge == "frontend->tokenizer":
            fe = self.frontend
            if msg.rid not in fe.registry or msg.rid not in fe.ledger.views:
                self.report("1", f"the Frontend sent {type(msg).__name__} for {msg.rid!r} "
                            "while its registry does not hold it")
            elif isinstance(msg, AbortRequest):
                self.rec.current[msg.rid].aborts_sent += 1
        elif edge == "scheduler->worker":
            self.outstanding[msg.step_id] = msg
            # Each row's whole block table, from the diffs (as the Worker holds it).
            tables = self.plan_tables[msg.step_id] = self.table_mirror.apply(msg)
            bs, hashed = self.config.block_size, self.scheduler.pool.hash_of
            for s in msg.seqs:  # invariant 9: a cached block's contents never change
                table = tables[s.rid]
                written = {table[p // bs]  # (a short table is the Worker's error)
                           for p in range(s.start_pos, s.start_pos + len(s.token_ids))
                           if p // bs < len(table)}
                if written & hashed.keys():
                    self.report("9", f"step {msg.step_id} writes {s.rid!r}'s tokens into "
                                f"cached blocks {sorted(written & hashed.keys())}")
            # A recompute asking only for prompt positions not reported before preemption.
            self.recompute_skipped_reported = self.recompute_skipped_reported or any(
                s.prompt_logprobs_from is not None and s.prompt_logprobs_from > s.start_pos + 1
                for s in msg.seqs)
        elif edge == "scheduler->detokenizer":
            for out in msg.outputs:
                if out.rid in self.rec.current:
                    self.rec.current[out.rid].committed.extend(out.token_ids)
                    # Only what the Worker emitted (never a rejected draft) is committed.
                    wrong = out.token_ids and self.worker.check_outputs(
                        out.rid, self.rec.current[out.rid].committed)
                    if wrong:
                        self.report("7", wrong)
        if edge == "tokenizer->scheduler" and isinstance(msg, AbortRequest | FlowControl):
            # Forwarded as it came: tagged with the incarnation the Frontend sent it for
            # (by now the rid may name a newer one).
            return self._tok_tags.pop(id(msg), None)
        return self.rec.current.get(rids[0]) if len(rids) == 1 else None

    def _on_recv(self, box: str, msg: Any, tag: Any) -> None:
        if box == "tokenizer" and isinstance(msg, AbortRequest | FlowControl):
            self._tok_tags[id(msg)] = tag
        if box == "scheduler":
            self._sched_tags[id(msg)] = tag

    def _watch_scheduler(self) -> None:
        """Wrap the Scheduler's ``handle`` and its pool's ``free`` (invariants 3 and 5)."""
        s = self.scheduler
        handle, free = s.handle, s.pool.free

        def checked_handle(msg: Any) -> None:
            why = None  # set: the message must leave the Scheduler exactly as it was
            tag = self._sched_tags.pop(id(msg), None)
            # Invariant 5 rests on the FIFO edge: an abort (or a pause) for a request the
            # Scheduler has not handled would be dropped, and the request run anyway.
            if isinstance(msg, AbortRequest | FlowControl) and isinstance(tag, Incarnation) \
                    and tag.index_of("enqueue") is None and tag.index_of("reject") is None:
                self.report("5", f"{type(msg).__name__} for {msg.rid!r} reached the Scheduler "
                            f"before its request: {tag.describe()}")
            if isinstance(msg, StepResult):
                if self.outstanding.pop(msg.step_id, None) is None:
                    why = f"a stale or duplicated result of step {msg.step_id}"
            elif isinstance(msg, AbortRequest | StopMatched):
                seq = s.seqs.get(msg.rid)
                if seq is not None and seq.drafting and seq.status is not State.FINISHED:
                    self.ended_mid_speculation += 1  # between its proposal and verdict
                if seq is None or seq.status is State.FINISHED:
                    why = f"{type(msg).__name__} for {msg.rid!r}, which has already finished"
                elif isinstance(msg, StopMatched) and tag is not self.rec.current.get(msg.rid):
                    why = (f"StopMatched({msg.rid!r}, {msg.stop!r}) sent for an earlier request "
                           f"with this rid, arriving while {self.rec.current[msg.rid].describe()}"
                           " is live")
            before = self._scheduler_snapshot() if why else None
            handle(msg)
            if why and self._scheduler_snapshot() != before:
                self.report("5", f"{why} changed the Scheduler's state")
            if isinstance(msg, StepResult):
                self._check_hashes()

        def checked_free(blocks: Any) -> None:
            blocks = list(blocks)
            free(blocks)
            for b in blocks:
                if b in s.pool.refs:
                    continue  # another sequence still holds it: only a reference went
                for step in self.outstanding:
                    for rid, table in self.plan_tables[step].items():
                        if b in table:
                            self.report("3", f"block {b} freed while step {step} (which "
                                        f"uses it for {rid!r}) is in flight")

        batch = s.batch
        preempt = batch.preempt

        def checked_preempt(seq: Any) -> None:
            """The priority policy: the victim is always the last running sequence in
            (priority, arrival) order; count the preemptions an urgent arrival caused."""
            if batch.priority and batch.running:
                last = max(batch.running, key=order)
                if last is not seq:
                    self.report("policy", f"{seq.rid!r} (priority {seq.priority}) preempted "
                                f"while {last.rid!r} (priority {last.priority}) runs")
                if batch.waiting and batch.waiting[0].priority < seq.priority:
                    self.urgent_preemptions += 1
            preempt(seq)

        s.handle = checked_handle  # type: ignore[method-assign]
        s.pool.free = checked_free  # type: ignore[method-assign]
        batch.preempt = checked_preempt  # type: ignore[method-assign]

    def _check_hashes(self) -> None:
        """Invariant 9: a sequence's block hashes are over its own tokens (the prompt and
        the outputs committed), never over a draft the Worker rejected."""
        bs = self.config.block_size
        for q in self.scheduler.seqs.values():
            tokens = [*q.prompt_ids, *q.output_ids]
            want = extend_hashes([], tokens, bs, len(tokens))
            if q.block_hashes != want[:len(q.block_hashes)]:
                self.report("9", f"{q.rid!r}'s block hashes are not those of its tokens "
                            f"{tokens} (a hash over a token it does not hold)")

    def _scheduler_snapshot(self) -> tuple[object, ...]:
        s = self.scheduler
        seqs = tuple(sorted((q.rid, q.status, tuple(q.output_ids), tuple(q.block_table),
                             q.num_computed, q.in_flight) for q in s.seqs.values()))
        return (seqs, tuple(q.rid for q in s.waiting), tuple(q.rid for q in s.running),
                tuple(q.rid for q in s.fenced), frozenset(s.pool.refs.items()),
                tuple(p.step_id for p in s.in_flight), tuple(s.worker_drops),
                *(tuple(getattr(s.outgoing, c)) for c in (
                    "rids", "num_tokens", "token_ids", "rare_rows", "rare", "freed")))

    # --- clients ------------------------------------------------------------------------------

    def _link_clients(self) -> None:
        """Find each new client's incarnation and collector (both exist before any output)."""
        for client in self.clients:
            if client.inc is not None or client.expect_duplicate:
                continue
            inc = self.rec.current.get(client.rid)
            st = self.frontend.registry.get(client.rid)
            if inc is None or inc.events[0][0] < client.mark or st is None:
                continue
            client.inc = inc
            client.collector = st.collector
            self._watch_collector(client)

    def _watch_collector(self, client: Client) -> None:
        """Invariant 2 at the collector: nothing is put into it after its final output."""
        col = client.collector
        for bug, variant in COLLECTOR_BUGS.items():
            if bug in self.config.bugs:
                col.__class__ = variant
        put_delta, put_finish, put_error = col.put_delta, col.put_finish, col.put_error
        done: set[int] = set()

        def delta(index: int, *args: Any) -> None:
            if index in done:
                self.report("2", f"{client.rid!r}: output for choice {index} after its finish")
            if client.unread_since is None:
                client.unread_since = trio.current_time()
            put_delta(index, *args)

        def finish(index: int, *args: Any) -> None:
            if index in done:
                self.report("2", f"{client.rid!r}: choice {index} finished twice")
            done.add(index)
            # A choice's end is output for the reader too (a stream's chunk with its
            # finish_reason): while its siblings run, a reader that takes nothing stalls.
            if client.unread_since is None:
                client.unread_since = trio.current_time()
            put_finish(index, *args)

        def error(exc: RequestError) -> None:
            if len(done) == client.n:
                self.report("2", f"{client.rid!r}: an error after the final output")
            if exc.code == "stream_timeout" and not client.timed_out:
                self._on_timeout(client)
            put_error(exc)

        col.put_delta, col.put_finish, col.put_error = delta, finish, error

    def _on_timeout(self, client: Client) -> None:
        """Invariant 11: only a reader that took nothing for ``stream_timeout`` while
        output waited is cancelled; its request is then aborted (checked at drain, as for
        the client's own abort, from this moment)."""
        client.timed_out = True
        timeout = self.config.flow.stream_timeout
        t = trio.current_time()
        if not (client.paused or client.disconnected) or client.unread_since is None \
                or t - max(client.unread_since, client.paused_at) < timeout:
            self.report("11", f"{client.rid!r} was cancelled for a stalled reader at t={t:g}, "
                        f"yet it reads (paused {client.paused}, output waits since "
                        f"{client.unread_since}, stopped reading at {client.paused_at:g})")
        client.timeout_mark = [self.rec.count, self.rec.count]
        client.abort_marks.append(client.timeout_mark)
        # Its live leaves (the Frontend's objects), to know each one's incarnation when the
        # abort sender takes it up: by then its rid may name a newer request.
        inc = client.inc
        for c in ([inc] if client.n == 1 else list(inc.child_incs.values())) if inc else []:
            st = self.frontend.registry.get(c.rid)
            if st is not None and self.rec.current.get(c.rid) is c:
                self._timeout_leaves.append((st, c))

    def _watch_frontend_aborts(self) -> None:
        """Note when the Frontend's abort sender takes up a stream-timeout abort (invariant 5
        for a timeout judges each leaf from then on, not from the timeout)."""
        fe = self.frontend
        abort = fe._abort

        async def noted(st: Any, reason: str = "user") -> None:
            if reason == "stream_timeout":
                for leaf, inc in self._timeout_leaves:
                    if leaf is st and inc.timeout_abort_at is None:
                        inc.timeout_abort_at = self.rec.count
            await abort(st, reason)

        fe._abort = noted

    def _check_stalls(self) -> None:
        """Invariant 11, the other way: a paused reader with output waiting longer than the
        stream timeout has had its request cancelled (unless the engine is done with it)."""
        if self.config.flow is None or self.config.flow.stream_timeout is None:
            return
        t = self.loop.clock.current_time()
        for client in self.clients:
            col = client.collector
            if (client.paused and not client.disconnected and not client.timed_out
                    and client.unread_since is not None and col is not None
                    and not col.engine_done.is_set()
                    and t - max(client.unread_since, client.paused_at)
                    > self.config.flow.stream_timeout):
                self.report("11", f"{client.rid!r}'s reader took nothing from "
                            f"t={max(client.unread_since, client.paused_at):g} to {t:g}, past "
                            f"the stream timeout, yet its request was not cancelled")
        self.check()

    async def _read(self, client: Client) -> None:
        """Read everything the collector has now, through its public ``get``.

        ``get`` returns without a checkpoint when there is news, and waits otherwise; an
        already-cancelled scope turns that wait into "nothing new" at once.
        """
        while not client.final:
            with trio.CancelScope() as scope:
                scope.cancel()
                try:
                    out = await client.collector.get()
                except RequestError as exc:
                    client.error = exc
                    client.final = True
                    self._check_final(client)
                    return
                except EndOfOutput:
                    self.report("2", f"{client.rid!r}: output ended without a final output")
                    return
            if scope.cancelled_caught:
                client.unread_since = None  # it has read all there is
                return
            for c in out.outputs:
                if c.index in client.reason:
                    self.report("2", f"{client.rid!r}: choice {c.index} output after its finish")
                client.text.setdefault(c.index, []).append(c.text)
                client.ids.setdefault(c.index, []).extend(c.token_ids)
                client.prompt_lps.setdefault(c.index, []).extend(c.prompt_logprobs)
                if c.finish_reason is not None:
                    client.reason[c.index] = (c.finish_reason, c.stop_reason)
                self._check_choice(client, c.index)
            if out.finished:
                client.final = True
                if len(client.reason) != client.n:
                    self.report("2", f"{client.rid!r}: final output with choices unfinished")
                self._check_final(client)
