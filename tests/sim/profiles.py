"""Hypothesis profiles for the whole suite, and the simulation's share of each.

``tests/conftest.py`` calls :func:`register_profiles`; pick one with
``pytest --hypothesis-profile=NAME``:

- ``ci`` (what a run without the option gets): the stateful simulation tests explore
  at least 2,000 examples in total, in a few minutes on two cores;
- ``long``: deep runs, 10x the examples and longer rule sequences, for a night or a
  release; every other property test gets 10x its examples too (``.ci/run`` runs it
  with ``CI_LONG=1``).

A property test names its CI budget through :func:`examples` (``@settings(max_examples=
examples(60))``), never a bare number: an explicit ``max_examples`` overrides any
profile, so a bare one would pin the test to its CI budget under ``long`` as well.

A failure prints the shortest rule sequence hypothesis could shrink it to, ready to
paste, and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from hypothesis import HealthCheck, settings
from sortedcontainers import SortedSet

_COMMON = {
    "deadline": None,  # a loaded CI machine is slow, not wrong
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}

# Each profile's multiple of a test's CI budget of examples (1 where not named).
SCALE = {"long": 10}
# The simulation's rules per example, for each profile (its examples scale by SCALE).
SIM_STEPS = {"long": 100}


def register_profiles() -> None:
    """Register ``ci`` and ``long`` (call once, from conftest.py)."""
    # CI explores the same examples every run, so a red build is always the change's
    # doing; ``long`` draws new ones each time (and finds what CI's fixed set misses).
    settings.register_profile("ci", derandomize=True, **_COMMON)
    settings.register_profile("long", max_examples=1000, **_COMMON)


def examples(n: int) -> int:
    """A property test's examples: ``n`` (its CI budget) times the active profile's scale.

    Call it where the test is defined: test modules are imported after the profile is
    loaded, so ``--hypothesis-profile=long`` reaches every test that spells its budget
    this way.
    """
    return n * SCALE.get(settings.get_current_profile_name(), 1)


def sim_settings(examples: int, steps: int = 30) -> settings:
    """Settings for one stateful simulation test: ``examples`` is its CI share."""
    profile = settings.get_current_profile_name()
    return settings(
        max_examples=examples * SCALE.get(profile, 1),
        stateful_step_count=SIM_STEPS.get(profile, steps),
        **_COMMON,
    )


# The integers every simulation draw may take from "the project's constants".
STAND_IN_CONSTANTS = range(-1, 33)


@contextlib.contextmanager
def examples_independent_of_loaded_modules() -> Iterator[None]:
    """Run a simulation on the same examples whatever else this process has imported.

    Derandomized is not enough: hypothesis (6.155 here) draws about one integer in
    twenty from the constants found in the project's modules *loaded at that moment*
    (``providers._get_local_constants``). Which those are depends on what ran before in
    the process (the simulation alone, after the rest of the suite, after a test that
    imported a module lazily), so CI's "fixed" examples, and with them whether a rare
    corner such as the priority policy's preemption is reached, changed from one run to
    the next. Here the local constants are a fixed stand-in: the small integers, which
    are what the project's modules contributed to the simulation's small-range draws
    (its rules draw counts, lengths and indices); hypothesis's own constants stay.
    """
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover
        yield
        return
    local = getattr(providers, "_get_local_constants", None)
    if local is None:  # an older hypothesis: no local constants to pin
        yield
        return
    fixed = providers.Constants(integers=SortedSet(STAND_IN_CONSTANTS))
    providers._get_local_constants = lambda: fixed
    providers.CONSTANTS_CACHE.cache.clear()  # it holds local constants drawn before
    try:
        yield
    finally:
        providers._get_local_constants = local
        providers.CONSTANTS_CACHE.cache.clear()
