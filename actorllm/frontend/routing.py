"""Data parallelism's routing: which replica runs a new request. Owned by the Frontend.

The Frontend owns the rid registry, so it owns the choice too: it picks a replica once
per ``GenerateRequest`` (the ``n > 1`` children all go where their parent went, so they
share the prompt's KV blocks), records it on each leaf's ``RequestState`` and stamps it
on every message for that rid (``GenerateRequest.replica``, ``AbortRequest.replica``,
``FlowControl.replica``); the Tokenizer sends each to that replica's Scheduler.

The rule (docs/architecture.md, "Data parallelism"):

1. Prefix affinity. The Frontend sees the prompt before it is tokenized, so the key is a
   hash of the prompt's first ``AFFINITY_CHARS`` characters (chat: the messages' roles
   and contents, in order; token ids: the first ``AFFINITY_IDS``). A prompt shorter than
   that has no key. A key seen recently (the last ``AFFINITY_KEYS`` keys) routes to the
   replica it went to then, if that replica lives and is not much more loaded than the
   least loaded one: ``load <= AFFINITY_RATIO * least + AFFINITY_SLACK`` tokens. There its
   shared prefix is likely in the prefix cache.
2. Otherwise the least loaded replica: fewest outstanding tokens (see below), then the
   lowest KV cache usage in its latest ``SchedulerStats``, then the fewest requests routed
   so far (so an idle engine alternates).

Outstanding tokens are the Frontend's own estimate, from what it sees: for each live leaf,
its prompt (ids when given, else characters / ``CHARS_PER_TOKEN``) plus its
``max_tokens`` (``DEFAULT_MAX_TOKENS`` when unset), less the tokens it has produced; a leaf
stops counting once it is forgotten (the replica freed its blocks).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from itertools import zip_longest
from typing import Any

import attrs

from actorllm.wire.messages import GenerateRequest, SchedulerStats

AFFINITY_CHARS = 256  # about 4 blocks of 16 tokens of English text
AFFINITY_IDS = 32
AFFINITY_KEYS = 4096
AFFINITY_RATIO = 1.5
AFFINITY_SLACK = 1024
CHARS_PER_TOKEN = 4
DEFAULT_MAX_TOKENS = 256


def prompt_text(req: GenerateRequest) -> str:
    """What the prompt looks like before the Tokenizer: text, messages, or ids as text."""
    if req.prompt is not None:
        return req.prompt
    if req.messages is not None:
        return "".join(f"{m.role}\n{m.content}\n" for m in req.messages)
    return ""


def affinity_key(req: GenerateRequest) -> bytes | None:
    """The hash of the prompt's leading part, or None when the prompt is too short."""
    if req.prompt_token_ids is not None:
        ids = req.prompt_token_ids
        if len(ids) < AFFINITY_IDS:
            return None
        head = ",".join(map(str, ids[:AFFINITY_IDS]))
    else:
        text = prompt_text(req)
        if len(text) < AFFINITY_CHARS:
            return None
        head = text[:AFFINITY_CHARS]
    return hashlib.blake2b(head.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def estimate_cost(req: GenerateRequest) -> int:
    """Tokens one leaf of ``req`` will occupy its replica with (an estimate)."""
    if req.prompt_token_ids is not None:
        prompt = len(req.prompt_token_ids)
    else:
        prompt = len(prompt_text(req)) // CHARS_PER_TOKEN + 1
    max_tokens = req.params.max_tokens
    return prompt + (DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)


class Router:
    """The replicas' loads as the Frontend sees them, and the choice of one."""

    def __init__(self, replicas: int = 1) -> None:
        self.replicas = replicas
        self.load = [0] * replicas  # outstanding tokens (estimate)
        self.routed = [0] * replicas  # leaves routed to each, ever
        self.stats = [SchedulerStats(replica=r) for r in range(replicas)]
        self.dead: set[int] = set()
        self.affinity_hits = 0
        self._affinity: OrderedDict[bytes, int] = OrderedDict()

    @property
    def live(self) -> list[int]:
        """The replicas still serving."""
        return [r for r in range(self.replicas) if r not in self.dead]

    def pick(self, req: GenerateRequest) -> int:
        """The replica for ``req`` (call once per request, not per leaf)."""
        live = self.live
        if self.replicas == 1 or not live:
            return 0
        key = affinity_key(req)
        least = min(live, key=self._rank)
        choice = least
        if key is not None:
            sticky = self._affinity.get(key)
            if sticky is not None and sticky not in self.dead and \
                    self.load[sticky] <= AFFINITY_RATIO * self.load[least] + AFFINITY_SLACK:
                choice = sticky
                self.affinity_hits += choice != least
            self._affinity[key] = choice
            self._affinity.move_to_end(key)
            while len(self._affinity) > AFFINITY_KEYS:
                self._affinity.popitem(last=False)
        return choice

    def _rank(self, r: int) -> tuple[int, float, int]:
        s = self.stats[r]
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        return (self.load[r], usage, self.routed[r])

    def add(self, replica: int, cost: int) -> None:
        """One leaf of ``cost`` tokens was routed to ``replica``."""
        self.load[replica] += cost
        self.routed[replica] += 1

    def sub(self, replica: int, tokens: int) -> None:
        """``tokens`` of ``replica``'s outstanding work are done (or will never be)."""
        self.load[replica] = max(0, self.load[replica] - tokens)

    def on_stats(self, stats: SchedulerStats) -> None:
        """A replica's latest SchedulerStats."""
        if 0 <= stats.replica < self.replicas:
            self.stats[stats.replica] = stats

    def total(self) -> SchedulerStats:
        """The replicas' stats summed (one replica: its own)."""
        if self.replicas == 1:
            return self.stats[0]
        fields = [f for f in SchedulerStats.__attrs_attrs__ if f.name != "replica"]
        return SchedulerStats(**{f.name: _sum(getattr(s, f.name) for s in self.stats)
                                 for f in fields})

    def kill(self, replica: int) -> None:
        """``replica`` died: route nothing more to it; its gauges read zero from now."""
        self.dead.add(replica)
        self.load[replica] = 0
        # Its gauges read zero; its running totals stay (every total, whatever is added).
        self.stats[replica] = attrs.evolve(self.stats[replica], num_running=0, num_waiting=0,
                                           kv_blocks_used=0, num_paused=0)


def _sum(values: Iterable[Any]) -> Any:
    """A stats field summed over replicas (a tuple of counts position by position)."""
    values = list(values)
    if values and isinstance(values[0], tuple):
        return tuple(sum(col) for col in zip_longest(*values, fillvalue=0))
    return sum(values)
