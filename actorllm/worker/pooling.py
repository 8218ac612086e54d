"""Pooled final hidden states of embedding requests (``SamplingParams.pooling``).

An embedding request is a prefill with nothing to sample (``max_tokens`` 0); its prompt
may take several chunks. Each step the :class:`Pooler` takes the rows of the pooling
sequences out of the forward pass's output, puts them through the model's final norm
(what the LM head would see, and what transformers reports as the last hidden state),
and keeps a running sum per sequence (``mean``) or the last row (``last``). The step that
computes a prompt's last position reports the pooled vector; normalizing is the API's.
A sequence whose state is rebuilt (recompute after preemption) starts over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from actorllm.wire.messages import PooledHidden, ScheduledSeq
from actorllm.worker.sampler import SamplingState


class Pooler:
    """Per pooling sequence: the sum of its normed rows so far, in float32."""

    def __init__(self) -> None:
        self._sums: dict[str, Tensor] = {}

    def drop(self, rid: str) -> None:
        self._sums.pop(rid, None)

    def take(self, hidden: Tensor, seqs: Sequence[ScheduledSeq],
             states: Mapping[str, SamplingState],
             norm: Callable[[Tensor], Tensor]) -> tuple[PooledHidden, ...]:
        """The pooled vectors of the sequences whose prompt this step completes."""
        out = []
        offset = 0
        for s in seqs:
            n = len(s.token_ids)
            state = states.get(s.rid)
            pooling = None if state is None else state.params.pooling
            if pooling is not None and state is not None:
                end = len(state.prompt_token_ids)
                rows = norm(hidden[offset : offset + n]).float()
                if pooling == "mean":
                    total = rows.sum(dim=0)
                    prev = self._sums.get(s.rid)
                    self._sums[s.rid] = total if prev is None else prev + total
                if s.start_pos + n >= end:
                    vector = self._sums.pop(s.rid) / end if pooling == "mean" else rows[-1]
                    out.append(PooledHidden(s.rid, tuple(vector.cpu().tolist())))
            offset += n
        return tuple(out)


def pooled_norm(model: torch.nn.Module) -> Callable[[Tensor], Tensor]:
    """The model's final norm: the native model keeps it at ``model.model.norm`` and
    leaves it to ``compute_logits``; the transformers path's forward has applied it
    already (``model/hf_backend.py``), so its rows pass unchanged."""
    norm = getattr(getattr(model, "model", None), "norm", None)
    return norm if callable(norm) else _unchanged


def _unchanged(rows: Tensor) -> Tensor:
    return rows
