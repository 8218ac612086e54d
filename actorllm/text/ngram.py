"""N-gram prompt lookup, speculative decoding's proposer, as pure functions over a token
list: the tokens that followed the latest earlier occurrence of the list's last n tokens, n
from ``n_max`` down to ``n_min``. Only the earlier copies of the last token are extended
backwards, one by one while they are few. The Scheduler looks up a row whose tokens it
knows (scheduler/ngram.py keeps each row's history across steps); the Worker looks up a
row planned ahead, whose last tokens only it knows yet (worker/ahead.py).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np


def propose_ngram(tokens: Seq[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: for n from ``n_max`` down to ``n_min``, ``k`` tokens continuing the
    latest earlier occurrence of the last n tokens; [] if none occurs."""
    return lookup_ngram(tokens, k, n_min, n_max)[0]


def lookup_ngram(tokens: Seq[int], k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    """:func:`propose_ngram`'s drafts and the match length n (0: none). The continuation
    of the occurrence, ``tokens[i:]``, is taken to repeat past the end (period
    ``len(tokens) - i``), so a row repeating a short phrase gets ``k`` drafts, not only
    the few tokens between the occurrence and the end."""
    arr = np.asarray(tokens, dtype=np.int64)
    # Every occurrence of a suffix ends at an earlier copy of the last token: only those
    # are extended backwards (a caller that keeps their positions: lookup_indexed).
    return lookup_indexed(tokens, k, n_min, n_max,
                          lambda: np.flatnonzero(arr[:-1] == arr[-1]).tolist(), lambda: arr)


def index_positions(where: dict[int, list[int]], new: Seq[int], at: int) -> None:
    """Add ``new``, appended at position ``at``, to ``where`` (token -> its positions,
    ascending): the index a caller keeps for :func:`lookup_indexed`'s ``earlier``."""
    for p, t in enumerate(new, at):
        got = where.get(t)
        if got is None:
            where[t] = [p]
        else:
            got.append(p)


def lookup_indexed(tokens: Seq[int], k: int, n_min: int, n_max: int,
                   earlier: Callable[[], list[int]], array: Callable[[], np.ndarray]
                   ) -> tuple[list[int], int]:
    """:func:`lookup_ngram` given, as the caller keeps them, ``earlier()``: the positions
    of the earlier copies of the last token (ascending), and ``array()``: the tokens as an
    int64 array (asked for only when those copies are many)."""
    length = len(tokens)
    top = min(n_max, length - 1)
    if k < 1 or top < max(n_min, 1):
        return [], 0
    ends = earlier()
    if len(ends) > MANY_ENDS:
        n, i = _match_arrays(array(), length, np.asarray(ends, dtype=np.int64), top)
    else:
        n, i = _match_list(tokens, length, ends, top)
    if n < max(n_min, 1):
        return [], 0
    period = length - i
    return [tokens[i + j % period] for j in range(k)], n


#: Above this many earlier copies of the last token their matches are grown in whole-array
#: steps; below, one by one (numpy's per-call cost is most of a short scan).
MANY_ENDS = 32


def _match_list(tokens: Seq[int], length: int, ends: list[int], top: int) -> tuple[int, int]:
    """The longest match (at most ``top``) of the last tokens ending at one of ``ends``
    (ascending), the latest of the longest: (its length, where its continuation starts);
    (0, 0) for none. The latest first, so a match of ``top`` ends the scan."""
    best, at = 0, 0
    for e in reversed(ends):
        n = 1
        while n < top and e - n >= 0 and tokens[e - n] == tokens[length - 1 - n]:
            n += 1
        if n > best:
            best, at = n, e + 1
            if n == top:
                break
    return best, at


def _match_arrays(arr: np.ndarray, length: int, ends: np.ndarray, top: int
                  ) -> tuple[int, int]:
    """:func:`_match_list` for many ``ends``: every match grown a token at a time, all at
    once."""
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
    n = int(run.max())
    return n, int(ends[np.flatnonzero(run == n)[-1]]) + 1
