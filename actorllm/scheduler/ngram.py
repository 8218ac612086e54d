"""N-gram prompt lookup (text/ngram.py) over a row the Scheduler plans, speculative
decoding's proposer (docs/architecture.md, "Speculative decoding"). A row looks up every
step it may draft, so its history is kept across steps (:func:`lookup_row`): its tokens
as one list, where each token occurs, and (only once some token occurs often) an array.
"""

from __future__ import annotations

import numpy as np

from actorllm.scheduler.sequence import Sequence
from actorllm.text.ngram import index_positions, lookup_indexed


def lookup_row(seq: Sequence, k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    """``text.ngram.lookup_ngram`` for ``seq``'s tokens (prompt, then output), from what the row
    keeps across steps (:func:`history`): the earlier copies of its last token come
    from its index of positions, not a scan (in the engine a numpy call after the
    forward meets cold caches: the scan and the concatenation of the prompt and the
    output were ~27 us of a one-row step's plan, noisy, shared machine)."""
    tokens = history(seq)
    # (the last entry of the last token's positions is the last token itself)
    return lookup_indexed(tokens, k, n_min, n_max, lambda: seq.spec_where[tokens[-1]][:-1],
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
        index_positions(where, new, have)
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
