"""Speculative decoding's cost model (scheduler/speculation.py decides by it): what a
row's drafts cost and what they are expected to save, in plain decode steps of one row,
measured on the CPU with the embedded model (docs/architecture.md "Speculative decoding",
"The cost model sees the batch").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

#: The cost model, in plain decode steps of one row (1.7 ms on the CPU with the embedded
#: model; docs/architecture.md "Speculative decoding", "The cost model sees the batch").
#: Each row a plain step carries beyond the first adds this much (its forward share and
#: the host's work per row: TPOT 1.8, 2.3 and 4.4 ms at 1, 4 and 16 rows), so a step a
#: row saves is worth ``plain_step(rows) / rows``: 1 alone, 0.32 of 4 rows.
ROW_COST = 0.09
#: A draft token's forward, alone and beside other rows: a lone row's drafts ride on
#: the weight reads its token pays anyway (one row and 8 drafts: +0.33 ms, 0.03 each);
#: beside other rows each costs about a row (4 rows of 2 drafts at acceptance 0.63 broke
#: even in the quiet runs: ~0.15 a draft once the verification is counted apart).
TOKEN_COST = (0.03, 0.15)
#: A lone row's tokens are the linears' GEMM rows, taken in blocks of ROW_BLOCK: a step
#: that starts another block pays BLOCK_COST more (in the engine, 8 drafts against 7:
#: +0.17 and +0.22 of a one-row step, ~0.03 a draft below; on the CPU only: docs).
ROW_BLOCK, BLOCK_COST = 8, 0.18
#: A row that verifies drafts costs this much more (the verification, its share of the
#: sampler, the lookup) ...
VERIFY_COST = 0.12
#: ... and each of its drafts this much on top of the target's token: a draft model's
#: pass of the draft.
DRAFT_COST = {"ngram": 0.0, "draft_model": 0.07}


def plain_step(rows: int) -> float:
    """What a plain decode step of ``rows`` rows costs, in plain steps of one row."""
    return 1.0 + ROW_COST * (max(rows, 1) - 1)


def draft_gain(alpha: float, k: int, draft_cost: float, rows: int = 1,
               block: float = 0.0) -> float:
    """Expected steps a row saves minus the extra cost of its ``k`` drafts, in steps of
    that row (``plain_step(rows) / rows``) in a batch of ``rows`` rows: its drafts are
    each accepted with probability ``alpha`` once the previous one was, and each accepted
    one saves the row a step. ``draft_cost``: what a draft costs beyond the target's
    token (``DRAFT_COST``); ``block``: what a lone row's step pays for each ROW_BLOCK
    tokens it starts past the first (BLOCK_COST on the CPU)."""
    if k < 1:
        return 0.0
    return deque(_gains(alpha, k, draft_cost, rows, block), maxlen=1)[0]


def best_drafts(alpha: float, cap: int, draft_cost: float, rows: int = 1,
                block: float = 0.0) -> int:
    """The draft count in [0, cap] with the largest :func:`draft_gain` (0: none pays)."""
    best, top = 0, 0.0
    for k, gain in enumerate(_gains(alpha, cap, draft_cost, rows, block), 1):
        if gain > top:
            best, top = k, gain
    return best


def pays_from(cap: int, draft_cost: float, rows: int, block: float = 0.0
              ) -> tuple[float, float]:
    """``(lo, hi)``: :func:`best_drafts` is 0 at every estimate up to ``lo`` and > 0 from
    ``hi`` on (a draft's gain grows with its acceptance), ``hi - lo`` a float's rounding
    apart; ``(1.0, inf)`` where no estimate pays (an estimate is at most 1)."""
    lo, hi = 0.0, 1.0
    if not best_drafts(hi, cap, draft_cost, rows, block):
        return 1.0, float("inf")
    for _ in range(64):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if best_drafts(mid, cap, draft_cost, rows, block):
            hi = mid
        else:
            lo = mid
    return lo, hi


def _gains(alpha: float, cap: int, draft_cost: float, rows: int, block: float = 0.0
           ) -> Iterator[float]:
    """:func:`draft_gain` for k = 1 .. cap, the sum of powers grown a term at a time (it
    runs for every proposal and, on a miss, for each kind of match the row tried)."""
    scale = max(rows, 1) / plain_step(rows)
    verify, per_draft = VERIFY_COST * scale, (draft_cost + TOKEN_COST[rows > 1]) * scale
    block = block if rows <= 1 else 0.0  # (beside other rows it is not the row's own)
    accepted, power = 0.0, 1.0
    for k in range(1, cap + 1):
        power *= alpha
        accepted += power
        yield accepted - verify - per_draft * k - block * (k // ROW_BLOCK)
