"""Speculative decoding's Worker side: verify a row's draft tokens against the model.

A speculating row ran ``[last token, d1 .. dk]``, so its logits at those k + 1 positions
are the target's distributions for ``d1 .. dk`` and for the token after them. Each
position's distribution is the sampler's (penalties, temperature, top-k, top-p, min-p,
seed), computed with the history up to that position. Greedy rows accept ``d_i`` while
it is the argmax; the first mismatch emits the argmax (after k accepted: the bonus).
Sampled rows use rejection sampling (Leviathan et al.; Chen et al.): an n-gram draft is a
point mass, so ``d_i`` is accepted with probability ``p(d_i)``, and on rejection the token
is drawn from ``p`` without ``d_i``, renormalised: each emitted token has exactly the
target's distribution. A seeded row draws from a generator seeded by (seed, position).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from actorllm.wire.steps import StepPlan
from actorllm.worker.sampler import (
    _GREEDY_BELOW,
    SamplingState,
    _candidates,
    _needs_processing,
    process_logits,
    step_seed,
)


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


def verify_drafts(logits: Tensor, plan: StepPlan, sampling: Sequence[SamplingState],
                  eos_token_ids: Sequence[int]) -> tuple[dict[int, list[int]], Tensor]:
    """Verify every speculating row of ``plan`` (``logits``: 1 + drafts rows per sampling
    row): {sampling row: tokens emitted}, and the logits of each sampling row's last
    position (for the ordinary sampler; a speculating row's draw there is not used)."""
    verified = {j: verify(logits[at:at + 1 + len(drafts)], drafts, sampling[j], eos_token_ids)
                for j, at, drafts in draft_rows(plan)}
    return verified, logits[last_rows(plan).to(logits.device)]


def spliced(token_ids: tuple[int, ...], verified: dict[int, list[int]]
            ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The step's tokens with each verified row's in its place, and the count per row
    (``StepResult.token_ids``, ``StepResult.num_sampled``)."""
    rows = [verified.get(j, (t,)) for j, t in enumerate(token_ids)]
    return tuple(t for row in rows for t in row), tuple(len(row) for row in rows)


def verify(logits: Tensor, drafts: Sequence[int], state: SamplingState,
           eos_token_ids: Sequence[int]) -> list[int]:
    """The tokens a speculating row emits, appended to ``state`` in order: the accepted
    drafts, then the target's own token (a correction, or the bonus after all k)."""
    p = state.params
    greedy = p.temperature < _GREEDY_BELOW
    process = _needs_processing(p)
    plain_argmax = logits.float().argmax(-1).tolist() if greedy and not process else None
    out: list[int] = []
    for j in range(len(drafts) + 1):
        draft = drafts[j] if j < len(drafts) else None
        if plain_argmax is not None:
            token = plain_argmax[j]
        else:
            row = logits[j:j + 1].float()
            if process:
                row = process_logits(row.clone(), [state], eos_token_ids)
            token = int(row.argmax()) if greedy else _rejection(row, draft, state)
        state.append(token)
        out.append(token)
        if token != draft:
            break
    return out


def _rejection(row: Tensor, draft: int | None, state: SamplingState) -> int:
    """One position of a sampled row: accept ``draft`` with probability p(draft), else
    draw from p without it (no draft: draw from p)."""
    p = state.params
    vals, ids = _candidates(row, [p])
    probs = vals.softmax(dim=-1)[0]
    ids = ids[0]
    gen = None
    if p.seed is not None:
        gen = torch.Generator(device=row.device)
        gen.manual_seed(step_seed(p.seed, len(state.output_token_ids)))
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
