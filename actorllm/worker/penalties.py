"""The token history the penalties read, per slot of the persistent sampling batch.

:class:`SeenTokens` serves the repetition penalty (prompt and output ids): a
``[slots, vocab]`` mask says whether a row has seen an id, and a padded list of each
row's distinct ids lets a step penalize only those (a gather and a scatter of a few
hundred entries per row) instead of a pass over the whole vocabulary. :class:`OutputCounts`
serves the presence and frequency penalties (output ids, with multiplicity). Both are
updated with a whole step's tokens in a few tensor ops, and a slot's row is cleared when
its sequence leaves, so a row that joins later never inherits another's history. Owned by
:class:`~actorllm.worker.sampling_batch.SamplingBatch`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

_FIRST_WIDTH = 256  # distinct ids per row before the id lists widen


class SeenTokens:
    """Which ids each slot's sequence has seen (prompt and output), as a mask and as lists.

    ``ids[slot, :count[slot]]`` are the slot's distinct ids; the rest of the row repeats
    its first id, so a gather over a common width reads only real ids and a scatter writes
    every padding entry with the value its first id gets anyway.
    """

    def __init__(self, capacity: int, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.mask = torch.zeros((capacity, vocab), dtype=torch.bool, device=device)
        self.ids = torch.zeros((capacity, _FIRST_WIDTH), dtype=torch.int64, device=device)
        self.count = np.zeros(capacity, dtype=np.int64)

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` slots (the new ones empty)."""
        old = self.mask.shape[0]
        mask = torch.zeros((capacity, self.vocab), dtype=torch.bool, device=self.device)
        ids = torch.zeros((capacity, self.ids.shape[1]), dtype=torch.int64, device=self.device)
        mask[:old], ids[:old] = self.mask, self.ids
        self.mask, self.ids = mask, ids
        self.count = np.concatenate([self.count, np.zeros(capacity - old, dtype=np.int64)])

    def _widen(self, width: int) -> None:
        if width <= self.ids.shape[1]:
            return
        new = max(width, 2 * self.ids.shape[1])
        ids = self.ids[:, :1].expand(-1, new).clone()  # padding repeats each first id
        ids[:, : self.ids.shape[1]] = self.ids
        self.ids = ids

    def add(self, slot: int, token_ids: Sequence[int]) -> None:
        """Slot ``slot`` has seen ``token_ids`` (ids outside the vocabulary are ignored)."""
        ids = torch.tensor(token_ids, dtype=torch.int64)
        ids = torch.unique(ids[(ids >= 0) & (ids < self.vocab)]).to(self.device)
        n = len(ids)
        self._widen(n)
        self.mask[slot, ids] = True
        self.ids[slot, :n] = ids
        self.ids[slot, n:] = ids[0] if n else 0
        self.count[slot] = n

    def remove(self, slot: int) -> None:
        """Forget slot ``slot``'s ids."""
        self.mask[slot] = False
        self.ids[slot] = 0
        self.count[slot] = 0

    def commit(self, slots: np.ndarray, tokens: Tensor, tracked: np.ndarray) -> None:
        """Slot ``slots[i]`` has seen ``tokens[i]``; ids are listed for the ``tracked`` rows."""
        index = torch.from_numpy(slots).to(self.device)
        fresh = ~self.mask[index, tokens]
        self.mask[index, tokens] = True
        rows = np.flatnonzero(fresh.cpu().numpy() & tracked)
        if not len(rows):
            return
        at = slots[rows]
        cols = self.count[at]
        self._widen(int(cols.max()) + 1)
        self.ids[torch.from_numpy(at).to(self.device), torch.from_numpy(cols).to(self.device)] \
            = tokens[torch.from_numpy(rows).to(tokens.device)]
        self.count[at] += 1

    def penalize(self, logits: Tensor, rows: Tensor | None, slots: np.ndarray,
                 penalty: np.ndarray) -> None:
        """The repetition penalty (HF's form: a seen id's positive logit divided by it, a
        negative one multiplied) in place on ``logits``: on its rows ``rows`` (None: all),
        which belong to slots ``slots``, each with its ``penalty``."""
        width = int(self.count[slots].max())
        if not width:
            return
        ids = self.ids[torch.from_numpy(slots).to(self.device), :width]
        vals = logits.gather(1, ids) if rows is None else logits[rows[:, None], ids]
        pen = torch.from_numpy(penalty).to(logits.device, logits.dtype)[:, None]
        penalized = torch.where(vals > 0, vals / pen, vals * pen)
        empty = self.count[slots] == 0
        if empty.any():  # its padding is no id of its own: write back what was there
            keep = torch.from_numpy(empty).to(logits.device)[:, None]
            penalized = torch.where(keep, vals, penalized)
        if rows is None:
            logits.scatter_(1, ids, penalized)
        else:
            logits[rows[:, None], ids] = penalized


class OutputCounts:
    """How often each slot's sequence has made each id, ``float32 [slots, vocab]``."""

    def __init__(self, capacity: int, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.table = torch.zeros((capacity, vocab), dtype=torch.float32, device=device)

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` slots (the new ones empty)."""
        table = torch.zeros((capacity, self.vocab), dtype=torch.float32, device=self.device)
        table[: self.table.shape[0]] = self.table
        self.table = table

    def add(self, slot: int, output_token_ids: Sequence[int]) -> None:
        """Slot ``slot`` starts with these output ids counted."""
        ids = torch.tensor(output_token_ids, dtype=torch.int64)
        counts = torch.bincount(ids, minlength=self.vocab)[: self.vocab]
        self.table[slot] = counts.to(self.device, torch.float32)

    def remove(self, slot: int) -> None:
        """Forget slot ``slot``'s counts."""
        self.table[slot] = 0

    def commit(self, slots: np.ndarray, tokens: Tensor) -> None:
        """Count ``tokens[i]`` for slot ``slots[i]``, one scatter for the step."""
        index = torch.from_numpy(slots).to(self.device)
        self.table.index_put_((index, tokens), torch.ones(len(slots), device=self.device),
                              accumulate=True)

    def penalize(self, logits: Tensor, rows: Tensor | None, slots: np.ndarray,
                 presence: np.ndarray, frequency: np.ndarray) -> None:
        """Presence and frequency penalties in place on ``logits``: on its rows ``rows``
        (None: all), which belong to slots ``slots``."""
        counts = self.table[torch.from_numpy(slots).to(self.device)]
        freq = torch.from_numpy(frequency).to(logits.device, logits.dtype)[:, None]
        pres = torch.from_numpy(presence).to(logits.device, logits.dtype)[:, None]
        penalty = freq * counts + pres * (counts > 0).to(logits.dtype)
        if rows is None:
            logits -= penalty
        else:
            logits[rows] -= penalty
