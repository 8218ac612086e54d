"""The CPUs a process may use, and how many of them other processes leave it.

A Worker on a shared host (another busy process on its cores, a container with a CPU
quota) must not keep an OpenMP team bigger than the cores it actually gets: a parallel
region waits at its barrier for every thread of the team, and a thread that shares its
core with a busy process is off the core for whole scheduler slices. On 2 cores beside
one busy process, ``LLM.generate`` on a near-zero-compute model fell to 0.41x of its quiet
throughput with a team of 2 (issue 33); with a team of 1 it kept most of it. So:

- :func:`openmp_defaults` sets libgomp's spin before torch loads it, for every entry
  point (``actorllm/__init__.py`` calls it; child and rank processes inherit it).
- :func:`usable_cpus` is the affinity mask cut to the cgroup's CPU quota, read at start.
- :class:`CpuShare` measures, every ``interval`` seconds, how much of those CPUs other
  processes used (``/proc/stat`` less this process's and its parent's own time), and the
  step thread's team is cut to what is left (``ops/threads.StepThreads``).

Every choice gives way to the user's: ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` set in the
environment are kept, and ``ACTORLLM_ADAPT_THREADS=0`` turns the measuring off.
This module imports nothing heavy: ``actorllm/__init__.py`` imports it before torch.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

ADAPT_ENV = "ACTORLLM_ADAPT_THREADS"
SPIN_DEFAULT = "10000"
CGROUP = Path("/sys/fs/cgroup")


def openmp_defaults(environ: MutableMapping[str, str]) -> None:
    """OpenMP settings for a process that runs a Worker beside other busy threads; to be
    set before torch loads OpenMP, and only where the user has set neither.

    ``GOMP_SPINCOUNT=10000``: a torch thread waiting between parallel regions spins
    briefly (well under a millisecond), then sleeps. A step's regions come back to back,
    so the spin catches the next one; between steps the thread sleeps and leaves the
    core to the event loop (and, across processes, to the HTTP process). Spinning for
    libgomp's default (300,000) took cores others needed: on 2 cores beside another
    process busy half the time, a 64-sequence decode step took 200-600 ms. Never
    spinning (``OMP_WAIT_POLICY=PASSIVE``) wakes a sleeping thread for every region: the
    same step alone took 15-17 ms against 10-12 ms with the short spin. Beside a busy
    process the spin no longer matters much: :class:`CpuShare` cuts the team to one
    thread, which has no one to wait for.
    """
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = SPIN_DEFAULT


def adapt_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the Worker cuts its team to the CPUs others leave (``ACTORLLM_ADAPT_THREADS``,
    on unless it is ``0``, ``false``, ``no`` or ``off``)."""
    return environ.get(ADAPT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def cpu_quota(root: Path = CGROUP) -> float | None:
    """The cgroup's CPU quota in CPUs (cgroup v2 ``cpu.max``, else v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None without one."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        q = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        p = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def affinity() -> frozenset[int]:
    """The CPUs this process may run on (``taskset`` counts)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def usable_cpus(quota: float | None = None, cpus: frozenset[int] | None = None) -> int:
    """The CPUs this process may use: its affinity mask, cut to the cgroup quota (rounded
    up: a quota of 1.5 CPUs still runs two threads at times). ``quota``/``cpus``: as read
    now when not given."""
    count = len(cpus if cpus is not None else affinity())
    quota = cpu_quota() if quota is None else quota
    if quota is not None and quota > 0:
        count = min(count, math.ceil(quota))
    return max(1, count)


def read_busy_ticks(cpus: frozenset[int]) -> int:
    """Clock ticks the CPUs ``cpus`` spent busy since boot, by everyone (``/proc/stat``:
    all but idle and iowait)."""
    total = 0
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *fields = line.split()
            if name[3:].isdigit() and int(name[3:]) in cpus:
                values = [int(v) for v in fields[:8]]
                total += sum(values) - values[3] - values[4]
    return total


def read_process_ticks(pid: int) -> int:
    """Clock ticks process ``pid`` (all its threads) has run, user and system; 0 if it is
    gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)


class CpuShare:
    """How many of this process's CPUs other processes leave free, measured at most once
    every ``interval`` seconds over the time since the last measure.

    "Others" is every process but this one and its parent: the parent of a Worker's
    process is the HTTP process of the ``engine`` topology (whose load
    ``topology/placement.py`` already plans for) or whoever started the program. The
    engine's other children (the ``pipeline`` Detokenizer, other data-parallel replicas)
    count as others: they are busy on the same cores. A CPU counts as taken once others
    used half of one or more. Readers and the clock are
    arguments so that a test can drive it without a busy machine.
    """

    def __init__(self, cpus: frozenset[int] | None = None, *, ours: tuple[int, ...] | None = None,
                 interval: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 busy: Callable[[frozenset[int]], int] = read_busy_ticks,
                 own: Callable[[int], int] = read_process_ticks,
                 hz: float | None = None) -> None:
        self.cpus = cpus if cpus is not None else affinity()
        self.ours = ours if ours is not None else (os.getpid(), os.getppid())
        self.interval = interval
        self.clock = clock
        self._busy = busy
        self._own = own
        self.hz = hz if hz is not None else float(os.sysconf("SC_CLK_TCK"))
        self._taken = 0
        self._last = self._sample()

    def _sample(self) -> tuple[float, int, int]:
        return self.clock(), self._busy(self.cpus), sum(self._own(p) for p in self.ours)

    def taken(self) -> int:
        """The CPUs other processes occupy, re-measured if ``interval`` has passed."""
        now = self.clock()
        if now - self._last[0] < self.interval:
            return self._taken
        sample = self._sample()
        elapsed = (sample[0] - self._last[0]) * self.hz
        others = ((sample[1] - self._last[1]) - (sample[2] - self._last[2])) / elapsed
        self._last = sample
        self._taken = min(len(self.cpus), math.floor(max(0.0, others) + 0.5))
        return self._taken

    def cap(self, wanted: int) -> int:
        """A team of ``wanted`` threads cut to the CPUs others leave (at least 1); as
        wanted while others take none, so a quiet host runs what was configured."""
        taken = self.taken()
        return wanted if taken == 0 else max(1, min(wanted, len(self.cpus) - taken))


def worker_share(environ: Mapping[str, str] = os.environ) -> CpuShare | None:
    """The :class:`CpuShare` a CPU Worker's step thread reads; None where the user turned
    it off (``ACTORLLM_ADAPT_THREADS=0``) or this system has no ``/proc/stat``."""
    if not adapt_enabled(environ):
        return None
    try:
        return CpuShare()
    except (OSError, ValueError, IndexError):
        return None
