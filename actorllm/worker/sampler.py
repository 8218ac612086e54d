"""Sampling's per-row API and prompt logprobs.

``sample`` and ``process_logits`` take one :class:`SamplingState` per row, as a test or a
tool holds them; they run on a :class:`~actorllm.worker.sampling_batch.SamplingBatch`
made for the call, the same code the Worker's persistent batch runs each step (its
semantics are described there). A seeded row draws with a generator seeded from
``(seed, tokens generated so far)`` and is filtered on its own, so its tokens depend only
on its own logits: not on what else is in the batch and not on whether it was preempted
and recomputed.

``prompt_logprobs`` scores prompt positions (vLLM's ``prompt_logprobs``) from the
forward pass's hidden states, for the rows of the sequences that ask only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from actorllm.wire.messages import PromptLogprobs, ScheduledSeq, TokenLogprob
from actorllm.worker.filters import step_seed
from actorllm.worker.sampling_batch import SamplingBatch, SamplingState

__all__ = ["SamplingState", "process_logits", "prompt_logprobs", "sample", "step_seed"]


def _batch_of(logits: Tensor, states: Sequence[SamplingState],
              eos_token_ids: Sequence[int]) -> tuple[SamplingBatch, np.ndarray]:
    batch = SamplingBatch(logits.shape[1], logits.device, eos_token_ids, len(states))
    for slot, state in enumerate(states):
        batch.add(slot, state)
    return batch, np.arange(len(states), dtype=np.int64)


def sample(
    logits: Tensor,
    states: Sequence[SamplingState],
    eos_token_ids: Sequence[int] = (),
) -> list[tuple[int, TokenLogprob | None]]:
    """Sample one token per row of ``logits`` ``[N, vocab]`` for the N ``states`` in order.

    Returns ``(token_id, logprob or None)`` per row; ``logprob`` is set when the row's
    ``params.logprobs`` is not None. Touches neither ``logits`` nor the states.
    """
    n = logits.shape[0]
    assert n == len(states), f"{n} logits rows for {len(states)} sequences"
    if n == 0:
        return []
    batch, slots = _batch_of(logits, states, eos_token_ids)
    _, token_list, lp_rows, lps = batch.sample(logits, slots)
    logprobs: list[TokenLogprob | None] = [None] * n
    for i, lp in zip(lp_rows, lps, strict=True):
        logprobs[i] = lp
    return list(zip(token_list, logprobs, strict=True))


def process_logits(
    logits: Tensor, states: Sequence[SamplingState], eos_token_ids: Sequence[int]
) -> Tensor:
    """Apply min_tokens, logit_bias and the penalties to ``logits`` in place and return it.

    Only the rows whose params ask for one of them are touched.
    """
    if len(states):
        batch, slots = _batch_of(logits, states, eos_token_ids)
        batch.process(logits, slots)
    return logits


# Prompt rows go through the LM head and log-softmax this many at a time, so a long
# prefill chunk never holds more than this many full-vocabulary rows at once.
_PROMPT_ROWS_PER_PASS = 512


def prompt_logprobs(
    hidden: Tensor,
    seqs: Sequence[ScheduledSeq],
    states: Mapping[str, SamplingState],
    compute_logits: Callable[[Tensor], Tensor],
) -> tuple[PromptLogprobs, ...]:
    """Logprobs of the prompt positions each step row asks for (``prompt_logprobs_from``).

    ``hidden`` is the forward pass's output, the rows of ``seqs`` packed in plan order.
    Position ``p`` of a prompt is scored by the row of position ``p - 1``: the logprob of
    the prompt's own token there and the top ``params.prompt_logprobs`` alternatives of
    ``log_softmax`` of the raw logits (like the sampled tokens' logprobs). Only the rows
    of sequences that ask go through the LM head; the others cost nothing here.
    """
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[str, int, int, int]] = []  # rid, first position, count, k
    offset = 0
    for s in seqs:
        n = len(s.token_ids)
        if s.prompt_logprobs_from is not None:
            state = states[s.rid]
            prompt = state.prompt_token_ids
            lo = max(s.prompt_logprobs_from, s.start_pos + 1)
            hi = min(s.start_pos + n, len(prompt) - 1)  # the last position this chunk predicts
            if lo <= hi:
                rows.extend(offset + p - 1 - s.start_pos for p in range(lo, hi + 1))
                targets.extend(prompt[lo : hi + 1])
                spans.append((s.rid, lo, hi + 1 - lo, state.params.prompt_logprobs or 0))
        offset += n
    if not rows:
        return ()
    k = max(span[3] for span in spans)
    chosen: list[float] = []
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    for i in range(0, len(rows), _PROMPT_ROWS_PER_PASS):
        index = torch.tensor(rows[i : i + _PROMPT_ROWS_PER_PASS], device=hidden.device)
        target = torch.tensor(targets[i : i + _PROMPT_ROWS_PER_PASS], device=hidden.device)
        lp = torch.log_softmax(compute_logits(hidden[index]).float(), dim=-1)
        chosen += lp.gather(1, target[:, None])[:, 0].tolist()
        if k:
            vals, ids = lp.topk(k, dim=-1)
            top_vals += vals.tolist()
            top_ids += ids.tolist()
    out = []
    j = 0
    for rid, lo, count, kk in spans:
        entries = []
        for r in range(j, j + count):
            top = tuple(zip(top_ids[r][:kk], top_vals[r][:kk], strict=True)) if kk else ()
            entries.append(TokenLogprob(token_id=targets[r], logprob=chosen[r], top=top))
        out.append(PromptLogprobs(rid, lo, tuple(entries)))
        j += count
    return tuple(out)
