"""N-gram prompt lookup, speculative decoding's proposer (docs/architecture.md,
"Speculative decoding"): the tokens that followed the latest earlier occurrence of a
row's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``. A row
looks up every step it may draft, so the scan is kept short: only the earlier copies of
the last token are extended backwards, one by one while they are few, and the row's
history is kept across steps (:func:`lookup_row`): its tokens as one list, where each
token occurs, and (only once some token occurs often) an array.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np

from actorllm.scheduler.sequence import Sequence


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
    # are extended backwards (a row keeps their positions instead: lookup_row).
    return _lookup(tokens, k, n_min, n_max,
                   lambda: np.flatnonzero(arr[:-1] == arr[-1]).tolist(), lambda: arr)


def _lookup(tokens: Seq[int], k: int, n_min: int, n_max: int,
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


def lookup_row(seq: Sequence, k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    """:func:`lookup_ngram` for ``seq``'s tokens (prompt, then output), from what the row
    keeps across steps (:func:`history`): the earlier copies of its last token come
    from its index of positions, not a scan (in the engine a numpy call after the
    forward meets cold caches: the scan and the concatenation of the prompt and the
    output were ~27 us of a one-row step's plan, noisy, shared machine)."""
    tokens = history(seq)
    # (the last entry of the last token's positions is the last token itself)
    return _lookup(tokens, k, n_min, n_max, lambda: seq.spec_where[tokens[-1]][:-1],
                   lambda: history_array(seq))


def history(seq: Sequence) -> list[int]:
    """``seq``'s tokens (prompt, then output) as a list kept on the sequence
    (``Sequence.spec_tokens``) with each token's positions in it (``spec_where``),
    extended by the tokens appended since the last call, built again when the output
    was not just extended."""
    tokens, where = seq.spec_tokens, seq.spec_where
    have, prompt, out = len(tokens), seq.prompt_ids, seq.output_ids
    length = len(prompt) + len(out)
    if have > length or (have and (prompt[have - 1] if have <= len(prompt)
                                   else out[have - 1 - len(prompt)]) != tokens[have - 1]):
        tokens.clear()
        where.clear()
        seq.spec_known = have = 0
    if have < length:
        new = prompt[have:] + out[max(have - len(prompt), 0):]
        tokens.extend(new)
        for at, t in enumerate(new, have):
            got = where.get(t)
            if got is None:
                where[t] = [at]
            else:
                got.append(at)
    return tokens


def history_array(seq: Sequence) -> np.ndarray:
    """``seq``'s kept token list (:func:`history`) as an int64 array, itself kept on the
    sequence and extended by what was appended since its last call (for the whole-array
    scan of a token with many earlier copies)."""
    tokens = seq.spec_tokens
    length = len(tokens)
    buf, have = seq.spec_history, seq.spec_known
    if have > length or (have and buf[have - 1] != tokens[have - 1]):
        have = 0  # (not an extension of what it holds: built again)
    if len(buf) < length:
        grown = np.empty(max(2 * len(buf), length + 64), dtype=np.int64)
        grown[:have] = buf[:have]
        buf = seq.spec_history = grown
    buf[have:length] = tokens[have:length]
    seq.spec_known = length
    return buf[:length]
