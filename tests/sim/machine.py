"""The hypothesis state machine over a :class:`~sim.harness.World`.

Each example builds a fresh World (its own trio guest run), applies a sequence of rules
the way an API layer, a network and a GPU could interleave them, checks every invariant
after every rule (``@invariant``), and drains and checks invariant 4 in ``teardown``. A
failure is shrunk by hypothesis and printed as the list of rule calls that reproduces it.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actorllm.metrics import EngineMetrics
from actorllm.wire.messages import SamplingParams

from .common import EDGES, PROMPTS, STOP_STRINGS, SimConfig, TextModel
from .world import World

RIDS = ("a", "b", "c")  # few, so rids collide while live and are reused once released

F = TypeVar("F", bound=Callable[..., Any])


def _guarded(fn: F) -> F:
    """Remember that a step failed, so ``teardown`` does not drain a broken world."""

    @functools.wraps(fn)
    def wrapper(self: LifecycleMachine, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except BaseException:
            self.failed = True
            raise

    return wrapper  # type: ignore[return-value]


class LifecycleMachine(RuleBasedStateMachine):
    """Submit, abort, disconnect, read slowly, deliver, complete, fail, duplicate, be late.

    Subclasses made by :func:`make_machine` fill in ``hf_tokenizer``, ``text``, ``config``.
    """

    hf_tokenizer: Any = None
    text: TextModel
    config: SimConfig = SimConfig()
    metrics: EngineMetrics | None = None
    # Per class: examples that reached each corner (World.coverage), and under "examples"
    # how many ran to a clean drain.
    reached: Counter[str]

    def __init__(self) -> None:
        super().__init__()
        self.failed = False
        self.world = World(self.hf_tokenizer, self.text, self.config, self.metrics)

    # --- the API layer ----------------------------------------------------------------------

    @rule(
        rid=st.sampled_from(RIDS),
        n=st.integers(1, 4),
        max_tokens=st.integers(0, 8),  # 0: score the prompt only
        prompt=st.sampled_from(PROMPTS),
        stop=st.lists(st.sampled_from(STOP_STRINGS), max_size=2, unique=True).map(tuple),
        include_stop=st.booleans(),
        stream=st.booleans(),
        prompt_logprobs=st.sampled_from([None, None, 1]),
        priority=st.integers(-1, 1),
    )
    @_guarded
    def submit(self, rid: str, n: int, max_tokens: int, prompt: str, stop: tuple[str, ...],
               include_stop: bool, stream: bool, prompt_logprobs: int | None = None,
               priority: int = 0) -> None:
        # (AsyncEngine refuses a priority unless the policy is "priority")
        params = SamplingParams(n=n, max_tokens=max_tokens, stop=stop,
                                include_stop_str_in_output=include_stop,
                                prompt_logprobs=prompt_logprobs,
                                priority=priority if self.config.scheduling_policy
                                == "priority" else 0)
        self.world.submit(rid, params, prompt, stream)

    @rule(rid=st.sampled_from(RIDS))
    @_guarded
    def abort(self, rid: str) -> None:
        self.world.abort(rid)

    @rule(rid=st.sampled_from(RIDS))
    @_guarded
    def disconnect(self, rid: str) -> None:
        self.world.disconnect(rid)

    @rule(rid=st.sampled_from(RIDS), paused=st.booleans())
    @_guarded
    def slow_reader(self, rid: str, paused: bool) -> None:
        self.world.set_paused(rid, paused)

    @precondition(lambda self: self.config.flow is not None
                  and self.config.flow.stream_timeout is not None)
    @rule(seconds=st.sampled_from((1.0, 3.0, 6.0)))
    @_guarded
    def tick(self, seconds: float) -> None:
        """Time passes: a reader stopped long enough runs past its stream timeout."""
        self.world.tick(seconds)

    # --- the engine's process -----------------------------------------------------------------

    # (Only while something is live: a death in an empty engine shows nothing.)
    @precondition(lambda self: self.config.engine_death and not self.world.dead
                  and self.world.frontend.registry)
    @rule()
    @_guarded
    def engine_dies(self) -> None:
        self.world.engine_dies()

    @precondition(lambda self: self.world.tokenizer.jobs)
    @rule()
    @_guarded
    def finish_thread(self) -> None:
        """The Tokenizer's worker thread returns (a big prompt is tokenized)."""
        self.world.finish_thread()

    # --- the network ------------------------------------------------------------------------

    @precondition(lambda self: self.world.pending_edges())
    @rule(picks=st.lists(st.integers(0, len(EDGES) - 1), min_size=1, max_size=4))
    @_guarded
    def deliver(self, picks: list[int]) -> None:
        """Deliver one message per pick, each on the chosen edge (or the next busy one)."""
        for pick in picks:
            pending = self.world.pending_edges()
            if not pending:
                return
            edge = next(EDGES[(pick + j) % len(EDGES)] for j in range(len(EDGES))
                        if EDGES[(pick + j) % len(EDGES)] in pending)
            self.world.deliver(edge)

    @precondition(lambda self: self.world.pending_edges())
    @rule(hold=st.sets(st.sampled_from(EDGES), max_size=3))
    @_guarded
    def pump(self, hold: set[str]) -> None:
        """Deliver everything, one message at a time, except on the held edges: progress
        in one rule, and the races where one edge lags behind all the others."""
        self.world.pump(frozenset(hold))

    # Half the time, hold the one feedback edge whose lag decides stop-string races:
    # StopMatched against the next step's tokens.
    @rule(hold=st.just({"detokenizer->scheduler"}) | st.sets(st.sampled_from(EDGES), max_size=2),
          salt=st.integers(0, 5), rounds=st.integers(1, 4))
    @_guarded
    def advance(self, hold: set[str], salt: int, rounds: int) -> None:
        """A few rounds of: the Worker answers its oldest step, then everything but the
        held edges is delivered. Requests get far in few rules, and a held edge lags."""
        for _ in range(rounds):
            if self.world.worker.pending:
                self.world.complete_step(salt)
            self.world.pump(frozenset(hold))

    # --- the Worker -------------------------------------------------------------------------

    @precondition(lambda self: self.world.worker.pending)
    @rule(salt=st.integers(0, 5), eos_mask=st.sampled_from((0, 0, 0, 0, 0, 0, 1, 2, 4)))
    @_guarded
    def complete_step(self, salt: int, eos_mask: int) -> None:
        self.world.complete_step(salt, eos_mask)

    @precondition(lambda self: self.world.worker.pending)
    @rule()
    @_guarded
    def fail_step(self) -> None:
        self.world.fail_step()

    @precondition(lambda self: self.world.worker.sent)
    @rule()
    @_guarded
    def duplicate_result(self) -> None:
        self.world.duplicate_result()

    @precondition(lambda self: self.world.worker.sent)
    @rule(back=st.integers(0, 3))
    @_guarded
    def late_result(self, back: int) -> None:
        self.world.late_result(back)

    # --- checks -------------------------------------------------------------------------------

    @invariant()
    @_guarded
    def invariants_hold(self) -> None:
        self.world.check()

    def teardown(self) -> None:
        if self.failed:
            self.world.close(reraise=False)
            return
        try:
            self.world.drain()
        except BaseException:
            self.world.close(reraise=False)
            raise
        self.world.close()
        self.reached.update(self.world.coverage())
        self.reached["examples"] += 1


_TEXT_MODELS: dict[int, TextModel] = {}


def _text_model(hf_tokenizer: Any) -> TextModel:
    key = id(hf_tokenizer)
    if key not in _TEXT_MODELS:
        _TEXT_MODELS[key] = TextModel(hf_tokenizer)
    return _TEXT_MODELS[key]


def make_machine(hf_tokenizer: Any, config: SimConfig | None = None,
                 name: str = "LifecycleMachine") -> type[LifecycleMachine]:
    """A LifecycleMachine bound to a tokenizer and a configuration (bugs included)."""
    attrs_: dict[str, Any] = {
        "hf_tokenizer": hf_tokenizer,
        "text": _text_model(hf_tokenizer),
        "config": config or SimConfig(),
        "metrics": EngineMetrics(),  # one registry for all examples: building one is slow
        "reached": Counter(),
    }
    return type(name, (LifecycleMachine,), attrs_)
