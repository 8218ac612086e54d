"""Speculative decoding's Worker side: verify a row's draft tokens against the model.

A speculating row ran ``[last token, d1 .. dk]``, so its logits at those k + 1 positions
are the target's distributions for ``d1 .. dk`` and for the token after them. Each
position's distribution is the sampler's (penalties, temperature, top-k, top-p, min-p,
seed), computed with the history up to that position: the row's tokens are committed to
the :class:`~actorllm.worker.sampling_batch.SamplingBatch` one at a time as they are
accepted. Greedy rows accept ``d_i`` while it is the argmax; the first mismatch emits the
argmax (after k accepted: the bonus). Sampled rows use rejection sampling (Leviathan et
al.; Chen et al.): an n-gram draft is a point mass, so ``d_i`` is accepted with
probability ``p(d_i)``, and on rejection the token is drawn from ``p`` without ``d_i``,
renormalised: each emitted token has exactly the target's distribution. A seeded row
draws from a generator seeded by (seed, position).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from actorllm.wire.steps import StepPlan
from actorllm.worker.filters import candidates, step_seed
from actorllm.worker.sampling_batch import SamplingBatch, SamplingState


def draft_rows(plan: StepPlan) -> list[tuple[int, int, list[int]]]:
    """The speculating sampling rows: (sampling row j, first logits row, drafts), where
    the logits of all sampling rows are packed in order, ``1 + drafts`` per row."""
    out = []
    j = at = t = 0
    for n, sampled, d in zip(plan.num_tokens, plan.sample, plan.num_drafts, strict=True):
        if sampled:
            if d:
                out.append((j, at, list(plan.token_ids[t + n - d:t + n])))
            j += 1
            at += 1 + d
        t += n
    return out


def last_rows(plan: StepPlan) -> Tensor:
    """Index of each sampling row's last logits row (its ordinary sampling position)."""
    d = np.asarray([d for d, s in zip(plan.num_drafts, plan.sample, strict=True) if s],
                   dtype=np.int64)
    return torch.from_numpy(np.cumsum(d + 1) - 1)


def verify_step(logits: Tensor, drawn: Tensor | None, plan: StepPlan, slots: np.ndarray,
                batch: SamplingBatch
                ) -> tuple[dict[int, list[int]], Tensor, Tensor | None]:
    """A step's verification, as the Worker runs it: (the rows verified, as
    :func:`verify_drafts`; the logits, and the tokens the op drew, of each sampling row's
    last position). ``drawn``: the op's draw at every position (then ``logits`` is the
    same tensor), where :func:`drawn_temperatures` let it draw; no drafts: nothing."""
    if not plan.num_drafts:
        return {}, logits, drawn
    verified, last = verify_drafts(logits, plan, slots, batch, drawn is not None)
    return verified, last, None if drawn is None else last


def drawn_temperatures(temps: np.ndarray, plan: StepPlan) -> np.ndarray | None:
    """``temps`` (``SamplingBatch.op_temperatures``, one per sampling row) for every
    logits row of a verify step, so that the op draws at each position, where every
    speculating row is greedy: its draws are then its argmax at each position, all that
    verifying it needs, and the step's logits stay in the op (on a one-row verify step
    their argmax, the sampler's call and the logits' slicing were ~60 % of its
    verification, noisy, shared machine). None where a speculating row samples. Every
    row of ``plan`` samples (the op makes logits only for such steps)."""
    d, ts = plan.num_drafts, temps.tolist()  # (in Python: one or a few rows)
    if any(n and t for n, t in zip(d, ts, strict=True)):
        return None
    if not any(ts):  # every row greedy (each numpy call after the op costs ~10 us)
        return np.zeros(len(ts) + sum(d), dtype=temps.dtype)
    return np.repeat(temps, [n + 1 for n in d])


