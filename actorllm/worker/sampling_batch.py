"""The Worker's persistent sampling batch: every held sequence's sampling parameters and
token history as per-slot columns, so a step samples its rows with whole-batch tensor ops.

A sequence's parameters are written once, into row ``slot`` of preallocated columns
(temperature, top_k, top_p, min_p, penalties, ...), when it joins (a ``NewSeqData``);
the slot is the one its block table has (``packing.BlockTables``). Its history is what
sampling reads of it: how many tokens it has made (min_tokens, the seeded position), the
last one (fed forward by overlap scheduling) and, for the rows with penalties, a
``[slots, vocab]`` seen mask and output-count table, updated with a whole step's tokens
in one ``index_put_``. A step then gathers its rows' columns by slot and samples in a
handful of tensor ops; per-row Python is left to what is rare per request (logit_bias,
an active min_tokens, logprobs, grammars) and to seeded rows, which draw alone so that
their tokens depend only on their own logits and ``(seed, position)``.

On the CPU, a step whose drawn rows ask for no top_k, top_p or min_p samples in one op
call (``fused``: ops/cpu_step.sample_rows), and ``op_temperatures`` says when the decode
op itself may draw the step's tokens (nothing else touches the logits).

Order, as in vLLM: min_tokens masking and logit_bias, then the penalties (repetition on
prompt+output, presence/frequency on output), then greedy argmax, or temperature, min_p,
top_k and top_p followed by a draw. Logprobs come from the raw ``log_softmax(logits)``.
Used by ``ModelRunner`` (worker/runner.py) and by ``sampler.sample``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from actorllm.text.structured import GrammarRefused
from actorllm.wire.messages import SamplingParams, TokenLogprob
from actorllm.wire.steps import StepPlan
from actorllm.worker.filters import GREEDY_BELOW, candidates, draw, step_seed
from actorllm.worker.penalties import OutputCounts, SeenTokens

if TYPE_CHECKING:
    from actorllm.text.structured import Grammar

_FIRST_SLOTS = 64  # the columns double when a slot past them joins


class SamplingState:
    """One sequence as it joins the batch: its params, prompt, output so far and grammar.

    ``grammar`` (structured output) must already have been advanced past
    ``output_token_ids``. ``append`` records a token (the per-row API of
    ``sampler.sample``; the batch keeps its own history in columns).
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int] = (),
        grammar: Grammar | None = None,
    ) -> None:
        self.params = params
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.output_token_ids = list(output_token_ids)
        self.grammar = grammar

    def append(self, token_id: int) -> None:
        """Record a sampled token (and advance the grammar past it)."""
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)


# The host columns, by name: dtype and the value of a free slot.
_COLUMNS: dict[str, tuple[type, float]] = {
    "occupied": (np.bool_, 0), "greedy": (np.bool_, 0), "temperature": (np.float32, 1.0),
    "top_k": (np.int64, 0), "top_p": (np.float32, 1.0), "min_p": (np.float32, 0.0),
    "repetition": (np.float32, 1.0), "presence": (np.float32, 0.0),
    "frequency": (np.float32, 0.0), "seeded": (np.bool_, 0), "min_tokens": (np.int64, 0),
    "num_out": (np.int64, 0), "prompt_len": (np.int64, 0), "last_token": (np.int64, -1),
    "logprobs": (np.int64, -1), "biased": (np.bool_, 0), "constrained": (np.bool_, 0),
    "plain": (np.bool_, 0),
}


