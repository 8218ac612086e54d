"""One entry of the Frontend's registry: what it knows of a request (or of a child of an
``n > 1`` request). Read by the Frontend and its reader pacing; written by the Frontend.
And the fan-out: which leaves a request becomes.
"""

from __future__ import annotations

import attrs

from actorllm.frontend.collector import OutputCollector
from actorllm.lifecycle.table import State, View
from actorllm.metrics import EngineMetrics
from actorllm.wire.messages import GenerateRequest, SamplingParams


@attrs.define(eq=False)
class RequestState:
    """One registry entry. Its lifecycle state is ``view``, the Frontend's ledger view;
    ``dispatched`` and ``abort_sent`` are facts about messages, not states of the table."""

    rid: str
    collector: OutputCollector
    view: View
    parent: str | None = None
    index: int = 0
    children: list[str] = attrs.Factory(list)
    arrival: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    num_output_tokens: int = 0
    dispatched: bool = False  # its request has left for the Tokenizer (an abort may follow it now)
    abort_sent: bool = False  # an AbortRequest was sent or is owed right after dispatch
    paused_sent: bool = False  # the last FlowControl sent for it said pause
    replica: int = 0  # the data-parallel replica it was routed to (actorllm/frontend/routing.py)
    cost: int = 0  # its outstanding tokens in the Router's load of that replica

    @property
    def responded(self) -> bool:
        """The client has its final output: nothing more may reach it."""
        return self.view.within(State.RESPONDED, State.RELEASED)

    def count_tokens(self, n: int, now: float, metrics: EngineMetrics) -> int:
        """``n`` more tokens at ``now``: latency metrics and the counts; returns how many
        of them came off its outstanding cost (its replica's load falls by that much; the
        caller counts ``generation_tokens``, once per step)."""
        if self.first_token is None:
            metrics.ttft.observe(now - self.arrival)
        elif self.last_token is not None:
            metrics.itl.observe((now - self.last_token) / n)
        self.first_token = self.first_token or now
        self.last_token = now
        self.num_output_tokens += n
        done = min(n, self.cost)
        self.cost -= done
        return done


def fan_out(req: GenerateRequest) -> list[tuple[str, SamplingParams, int]]:
    """(rid, params, index) of each leaf the engine will see: ``req`` itself, or, with
    ``n > 1``, its children ``{rid}-{i}``, each with n=1 and its own seed."""
    p = req.params
    if p.n == 1:
        return [(req.rid, p, 0)]
    return [(f"{req.rid}-{i}", attrs.evolve(p, n=1, seed=None if p.seed is None else p.seed + i),
             i) for i in range(p.n)]
