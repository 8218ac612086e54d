"""The Worker's side of rows planned ahead that it must start or draft for (``AheadRows``,
docs/architecture.md, "Speculating under overlap").

Under overlap scheduling a decode row is planned while the step before it still samples
for it. If that step carries drafts, how many it accepts (so where the row starts) is
known here only; if the row speculates, its drafts continue its last tokens, which only
the Worker has. So the Scheduler sends such a row as ``FEED_LAST_SAMPLE`` and
placeholders, and :meth:`AheadLookup.resolve` makes it a plain speculating row before
the step is packed: it starts after the rid's last sample, and its drafts are the n-gram
lookup's (text/ngram.py) over the tokens the Scheduler sent (``AheadRows.hist_*``, kept
here per rid) and the ones the rid's previous step emitted, as many as ``caps`` allows
for the kind of match found. The row may then carry fewer drafts than placeholders: the
Scheduler's count stays its own, the result says how many ran.
"""

from __future__ import annotations

import attrs
import numpy as np

from actorllm.text.ngram import index_positions, lookup_indexed
from actorllm.wire.steps import FEED_LAST_SAMPLE, StepPlan


class AheadLookup:
    """Per rid, the tokens the Scheduler sent for lookups (a prefix of its tokens), with
    each token's positions among them, so a lookup scans no history."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.where: dict[str, dict[int, list[int]]] = {}
        # What the last step emitted for each rid whose drafts it verified (its others
        # emitted one token each, the sampling batch's last_token).
        self.runs: dict[str, list[int]] = {}
        self.drafting_rows = 0  # rows resolved that ran drafts (tests, counters)

    def __len__(self) -> int:
        return len(self.tokens)

    def drop(self, rid: str) -> None:
        self.tokens.pop(rid, None)
        self.where.pop(rid, None)

    def clear(self) -> None:
        self.tokens.clear()
        self.where.clear()
        self.runs = {}

    def ran(self, plan: StepPlan, verified: dict[int, list[int]]) -> None:
        """Step ``plan`` emitted ``verified`` (sampling row: tokens) for its speculating
        rows: what a row planned ahead of the next step continues."""
        if verified:
            rids = plan.sampled_rids()
            self.runs = {rids[j]: run for j, run in verified.items()}
        elif self.runs:
            self.runs = {}

    def extend(self, rid: str, at: int, new: tuple[int, ...] | list[int]) -> list[int]:
        """``rid``'s tokens with ``new`` appended at position ``at``; ValueError unless
        ``at`` is how many it holds (the Scheduler's count and this one disagree)."""
        tokens = self.tokens.setdefault(rid, [])
        where = self.where.setdefault(rid, {})
        if at != len(tokens):
            raise ValueError(f"rid {rid!r}: lookup tokens sent from position {at}, "
                             f"{len(tokens)} held")
        index_positions(where, new, at)
        tokens.extend(new)
        return tokens

    def lookup(self, rid: str, recent: list[int], k: int, n_min: int, n_max: int
               ) -> tuple[list[int], int]:
        """Drafts for ``rid`` whose held tokens are followed by ``recent`` (not held: the
        previous step's), and the match length (0: none)."""
        held = self.tokens[rid]
        last = recent[-1]
        base = len(held)

        def earlier() -> list[int]:
            return [*self.where[rid].get(last, ()),
                    *(base + i for i, t in enumerate(recent[:-1]) if t == last)]

        # ``recent`` joins the held list for the lookup only, rather than a copy of the
        # whole history every step (the Scheduler's lookup avoids that copy too).
        held.extend(recent)
        try:
            return lookup_indexed(held, k, n_min, n_max, earlier,
                                  lambda: np.asarray(held, dtype=np.int64))
        finally:
            del held[base:]

    def resolve(self, plan: StepPlan, slot_of: dict[str, int], cols: dict[str, np.ndarray],
                failed: frozenset[str]) -> tuple[StepPlan, tuple[int, ...], tuple[int, ...]]:
        """``plan`` with each ahead row started after its rid's last sample (``cols``: the
        sampling batch's columns, by slot) and its placeholders replaced by the lookup's
        drafts; with the drafts each ran and the match length each found.

        The tokens each rid's previous step emitted are ``runs`` where it verified drafts,
        else the one it sampled (``last_token``). A rid of a failed previous step
        (``failed``) runs a stand-in at the planned start: the Scheduler has failed it
        and drops what it makes. ValueError where the rid's state does not fit the row."""
        ahead = plan.ahead
        assert ahead is not None
        kinds = ahead.n_max - ahead.n_min + 1
        starts = np.cumsum((0, *plan.num_tokens))
        rows: dict[int, list[int]] = {}
        begin: dict[int, int] = {}
        drafted: list[int] = []
        found: list[int] = []
        at = 0
        for j, i in enumerate(ahead.rows):
            rid = plan.rids[i]
            caps = ahead.caps[j * kinds:(j + 1) * kinds]
            sent = ahead.hist_tokens[at:at + ahead.hist_num[j]]
            at += ahead.hist_num[j]
            if plan.token_ids[int(starts[i])] != FEED_LAST_SAMPLE \
                    or plan.num_tokens[i] < 1 + max(caps):
                raise ValueError(f"rid {rid!r}: a row planned ahead holds "
                                 f"{plan.token_ids[starts[i]:starts[i + 1]]}, caps {caps}")
            if rid in failed:
                rows[i], begin[i] = [0], plan.start_pos[i]
                drafted.append(0)
                found.append(0)
                continue
            held = self.extend(rid, ahead.hist_from[j], sent) if sent or max(caps) else None
            start, last, emitted = self._last(rid, plan, i, slot_of, cols, held, self.runs)
            drafts, n = self.lookup(rid, emitted, max(caps), ahead.n_min, ahead.n_max) \
                if held is not None and max(caps) else ([], 0)
            drafts = drafts[:caps[n - ahead.n_min]] if n else []
            rows[i], begin[i] = [last, *drafts], start
            drafted.append(len(drafts))
            found.append(n)
            self.drafting_rows += bool(drafts)
        return _rebuilt(plan, rows, begin), tuple(drafted), tuple(found)

    @staticmethod
    def _last(rid: str, plan: StepPlan, i: int, slot_of: dict[str, int],
              cols: dict[str, np.ndarray], held: list[int] | None,
              runs: dict[str, list[int]]) -> tuple[int, int, list[int]]:
        """Row ``i``'s start (its rid's last sample's position), that sample, and the
        tokens its previous step emitted (what the Scheduler did not know yet), checked
        against the plan: the start at most the planned one, and those tokens, after
        the ``held`` ones, exactly reaching it."""
        slot = slot_of.get(rid)
        if slot is None or not cols["occupied"][slot] or not cols["num_out"][slot]:
            raise ValueError(f"rid {rid!r}: planned ahead, but nothing was sampled")
        end = int(cols["prompt_len"][slot] + cols["num_out"][slot])
        last = int(cols["last_token"][slot])
        if end - 1 > plan.start_pos[i]:
            raise ValueError(f"rid {rid!r}: its last sample is at position {end - 1}, "
                             f"past the row's planned start {plan.start_pos[i]}")
        emitted = [last]
        if held is not None:
            new = end - len(held)
            emitted = runs.get(rid, emitted) if new > 1 else emitted
            if new < 1 or len(emitted) != new:
                raise ValueError(f"rid {rid!r}: {len(held)} tokens held and {len(emitted)} "
                                 f"emitted since, for a row after position {end - 1}")
        return end - 1, last, emitted


def _rebuilt(plan: StepPlan, rows: dict[int, list[int]], begin: dict[int, int]) -> StepPlan:
    """``plan`` with rows ``rows`` holding these tokens from ``begin``, as a plain plan."""
    ids: list[int] = []
    num: list[int] = []
    start = list(plan.start_pos)
    at = 0
    for i, n in enumerate(plan.num_tokens):
        got = rows.get(i)
        if got is None:
            ids.extend(plan.token_ids[at:at + n])
            num.append(n)
        else:
            ids.extend(got)
            num.append(len(got))
            start[i] = begin[i]
        at += n
    drafts: tuple[int, ...] = ()
    if plan.num_drafts:
        d = list(plan.num_drafts)
        for i, got in rows.items():
            d[i] = len(got) - 1
        drafts = tuple(d) if any(d) else ()
    return attrs.evolve(plan, token_ids=tuple(ids), num_tokens=tuple(num),
                        start_pos=tuple(start), num_drafts=drafts, ahead=None)