def verify_drafts(logits: Tensor, plan: StepPlan, slots: np.ndarray, batch: SamplingBatch,
                  drawn: bool = False) -> tuple[dict[int, list[int]], Tensor]:
    """Verify every speculating row of ``plan`` (``logits``: 1 + drafts rows per sampling
    row; sampling row ``j`` is slot ``slots[j]`` of ``batch``): {sampling row: tokens
    emitted, already committed to ``batch``}, and the logits of each sampling row's last
    position (for the ordinary sampler; a speculating row's draw there is not used).
    ``drawn``: ``logits`` are the op's greedy draws at each position instead (every
    speculating row plain greedy), and so is what comes back."""
    if len(plan.num_drafts) == 1 and plan.num_drafts[0] and plan.sample[0] \
            and _plain_greedy(batch, int(slots[0])):
        return {0: _verify_lone_row(logits, plan, slots, batch, drawn)}, logits[-1:]
    rows = draft_rows(plan)
    plain = [r for r in rows if _plain_greedy(batch, int(slots[r[0]]))]
    verified = _verify_plain_greedy(logits.numpy() if drawn else argmax_rows(logits), plain,
                                    slots, batch) if plain else {}
    for j, at, drafts in rows:
        if j not in verified:
            verified[j] = verify_slot(batch, int(slots[j]), logits[at:at + 1 + len(drafts)],
                                      drafts)
    if len(slots) == 1:  # (one sampling row: its last position is the last logits row)
        return verified, logits[-1:]
    return verified, logits[last_rows(plan).to(logits.device)]


def _verify_lone_row(logits: Tensor, plan: StepPlan, slots: np.ndarray, batch: SamplingBatch,
                     drawn: bool) -> list[int]:
    """:func:`_verify_plain_greedy` for a step of one plain greedy row (concurrency 1),
    without the lists of rows: in the engine every call after the op meets cold caches,
    so a verify step's host work goes by the calls it makes."""
    d = plan.num_drafts[0]
    drafts = plan.token_ids[-d:]
    run = _greedy_run((logits.numpy() if drawn else argmax_rows(logits)).tolist(), drafts)
    _commit_runs(batch, slots[:1], {0: run})
    return run


def _greedy_run(best: list[int], drafts: Sequence[int]) -> list[int]:
    """A plain greedy row's tokens: its drafts up to the first that differs from the
    argmax at its position (``best``, one per position, the last past the drafts), then
    the argmax there."""
    a = 0
    while a < len(drafts) and best[a] == drafts[a]:
        a += 1
    return [*drafts[:a], best[a]]


def _plain_greedy(batch: SamplingBatch, slot: int) -> bool:
    """Greedy with nothing that depends on the history (no penalty, bias or min_tokens
    still to reach): its distribution at every position is the raw logits'."""
    cols = batch.cols
    if not cols["greedy"][slot]:
        return False
    # ("plain": no penalty, bias, min_tokens, logprobs or grammar, for good: nearly
    # every row, settled without the check's five column reads)
    return bool(cols["plain"][slot]) or not batch.needs_processing(
        np.array([slot], dtype=np.int64))