class SamplingBatch:
    """Per-slot sampling columns of the sequences the Worker holds (see the module doc).

    Host columns are numpy arrays, one entry per slot (``_COLUMNS``): a step's decisions
    (which rows are greedy, seeded, penalized...) are made on them without a device
    round trip. The seen mask and output counts live on ``device``, allocated when the
    first row that needs them joins. A slot's columns are rewritten whole when a row
    joins it, so nothing of a row that left survives into the next.
    """

    def __init__(self, vocab_size: int, device: torch.device,
                 eos_token_ids: Sequence[int] = (), capacity: int = _FIRST_SLOTS,
                 fused: Callable[..., Tensor] | None = None) -> None:
        self.vocab, self.device = vocab_size, device
        # ops/cpu_step.sample_rows (CPU only), for the steps whose rows need no filter.
        self.fused = fused if device.type == "cpu" else None
        self.eos_token_ids = tuple(eos_token_ids)
        self.capacity = 0
        self.cols: dict[str, np.ndarray] = {
            name: np.zeros(0, dtype=dtype) for name, (dtype, _) in _COLUMNS.items()}
        # Rare per-row data, by slot: the row as it joined (prompt logprobs read its
        # prompt), its seed, min_tokens' stop ids, logit_bias (ids, values), grammar.
        self.joined: list[SamplingState | None] = []
        self.seeds: list[int] = []
        self.stops: list[Tensor | None] = []
        self.bias: list[tuple[Tensor, Tensor] | None] = []
        self.grammars: list[Grammar | None] = []
        self.seen: SeenTokens | None = None  # prompt and output ids (repetition penalty)
        self.counts: OutputCounts | None = None  # output ids (presence, frequency)
        self._grow(max(1, capacity))

    def __len__(self) -> int:
        return int(self.cols["occupied"].sum())

    def _grow(self, capacity: int) -> None:
        old, extra = self.capacity, capacity - self.capacity
        for name, (dtype, free) in _COLUMNS.items():
            col = np.full(capacity, free, dtype=dtype)
            col[:old] = self.cols[name]
            self.cols[name] = col
        for rare in (self.joined, self.stops, self.bias, self.grammars):
            rare.extend([None] * extra)  # type: ignore[list-item]
        self.seeds.extend([0] * extra)
        for table in (self.seen, self.counts):
            if table is not None:
                table.grow(capacity)
        self.capacity = capacity

    def add(self, slot: int, state: SamplingState) -> None:
        """Row ``slot`` becomes ``state``'s: its params and history written once."""
        if slot >= self.capacity:
            self._grow(max(2 * self.capacity, slot + 1))
        p, cols, vocab = state.params, self.cols, self.vocab
        self.remove(slot)
        out = state.output_token_ids
        values = {
            "occupied": True, "greedy": p.temperature < GREEDY_BELOW,
            "temperature": p.temperature,
            "top_k": p.top_k if 0 < p.top_k < vocab else vocab, "top_p": p.top_p,
            "min_p": p.min_p, "repetition": p.repetition_penalty,
            "presence": p.presence_penalty, "frequency": p.frequency_penalty,
            "seeded": p.seed is not None, "min_tokens": p.min_tokens, "num_out": len(out),
            "prompt_len": len(state.prompt_token_ids), "last_token": out[-1] if out else -1,
            "logprobs": -1 if p.logprobs is None else p.logprobs,
            "biased": bool(p.logit_bias), "constrained": state.grammar is not None,
        }
        for name, value in values.items():
            cols[name][slot] = value
        cols["plain"][slot] = self._plain(slot)
        self.joined[slot], self.grammars[slot] = state, state.grammar
        self.seeds[slot] = p.seed or 0
        dev = self.device
        if p.min_tokens:
            stops = [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]
            self.stops[slot] = torch.tensor([t for t in stops if 0 <= t < vocab],
                                            dtype=torch.int64, device=dev)
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias, strict=True)
            self.bias[slot] = (torch.tensor(ids, dtype=torch.int64, device=dev),
                               torch.tensor(biases, dtype=torch.float32, device=dev))
        if p.repetition_penalty != 1.0:
            if self.seen is None:  # the tables come with the first row that needs them
                self.seen = SeenTokens(self.capacity, vocab, dev)
            self.seen.add(slot, (*state.prompt_token_ids, *out))
        if p.presence_penalty or p.frequency_penalty:
            if self.counts is None:
                self.counts = OutputCounts(self.capacity, vocab, dev)
            self.counts.add(slot, out)

    def remove(self, slot: int) -> None:
        """Free row ``slot``: every column back to a free slot's value, its tables zeroed."""
        for name, (_, free) in _COLUMNS.items():
            self.cols[name][slot] = free
        self.joined[slot] = self.stops[slot] = self.bias[slot] = self.grammars[slot] = None
        for table in (self.seen, self.counts):
            if table is not None:
                table.remove(slot)

    def clear(self) -> None:
        """Free every row."""
        for slot in np.flatnonzero(self.cols["occupied"]).tolist():
            self.remove(slot)

    def process(self, logits: Tensor, slots: np.ndarray) -> None:
        """Apply min_tokens, logit_bias and the penalties in place to ``logits``, whose row
        ``i`` belongs to slot ``slots[i]``. Rows that ask for none of them are untouched."""
        cols, dev = self.cols, self.device
        for i in np.flatnonzero(cols["min_tokens"][slots] > cols["num_out"][slots]).tolist():
            stops = self.stops[int(slots[i])]
            if stops is None or not len(stops):
                continue
            grammar = self.grammars[int(slots[i])]
            kept = logits[i, stops].clone() if grammar is not None else None
            logits[i, stops] = float("-inf")
            if kept is not None and bool(torch.isinf(logits[i]).all()):
                # A complete grammar allows only EOS (its mask came first): the grammar
                # wins, or there would be no token left to draw.
                logits[i, stops] = kept
        biased = np.flatnonzero(cols["biased"][slots]).tolist()
        if biased:
            pairs = [self.bias[int(slots[i])] for i in biased]
            rows = torch.cat([torch.full_like(ids, i) for i, (ids, _) in zip(
                biased, pairs, strict=True)])  # type: ignore[misc]
            ids = torch.cat([ids for ids, _ in pairs])  # type: ignore[misc]
            values = torch.cat([v for _, v in pairs]).to(logits.dtype)  # type: ignore[misc]
            logits.index_put_((rows, ids), values, accumulate=True)
        repetition = cols["repetition"][slots]
        rows, index = _subset(repetition != 1.0, slots, dev)
        if rows is not None:
            self.seen.penalize(logits, index, slots[rows], repetition[rows])  # type: ignore[union-attr]
        presence, frequency = cols["presence"][slots], cols["frequency"][slots]
        rows, index = _subset((presence != 0) | (frequency != 0), slots, dev)
        if rows is not None:
            self.counts.penalize(  # type: ignore[union-attr]
                logits, index, slots[rows], presence[rows], frequency[rows])

    def needs_processing(self, slots: np.ndarray) -> bool:
        """Whether ``process`` would change any of these slots' rows."""
        c = self.cols
        return bool((c["min_tokens"][slots] > c["num_out"][slots]).any()
                    or c["biased"][slots].any() or (c["repetition"][slots] != 1.0).any()
                    or (c["presence"][slots] != 0).any() or (c["frequency"][slots] != 0).any())

    def sample(self, logits: Tensor, slots: np.ndarray, *, inplace: bool = False
               ) -> tuple[Tensor, list[int], list[int], list[TokenLogprob]]:
        """One token per row of ``logits`` ``[N, vocab]``, row ``i`` for slot ``slots[i]``.

        Returns the tokens (a device tensor and a list), then the rows that asked for
        logprobs and theirs. Changes no column: ``commit`` records the tokens.
        ``inplace`` lets ``logits`` be overwritten (they are the caller's scratch).
        """
        n = logits.shape[0]
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device), [], [], []
        if logits.shape[1] != self.vocab:
            raise ValueError(f"logits of {logits.shape[1]} ids for a vocabulary of {self.vocab}")
        raw = logits
        if logits.dtype != torch.float32:  # the call alone is a GIL hand-off: skip it
            logits = logits.float()
        if self.needs_processing(slots):
            asked = bool((self.cols["logprobs"][slots] >= 0).any())
            if logits is raw and (asked or not inplace):
                logits = logits.clone()  # the logprobs are of the raw logits
            self.process(logits, slots)
        tokens = self._choose(logits, slots)
        token_list: list[int] = tokens.tolist()
        return tokens, token_list, *self._logprobs(raw, tokens, token_list, slots)

    def _choose(self, logits: Tensor, slots: np.ndarray) -> Tensor:
        """Greedy rows by argmax; the unseeded rest in one draw; seeded rows each alone."""
        cols, dev, n = self.cols, logits.device, logits.shape[0]
        temperature = cols["temperature"][slots]
        greedy = cols["greedy"][slots]
        seeded = cols["seeded"][slots] & ~greedy
        if self.fused is not None and logits.dtype == torch.float32 \
                and self._unfiltered(slots, ~greedy & ~seeded):
            # One op for the greedy and unseeded rows (a seeded row's argmax is replaced
            # below by its own draw).
            temps = np.where(greedy | seeded, 0.0, temperature).astype(np.float32)
            tokens = self.fused(logits, torch.from_numpy(temps), GREEDY_BELOW)
            return self._draw_seeded(tokens, logits, slots, seeded, temperature)
        if greedy.all():
            return logits.argmax(dim=-1)
        unseeded = ~greedy & ~seeded
        tokens = torch.empty(n, dtype=torch.int64, device=dev)
        if greedy.any():
            index = _on(np.flatnonzero(greedy), dev)
            tokens[index] = logits[index].argmax(dim=-1)
        if unseeded.any():
            # Every unseeded row at once, whatever its parameters: they are columns.
            rows, index = _subset(unseeded, slots, dev)
            assert rows is not None
            s = slots[rows]
            vals, ids = candidates(logits if index is None else logits[index],
                                   temperature[rows], cols["top_k"][s], cols["top_p"][s],
                                   cols["min_p"][s])
            picked = ids.gather(1, draw(vals))[:, 0]
            if index is None:
                tokens = picked
            else:
                tokens[index] = picked
        return self._draw_seeded(tokens, logits, slots, seeded, temperature)

    def op_temperatures(self, slots: np.ndarray) -> np.ndarray | None:
        """The temperature column (0 for a greedy row) with which ``fused`` alone samples
        these slots' rows from their raw logits, or None where something else must run:
        no op, a seeded row, a filter, logprobs, a grammar, min_tokens, a bias or a
        penalty. The decode op then draws the step's tokens in the same call."""
        if self.fused is None:
            return None
        cols, greedy = self.cols, self.cols["greedy"][slots]
        if not cols["plain"][slots].all() and (  # (plain: nearly every step, _plain)
                (cols["seeded"][slots] & ~greedy).any()
                or (cols["logprobs"][slots] >= 0).any() or cols["constrained"][slots].any()
                or not self._unfiltered(slots, ~greedy) or self.needs_processing(slots)):
            return None
        return np.where(greedy, 0.0, cols["temperature"][slots]).astype(np.float32)

    def _plain(self, slot: int) -> bool:
        """Whether ``slot``'s row passes op_temperatures' checks for good (issue 28)."""
        c = {name: col[slot] for name, col in self.cols.items()}
        return bool(not c["min_tokens"] and c["logprobs"] < 0 and not c["constrained"]
                    and not c["biased"] and c["repetition"] == 1.0 and c["presence"] == 0
                    and c["frequency"] == 0 and (c["greedy"] or (
                        not c["seeded"] and c["top_k"] >= self.vocab
                        and not c["top_p"] < 1.0 and not c["min_p"] > 0.0)))

    def _unfiltered(self, slots: np.ndarray, rows: np.ndarray) -> bool:
        """Whether no row where ``rows`` holds asks for top_k, top_p or min_p."""
        cols = self.cols
        s = slots[rows]
        return not ((cols["top_k"][s] < self.vocab).any() or (cols["top_p"][s] < 1.0).any()
                    or (cols["min_p"][s] > 0.0).any())

    def _draw_seeded(self, tokens: Tensor, logits: Tensor, slots: np.ndarray,
                     seeded: np.ndarray, temperature: np.ndarray) -> Tensor:
        """Each seeded row's token drawn alone into ``tokens`` (returned)."""
        cols, dev = self.cols, logits.device
        for i in np.flatnonzero(seeded).tolist():
            # Alone, so that its draw depends on nothing else in the batch.
            s = slots[i : i + 1]
            vals, ids = candidates(logits[i : i + 1], temperature[i : i + 1],
                                   cols["top_k"][s], cols["top_p"][s], cols["min_p"][s])
            slot = int(s[0])
            gen = torch.Generator(device=dev)
            gen.manual_seed(step_seed(self.seeds[slot], int(cols["num_out"][slot])))
            tokens[i] = ids[0, int(draw(vals, gen)[0, 0])]
        return tokens

    def _logprobs(self, raw: Tensor, tokens: Tensor, token_list: list[int],
                  slots: np.ndarray) -> tuple[list[int], list[TokenLogprob]]:
        """The rows that ask, and each one's chosen-token logprob and top-N alternatives
        from ``log_softmax(raw)``."""
        wanted = self.cols["logprobs"][slots]
        rows = np.flatnonzero(wanted >= 0)
        if not len(rows):
            return [], []
        index = _on(rows, raw.device)
        lp = torch.log_softmax(raw[index].float(), dim=-1)
        chosen = lp.gather(1, tokens[index][:, None])[:, 0].tolist()
        k = int(wanted[rows].max())
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        out = []
        for j, i in enumerate(rows.tolist()):
            n = int(wanted[i])
            top = tuple(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
            out.append(TokenLogprob(token_id=token_list[i], logprob=chosen[j], top=top))
        return rows.tolist(), out

    def commit(self, slots: np.ndarray, tokens: Tensor, token_list: list[int]
               ) -> list[tuple[int, str]]:
        """Record a step's sampled tokens, ``tokens[i]`` for slot ``slots[i]``: counts, last
        token and the penalty tables in a few whole-batch writes; the grammars of the
        constrained rows advance. Returns ``(row, why)`` for each row whose grammar refused
        its token (text/structured.GrammarRefused): that request fails alone."""
        cols = self.cols
        cols["num_out"][slots] += 1
        cols["last_token"][slots] = token_list
        if self.seen is not None:
            self.seen.commit(slots, tokens, cols["repetition"][slots] != 1.0)
        if self.counts is not None:
            self.counts.commit(slots, tokens)
        refused: list[tuple[int, str]] = []
        for i in np.flatnonzero(cols["constrained"][slots]).tolist():
            try:
                self.grammars[int(slots[i])].accept(token_list[i])  # type: ignore[union-attr]
            except GrammarRefused as exc:
                refused.append((i, str(exc)))
        return refused

    def check_known(self, plan: StepPlan, rows: np.ndarray, slots: np.ndarray) -> None:
        """ValueError on a row sampled or scored whose rid has no sampling state here."""
        occupied = self.cols["occupied"]
        lp_slots = rows[list(plan.lp_rows)] if plan.lp_rows else rows[:0]
        if occupied[slots].all() and occupied[lp_slots].all():
            return
        slot_rid = {int(rows[i]): rid for i, rid in enumerate(plan.rids)}
        first = next(s for s in (*slots.tolist(), *lp_slots.tolist()) if not occupied[s])
        raise ValueError(f"rid {slot_rid[first]!r}: sampled or scored before its NewSeqData "
                         "was sent")


def _on(rows: np.ndarray, device: torch.device) -> Tensor:
    """Row indices as an int64 tensor on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(device)


def _subset(mask: np.ndarray, slots: np.ndarray, device: torch.device
            ) -> tuple[np.ndarray | None, Tensor | None]:
    """The rows where ``mask`` holds, and their index tensor: ``(None, None)`` for no row,
    ``(rows, None)`` when every row does (so the caller works on the whole batch)."""
    rows = np.flatnonzero(mask)
    if not len(rows):
        return None, None
    return rows, (None if len(rows) == len(slots) else _on(rows, device))
