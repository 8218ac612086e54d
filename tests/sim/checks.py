"""The World's checks of what clients read and of the pool, after every rule and at drain
(DESIGN.md §3; the merged histories are checked by :class:`~sim.recorder.Recorder`)."""


from __future__ import annotations

from typing import Any

from actorllm.lifecycle.table import State

from .recorder import Client, Incarnation, Recorder, WorldFields
from .scripted_worker import prompt_score


class Checks(WorldFields):
    """Mixed into :class:`~sim.world.World`."""

    # --- checks ------------------------------------------------------------------------------

    def _check_choice(self, client: Client, index: int) -> None:
        """Invariants 2 (nothing past the stop) and 7 (text == decode(committed ids))."""
        inc = client.choice(index)
        if inc is None:
            self.report("2", f"{client.rid!r}: output for choice {index}, never registered")
            return
        ids, text = client.ids[index], "".join(client.text[index])
        committed = inc.committed
        p = client.params
        where = f"{inc.rid!r} (choice {index})"
        if ids != committed[: len(ids)]:
            self.report("7", f"{where}: the client read ids {ids}, the Scheduler committed "
                        f"{committed}")
            return
        k, ref, _ = self.text.reference(ids, p.stop, p.include_stop_str_in_output)
        if k is not None and k < len(ids):
            self.report("2", f"{where}: output after the stop string matched at token {k}: "
                        f"ids {ids}, text {text!r}")
            return
        if not ref.startswith(text):
            self.report("7", f"{where}: the client read {text!r}, decode gives {ref!r}")
            return
        if not self._check_prompt_logprobs(client, index, where):
            return
        if index not in client.reason:
            return
        reason, stop_reason = client.reason[index]
        kc, full, stop = self.text.reference(committed, p.stop, p.include_stop_str_in_output)
        want = committed[:kc] if kc is not None else committed
        if ids != want or text != full:
            self.report("7", f"{where} finished ({reason}) having read {ids} / {text!r}; "
                        f"committed {committed} decode to {full!r}")
            return
        if not inc.terminal:
            self.report("2", f"{where}: a finish reached the client before any terminal event")
            return
        event, decided = inc.terminal[0]
        if event in ("fail", "reject"):
            self.report("2", f"{where} ended by {event}, yet the client read a finish")
        elif event == "abort":
            expected: tuple[str, object] = ("abort", None)
        elif stop is not None:
            expected = ("stop", stop)
        else:
            expected = (str(decided), None)
            justified = (len(committed) == p.max_tokens if decided == "length" else
                         bool(committed) and committed[-1] == self.text.eos_id)
            if not justified:
                self.report("7", f"{where} finished {decided!r} after {committed}, which "
                            "neither reached max_tokens nor ended in eos or a stop string")
        if event not in ("fail", "reject") and (reason, stop_reason) != expected:
            self.report("7", f"{where}: the client read finish {(reason, stop_reason)}, "
                        f"expected {expected} ({event})")

    def _check_prompt_logprobs(self, client: Client, index: int, where: str) -> bool:
        """Each prompt position reported once, in order, before any token (invariant 7)."""
        got = [None if e is None else (e.token_id, e.logprob)
               for e in client.prompt_lps.get(index, ())]
        if client.params.prompt_logprobs is None:
            want: list[Any] = []
        else:
            ids = client.prompt_ids
            want = [None] + [(ids[p], prompt_score(p)) for p in range(1, len(ids))]
        complete = bool(client.ids.get(index)) or (
            index in client.reason and client.reason[index][0] != "abort")
        if got != want[: len(got)] or (complete and got != want):
            self.report("7", f"{where}: prompt logprobs read {got}, expected {want}")
            return False
        return True

    def _check_final(self, client: Client) -> None:
        """The request's end as its client sees it: invariants 2 and 6."""
        inc = client.inc
        assert inc is not None
        choices = [inc] if client.n == 1 else Recorder.children_of(inc)
        code = None if client.error is None else client.error.code
        # A lost request may have no terminal event; a timed-out reader may read its error
        # before the abort reaches the Scheduler.
        excused = (code == "engine_dead" and self.dead) or \
            (code == "stream_timeout" and client.timed_out)
        if client.n > 1:
            unended = [c.describe() for c in choices if not c.terminal]
            unended += [f"{client.rid}-{i}" for i in range(client.n) if i not in inc.child_incs]
            # An error may reach the client at once (the Frontend then aborts the siblings,
            # which drain() checks); a successful final output only after every child ended.
            if unended and client.error is None:
                self.report("6", f"the client of {client.rid!r} read the final output while "
                            f"children have not ended: {unended}")
        elif not inc.terminal and not excused:
            self.report("2", f"{client.rid!r}: final output before any terminal event")
        if excused:
            return  # (_on_timeout and _check_lost judge these)
        if client.error is not None and not any(
                t[0] in ("fail", "reject") for c in choices for t in c.terminal):
            self.report("2", f"{client.rid!r}: the client got an error ({client.error}) but no "
                        "choice failed")

    def _check_lost(self, client: Client) -> None:
        """After the engine died: a request live then ended with an error (``engine_dead``
        unless another came first); one answered before kept its answer (invariant 2)."""
        if client.outcome != "accepted" or client.inc is None or client.disconnected:
            return  # (a client that left reads nothing)
        if client.error is not None and client.error.code == "engine_dead":
            if client.inc.events[0][0] >= (self.death_mark or 0):
                self.report("2", f"{client.rid!r} came after the death, yet was accepted")
            return
        choices = [client.inc] if client.n == 1 else Recorder.children_of(client.inc)
        late = [c.describe() for c in choices
                if (r := c.index_of("respond")) is None or r >= (self.death_mark or 0)]
        if late and client.error is None:  # (an earlier error, a child's, stands)
            self.report("2", f"{client.rid!r} was live when the engine died, yet its client "
                        f"read {client.error or client.reason}: {late}")

    def _check_abort_reached(self, client: Client, mark: list[int | None],
                             drained: bool) -> None:
        """Invariant 5: an abort reaches every choice not answered before the call returned.

        ``mark`` is (call, return) on the Recorder's clock. Right after the call, choices
        registered before it are judged (the Frontend may still be registering the rest);
        at drain, all of them.
        """
        inc = client.inc
        start, end = mark
        if inc is None or end is None:
            return
        choices = {0: inc} if client.n == 1 else dict(inc.child_incs)
        for i in range(client.n):
            c = choices.get(i)
            if c is None:
                if drained:
                    self.report("5", f"{client.rid!r}: choice {i} never registered")
                continue
            if not drained and c.events[0][0] >= start:
                continue
            responded = c.index_of("respond")
            # A choice the engine's death answered needs no abort: what the abort had to
            # reach died with the engine, and a message for a forgotten rid must not be sent
            # (invariant 1: it could reach the rid's next incarnation).
            lost = c.index_of("lose") is not None
            # A stream timeout's aborts go out from the Frontend's abort sender, after the
            # timeout: a choice answered before the sender took up its abort needs none.
            # (One never taken up is judged from the timeout: a missing abort shows.)
            answered_by = end
            if mark is client.timeout_mark and c.timeout_abort_at is not None:
                answered_by = max(end, c.timeout_abort_at)
            if (responded is None or responded >= answered_by) and c.aborts_sent == 0 \
                    and not lost \
                    and not (not drained and self._abort_pending(c)):
                self.report("5", f"{client.rid!r} was aborted, yet no abort was sent for "
                            f"choice {i}: {c.describe()}")

    def _check_siblings_aborted(self, client: Client) -> None:
        """Invariant 5 for the Frontend's own aborts: once a child fails, every sibling that
        had not been answered by then is aborted."""
        children = Recorder.children_of(client.inc)  # type: ignore[arg-type]
        failed = [i for c in children for i, _, e in c.events if e in ("fail", "reject")]
        if not failed:
            return
        for c in children:
            if c.terminal and c.terminal[0][0] in ("fail", "reject"):
                continue
            if c.index_of("respond") is None and c.aborts_sent == 0:
                self.report("5", f"a child of {client.rid!r} failed, yet its sibling was not "
                            f"aborted: {c.describe()}")

    def _abort_pending(self, inc: Incarnation) -> bool:
        """Whether the Frontend has decided to abort ``inc`` but holds the abort until the
        request itself has left (submit sends it right after). drain() checks it went."""
        st = self.frontend.registry.get(inc.rid)
        return st is not None and self.rec.current.get(inc.rid) is inc and st.abort_sent

    def check(self) -> None:
        """Raise the first violation found so far; then check the pool (invariant 3), parents
        (6) and aborts nobody asked for (5)."""
        self._check_pool()
        self._check_paused()
        for inc in self.rec.all:
            if inc.children and not inc.ended and len(inc.child_incs) == len(inc.children) \
                    and all(c.ended for c in inc.child_incs.values()):
                self.report("6", f"every child of {inc.rid!r} was released, yet it was not "
                            "gathered")
            aborted_at = inc.index_of("abort")
            if aborted_at is not None:
                top = inc.parent or inc
                client = next((c for c in self.clients if c.inc is top), None)
                asked = client is None or any(m[0] <= aborted_at  # type: ignore[operator]
                                              for m in client.abort_marks)
                # A child's error aborts its siblings (the client has its error already).
                failed = [i for c in Recorder.children_of(top) for i, _, e in c.events
                          if e in ("fail", "reject")]
                if not asked and not (failed and min(failed) < aborted_at):
                    self.report("5", f"{inc.describe()} was aborted, but its client never "
                                "asked to abort it")
        if self.violations:
            raise self.violations[0]

    def _check_paused(self) -> None:
        """Invariant 11: a paused sequence holds no running slot (and is in no queue)."""
        s = self.scheduler
        # view.local, not status: a sequence left in a queue by a bug may be freed already
        # (local None), which is the same violation, not a crash of the check.
        for seq in s.running:
            if seq.view.local is not State.RUNNING:
                self.report("11", f"{seq.rid!r} is {seq.view} but holds a running slot")
        queued = {q.rid for q in s.waiting}
        for rid, seq in s.paused.items():
            if seq.view.local is not State.PAUSED or rid in queued:
                self.report("11", f"{rid!r} is paused as {seq.view}, waiting: {rid in queued}")

    def _check_pool(self) -> None:
        """Invariants 3, 8 and 10 on the Scheduler's pool; 9 from the Worker's reference."""
        s = self.scheduler
        pool = s.pool
        free, cached, used = pool.free_blocks(), pool.cached_blocks(), set(pool.refs)
        if len(set(free)) != len(free) or set(free) & set(cached) \
                or set(free) | set(cached) | used != set(range(pool.num_blocks)):
            self.report("3", f"pool inconsistent: free={free} cached={cached} "
                        f"used={sorted(used)}")
        shared = used & (set(free) | set(cached))
        if shared:
            self.report("8", f"blocks {sorted(shared)} have references yet are free or cached "
                        f"(refs {[pool.refs[b] for b in sorted(shared)]})")
        holders: dict[int, list[str]] = {}
        for seq in s.seqs.values():
            if len(set(seq.block_table)) != len(seq.block_table):
                self.report("10", f"{seq.rid!r} holds a block twice: {seq.block_table}")
            for b in seq.block_table:
                holders.setdefault(b, []).append(seq.rid)
        self.shared_seen = self.shared_seen or any(len(h) > 1 for h in holders.values())
        for b in used | set(holders):
            if pool.refs.get(b, 0) != len(holders.get(b, ())):
                self.report("10", f"block {b} has {pool.refs.get(b, 0)} references but is held "
                            f"by {holders.get(b, [])}")
        for b, h in pool.hash_of.items():
            if pool.by_hash.get(h) != b or b in free:
                self.report("9", f"block {b}'s hash maps to block {pool.by_hash.get(h)}"
                            f"{' and it is on the free list' if b in free else ''}")
        for err in self.worker.kv_errors:
            self.report("9", err)
        self.worker.kv_errors.clear()