def _verify_plain_greedy(best: np.ndarray, rows: list[tuple[int, int, list[int]]],
                         slots: np.ndarray, batch: SamplingBatch) -> dict[int, list[int]]:
    """:func:`verify_slot` for plain greedy rows (:func:`_plain_greedy`), all at once: given
    the argmax of every logits row (``best``), each row's drafts compared with it in a few
    whole-array ops (its accepted count: the drafts before its first mismatch), and the
    tokens committed together (:func:`_commit_runs`), with no work per row and position."""
    if sum(len(r[2]) for r in rows) <= FEW_DRAFTS:
        out = {}
        for j, at, drafts in rows:  # a few rows: compared in Python, no array built
            out[j] = _greedy_run(best[at:at + len(drafts) + 1].tolist(), drafts)
        _commit_runs(batch, slots[[j for j, _, _ in rows]], out)
        return out
    at = np.fromiter((r[1] for r in rows), dtype=np.int64, count=len(rows))
    lens = np.fromiter((len(r[2]) for r in rows), dtype=np.int64, count=len(rows))
    starts = np.cumsum(lens) - lens
    drafts = np.concatenate([np.asarray(r[2], dtype=np.int64) for r in rows])
    # Position p of row r is logits row at[r] + p; a row's drafts are all >= 1 long.
    within = np.arange(len(drafts)) - np.repeat(starts, lens)
    miss = best[np.repeat(at, lens) + within] != drafts
    seen = np.cumsum(miss)  # mismatches so far, over all rows: a row's own from its start
    clean = seen - np.repeat(seen[starts] - miss[starts], lens) == 0
    accepted = np.add.reduceat(clean, starts)
    last = best[at + accepted]
    out = {j: [*d[:a], t] for (j, _, d), a, t in zip(rows, accepted.tolist(), last.tolist(),
                                                      strict=True)}
    _commit_runs(batch, slots[[j for j, _, _ in rows]], out)
    return out


#: Up to this many drafts in a step, plain greedy rows are compared with the argmax in
#: Python (one row of 8: ~10 us); beyond, in whole-array ops (a few us each, any count).
FEW_DRAFTS = 16


def argmax_rows(logits: Tensor) -> np.ndarray:
    """Each row's argmax (the first of ties, as ``Tensor.argmax``). On the CPU through
    numpy: torch's argmax over the last dimension took 54 us for 9 rows of a 4096-token
    vocabulary on this machine's CPUs (one thread), numpy's 3 us; at one row with 8
    drafts that was a third of the verification."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.numpy().argmax(axis=-1)
    return logits.argmax(dim=-1).cpu().numpy()


def _commit_runs(batch: SamplingBatch, at: np.ndarray, runs: dict[int, list[int]]) -> None:
    """Commit each run of tokens to its slot (``at[i]`` gets the i-th run, in order), as
    ``SamplingBatch.commit`` one position at a time would. Without penalty tables or
    grammars to feed (plain greedy rows in a batch that has none) a commit only counts
    the tokens and keeps the last, so a run is written at once; otherwise position by
    position, the rows together."""
    tokens = list(runs.values())
    cols = batch.cols
    if len(tokens) == 1 and batch.seen is None and batch.counts is None \
            and not cols["constrained"][slot := int(at[0])]:
        # One row (concurrency 1): scalar indexing; the whole-array ops below took ~33 us.
        cols["num_out"][slot] += len(tokens[0])
        cols["last_token"][slot] = tokens[0][-1]
        return
    if batch.seen is None and batch.counts is None and not cols["constrained"][at].any():
        cols["num_out"][at] += np.fromiter(map(len, tokens), dtype=cols["num_out"].dtype,
                                           count=len(tokens))
        cols["last_token"][at] = [t[-1] for t in tokens]
        return
    for p in range(max(map(len, tokens))):
        i = [r for r, t in enumerate(tokens) if len(t) > p]
        step = [tokens[r][p] for r in i]
        batch.commit(at[i], torch.tensor(step, device=batch.device), step)


def spliced(token_ids: tuple[int, ...], verified: dict[int, list[int]]
            ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The step's tokens with each verified row's in its place, and the count per row
    (``StepResult.token_ids``, ``StepResult.num_sampled``)."""
    rows = [verified.get(j, (t,)) for j, t in enumerate(token_ids)]
    return tuple(t for row in rows for t in row), tuple(len(row) for row in rows)


def no_draw(slots: np.ndarray, verified: dict[int, list[int]]
            ) -> tuple[Tensor, list[int], list[int], list[object]] | None:
    """What the sampler would give for a step whose every sampling row was verified
    (placeholders that :func:`commit_others` replaces by the verified tokens), so that
    its draw at each row's last position, which verification discards, is not made;
    None while some row still needs the sampler. Seeded rows draw by ``(seed,
    position)``, so skipping a draw changes no later one."""
    if not verified or len(verified) < len(slots):
        return None
    return torch.zeros(len(slots), dtype=torch.long), [0] * len(slots), [], []


