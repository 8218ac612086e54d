"""The team of a decode step, chosen by what the steps cost as the engine runs (issue 28).

A decode step of many rows may run on one thread or on the whole team. Which is faster
depends on the model and on what else wants the cores: during the forward the event
loop does the Detokenizer's and Frontend's work for the step before, and when that work
takes the core a second OpenMP thread wants, every parallel region waits at its barrier
for the thread it pushed off (docs/architecture.md, "Speed on the CPU"). On the
near-zero-compute model the loop's work is as long as the forward; on the embedded
model the forward is several times longer and wants both cores. So no fixed rule fits
both, and the costs are measured instead: a step's cost is the time from its start to
the next step's start (its forward, what waits for the GIL and the core, and the loop's
turn before the next plan), per row, so that the whole cycle, not the op alone, decides.

:class:`TeamChooser` keeps the last few costs per team size, runs the cheaper size, and
now and then one step on the other so that a change (a busier host, longer contexts, a
smaller batch) is seen: the rarer, the dearer that size was (``explore_interval``).

Costs are kept and compared per class of row counts (``row_class``: 32-63, 64-127,
128-255, 256-511 rows). A step's cost per row falls as its rows grow (the loop's turn and
the op's fixed costs are shared by more rows), so costs taken at different row counts
say nothing of which team is cheaper. Kept in one list, they did say something wrong:
the tail of a run, its batch draining, left per-row costs two to four times the steady
ones on whichever size ran last, and the next run started from them. On the
near-zero-compute model offline (256 x 128 in / 256 out, runs back to back) about half
the runs then kept the dearer size throughout (a step on the other once in 128, too
rarely to move a median of 5): 52-57k output tok/s against 60-63k for the runs that
kept the cheaper (one thread: ~11 us per row a step, two: ~15-17).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping

# Costs kept per team size and class of row counts; the median of these is compared (one
# slow step, the host's noise, moves a median of 5 little).
SAMPLES = 5
# Costs each size needs before the medians are compared; until then the sizes alternate.
MIN_SAMPLES = 3
# A step on the dearer size is expected to cost at most this share of the run: a size
# that cost 10 % more is tried once in 10 steps, one twice as dear once in 100.
EXPLORE_LOSS = 0.01
MIN_EXPLORE_EVERY = 8
MAX_EXPLORE_EVERY = 128
# A cycle longer than this was an idle engine between runs, not a step's cost.
MAX_CYCLE_S = 1.0


def pick_team(costs: Mapping[int, float]) -> int:
    """The team size of least measured cost per row; a tie goes to the smaller team (it
    leaves a core to the rest of the process)."""
    return min(costs, key=lambda n: (costs[n], n))


def explore_interval(best: float, other: float) -> int:
    """How many steps run on the cheaper team (cost per row ``best``) for one on the
    dearer (``other``): so that trying it costs about ``EXPLORE_LOSS`` of the run."""
    if best <= 0 or other <= best:
        return MIN_EXPLORE_EVERY
    steps = math.ceil((other / best - 1.0) / EXPLORE_LOSS)
    return max(MIN_EXPLORE_EVERY, min(MAX_EXPLORE_EVERY, steps))


def row_class(rows: int) -> int:
    """The class of row counts a step's cost is compared within (powers of two)."""
    return rows.bit_length()


class _Costs:
    """The recent costs per row of each size, for one class of row counts."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.costs: dict[int, deque[float]] = {n: deque(maxlen=SAMPLES) for n in sizes}
        self.since_explore = 0

    def medians(self) -> dict[int, float]:
        """Each size's median cost per row (sizes with no cost yet are left out)."""
        return {n: statistics.median(d) for n, d in self.costs.items() if d}


class TeamChooser:
    """Chooses between team sizes ``sizes`` for a class of steps from their measured costs.

    :meth:`choose` names the size of the next step of so many rows; :meth:`record` is told
    what a step on a size cost (seconds, rows). Only the step thread calls either."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = tuple(sorted(set(sizes)))
        self.classes: dict[int, _Costs] = {}
        self.measured: dict[int, int] = dict.fromkeys(self.sizes, 0)  # steps costed, per size

    def _of(self, rows: int) -> _Costs:
        c = self.classes.get(row_class(rows))
        if c is None:
            c = self.classes[row_class(rows)] = _Costs(self.sizes)
        return c

    def record(self, size: int, seconds: float, rows: int) -> None:
        """A step on ``size`` threads over ``rows`` rows cost ``seconds``."""
        if size in self.measured and rows > 0 and 0 < seconds < MAX_CYCLE_S:
            self._of(rows).costs[size].append(seconds / rows)
            self.measured[size] += 1

    def medians(self, rows: int) -> dict[int, float]:
        """Each size's median cost per row for steps of about ``rows`` rows (sizes with no
        cost there yet are left out)."""
        c = self.classes.get(row_class(rows))
        return {} if c is None else c.medians()

    def choose(self, rows: int) -> int:
        """The size for the next step, of ``rows`` rows (the caller may run fewer threads
        where other processes leave fewer CPUs, and records the size it ran)."""
        c = self._of(rows)
        short = [n for n in self.sizes if len(c.costs[n]) < MIN_SAMPLES]
        if short:  # not enough measured: the least measured size next
            return min(short, key=lambda n: (len(c.costs[n]), n))
        medians = c.medians()
        best = pick_team(medians)
        others = [n for n in self.sizes if n != best]
        if not others:
            return best
        other = min(others, key=lambda n: medians[n])
        c.since_explore += 1
        if c.since_explore >= explore_interval(medians[best], medians[other]):
            c.since_explore = 0
            return other
        return best
