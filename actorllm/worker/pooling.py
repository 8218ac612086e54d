"""Pooled final hidden states of embedding requests (``SamplingParams.pooling``).

An embedding request is a prefill with nothing to sample (``max_tokens`` 0); its prompt
may take several chunks. Each step the :class:`Pooler` takes the rows of the pooling
sequences out of the forward pass's output, puts them through the model's final norm
(what the LM head would see, and what transformers reports as the last hidden state),
and keeps a running sum per sequence (``mean``), the first row (``cls``) or the last row
(``last``). The step that
computes a prompt's last position reports the pooled vector; normalizing is the API's.
A sequence whose state is rebuilt (recompute after preemption) starts over. A step with
no pooling sequence costs one dict check.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from actorllm.wire.messages import NewSeqData, PooledHidden, StepPlan


class Pooler:
    """Per pooling sequence: how it pools and its prompt's length, and the sum of its
    normed rows so far, in float32."""

    def __init__(self) -> None:
        self._pooling: dict[str, tuple[str, int]] = {}
        self._sums: dict[str, Tensor] = {}

    def __len__(self) -> int:
        """How many rids pool here (0: no step needs the hidden states for pooling)."""
        return len(self._pooling)

    def start(self, rid: str, new: NewSeqData) -> None:
        """``rid`` starts (or starts over, after preemption) with ``new``."""
        self.drop(rid)
        if new.params.pooling is not None:
            self._pooling[rid] = (new.params.pooling, len(new.prompt_token_ids))

    def drop(self, rid: str) -> None:
        self._pooling.pop(rid, None)
        self._sums.pop(rid, None)

    def clear(self) -> None:
        self._pooling.clear()
        self._sums.clear()

    def take(self, hidden: Tensor, plan: StepPlan,
             norm: Callable[[Tensor], Tensor]) -> tuple[PooledHidden, ...]:
        """The pooled vectors of the sequences whose prompt this step completes
        (``hidden``: the step's rows, in the plan's row order)."""
        if not self._pooling:
            return ()
        out = []
        offset = 0
        for rid, n, start in zip(plan.rids, plan.num_tokens, plan.start_pos, strict=True):
            spec = self._pooling.get(rid)
            if spec is not None:
                pooling, end = spec
                rows = norm(hidden[offset : offset + n]).float()
                if pooling == "mean":
                    total = rows.sum(dim=0)
                    prev = self._sums.get(rid)
                    self._sums[rid] = total if prev is None else prev + total
                elif pooling == "cls" and start == 0:
                    self._sums[rid] = rows[0]
                if start + n >= end:
                    vector = (self._sums.pop(rid) / end if pooling == "mean"
                              else self._sums.pop(rid) if pooling == "cls" else rows[-1])
                    out.append(PooledHidden(rid, tuple(vector.cpu().tolist())))
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