def commit_others(batch: SamplingBatch, slots: np.ndarray, tokens: Tensor, token_ids: list[int],
                  verified: dict[int, list[int]]
                  ) -> tuple[list[tuple[int, str]], tuple[int, ...], tuple[int, ...]]:
    """Commit the step's sampled tokens of every row but the ``verified`` ones (committed
    as they were verified): the refused rows (``SamplingBatch.commit``), the step's tokens
    with each verified row's spliced in, and the count per row (empty: one each)."""
    if not verified:
        return batch.commit(slots, tokens, token_ids), tuple(token_ids), ()
    if len(verified) == len(slots):  # nothing left to commit
        return [], *spliced(tuple(token_ids), verified)
    index = np.flatnonzero([j not in verified for j in range(len(slots))])
    refused = [(int(index[i]), why) for i, why in batch.commit(
        slots[index], tokens[torch.from_numpy(index).to(tokens.device)],
        [token_ids[i] for i in index.tolist()])]
    return refused, *spliced(tuple(token_ids), verified)


def verify_slot(batch: SamplingBatch, slot: int, logits: Tensor, drafts: Sequence[int]
                ) -> list[int]:
    """The tokens the row in ``slot`` emits, committed to ``batch`` in order: the accepted
    drafts, then the target's own token (a correction, or the bonus after all k)."""
    at = np.array([slot], dtype=np.int64)
    cols = batch.cols
    greedy = bool(cols["greedy"][slot])
    out: list[int] = []
    for j in range(len(drafts) + 1):
        draft = drafts[j] if j < len(drafts) else None
        row = logits[j:j + 1].float()
        if batch.needs_processing(at):  # with the history up to this position
            row = row.clone()
            batch.process(row, at)
        token = int(row.argmax()) if greedy else _rejection(batch, slot, row, draft)
        batch.commit(at, torch.tensor([token], device=row.device), [token])
        out.append(token)
        if token != draft:
            break
    return out


def verify(logits: Tensor, drafts: Sequence[int], state: SamplingState,
           eos_token_ids: Sequence[int]) -> list[int]:
    """:func:`verify_slot` for one row held as a :class:`SamplingState` (tests, tools):
    the tokens emitted, also appended to ``state``."""
    batch = SamplingBatch(logits.shape[1], logits.device, eos_token_ids, 1)
    batch.add(0, state)
    out = verify_slot(batch, 0, logits, drafts)
    state.output_token_ids.extend(out)
    return out


def _rejection(batch: SamplingBatch, slot: int, row: Tensor, draft: int | None) -> int:
    """One position of a sampled row: accept ``draft`` with probability p(draft), else
    draw from p without it (no draft: draw from p)."""
    c = batch.cols
    s = slice(slot, slot + 1)
    vals, ids = candidates(row, c["temperature"][s], c["top_k"][s], c["top_p"][s],
                           c["min_p"][s])
    probs = vals.softmax(dim=-1)[0]
    ids = ids[0]
    gen = None
    if c["seeded"][slot]:
        gen = torch.Generator(device=row.device)
        gen.manual_seed(step_seed(batch.seeds[slot], int(c["num_out"][slot])))
    if draft is not None:
        is_draft = ids == draft
        p_draft = float(probs[is_draft].sum())
        if float(torch.rand((), generator=gen, device=row.device)) < p_draft:
            return draft
        rest = probs.masked_fill(is_draft, 0.0)
        if float(rest.sum()) <= 0.0:  # (rounding: all the mass was on the draft)
            return draft
        probs = rest
    cdf = probs.cumsum(dim=0)
    u = (1.0 - torch.rand((), generator=gen, device=row.device)) * cdf[-1]
    k = int(torch.searchsorted(cdf, u.reshape(1)).clamp_(max=len(cdf) - 1))
    return int(ids[k])
