"""How many OpenMP threads a CPU step runs on, and which thread owns the team.

torch's intra-op threads are an OpenMP team. Between parallel regions its other threads
spin for a while, then sleep; waking a sleeping one costs more than a small region
saves. So:

- A step of fewer than ``SMALL_STEP_TOKENS`` tokens runs on one thread, larger ones
  (prefill chunks, big decode batches) on all the Worker has. One decode step of 4 to
  32 sequences of the embedded model took 20-50 % longer on 2 threads than on 1.
- A step of fewer tokens takes the whole team too if it carries ``DRAFT_STEP_TOKENS``
  or more past one per row (a speculative verify step: one row and its drafts). At one
  row the forward of 9 tokens took ~1.8x that of one on one thread (the linears turn
  compute-bound); with such steps on 2 threads the n-gram benchmark's concurrency-1
  cells went from 1.58-1.72x to 1.73-1.78x (two runs each way, quiet), for more CPU.
- A step of ``LARGE_STEP_TOKENS`` or more (prefill) may take a bigger team than the
  rest (``large``). A Worker with a process of its own leaves one core to the HTTP
  process, because a thread sharing a core with a busy process stalls every region it
  is in; but during a 2,048-token step of 200-300 ms that process has little to do,
  and on 2 cores the idle core is half the machine. ``engine`` at saturation, 2
  threads for such steps and 1 for the rest: median TTFT 452-540 ms against 710-904
  with 1 thread throughout (``placement.large_step_threads``; docs/architecture.md).
  So does a step with ``PREFILL_STEP_TOKENS`` or more tokens past one per row (a
  prefill chunk beside decode rows, or a burst's tail of prompts): its work is compute,
  not output for the loop. On the embedded model under ``serve`` (64 prompts at once),
  sending such steps to 2 threads too raised output tok/s from 3,069-3,450 to
  3,450-3,940 and cut TTFT p50 from 527-711 to 426-578 ms; a decode step of as many
  tokens stays on 1 (2 threads there: 2,330-2,610 tok/s, the loop's work crowded out).
- A decode step of ``SMALL_STEP_TOKENS`` rows or more (below ``LARGE_STEP_TOKENS``), where
  the team has more than one thread, runs on one thread or the whole team as their
  measured costs say (:mod:`actorllm.ops.team`, ``choose=True``: the ModelRunner's,
  except with tensor parallelism). On the embedded model the whole team is faster; on
  the near-zero-compute one the event loop's work for the step before takes a core
  during the forward, and which wins turned on the host's load (docs/architecture.md).
- Only the step thread has a team. libgomp gives every thread that starts a parallel
  region a pool of its own, and once it manages more threads than there are CPUs it
  cuts every spin to almost nothing ("throttled"), so each region wakes sleeping
  threads. The ModelRunner is built in another thread (the main one) and builds it
  with one thread (:func:`single_threaded`): no pool there. With the CLI's short spin
  (``cpus.openmp_defaults``), a 64-sequence decode step on 2 threads went from 15-17 ms
  to 10-12 ms.

- A chosen decode step on one thread lets the op's helper thread share its attention,
  LM head and draw (``helper``; kernels/cpu_step_helper.h): blocks of rows taken from
  one counter by the step thread and, if it gets a core in time, the helper (niced,
  below the loop), which no barrier waits for. Only where the team could be bigger
  (``full`` > 1: not beside ``serve``'s loop, which is left its core) and no other
  process takes a core (``share``).
- Never more than other processes leave free (:class:`actorllm.cpus.CpuShare`, given as
  ``share``): on 2 cores beside one busy process a team of 2 waits at every barrier for
  the thread the busy process pushed off its core; ``LLM.generate`` on a
  near-zero-compute model kept 0.41x of its quiet throughput with 2 threads (issue 33).

The count is the calling thread's own (OpenMP's ``nthreads-var`` is per thread), so
:meth:`StepThreads.use_for` must be called from the thread that runs the step. oneDNN's
matmuls and the C decode kernel read the same setting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch

from actorllm.ops.team import TeamChooser

SMALL_STEP_TOKENS = 32
LARGE_STEP_TOKENS = 512
PREFILL_STEP_TOKENS = 64
DRAFT_STEP_TOKENS = 4


class Share(Protocol):
    """What other processes leave this one (``actorllm.cpus.CpuShare``)."""

    def cap(self, wanted: int) -> int: ...


class StepThreads:
    """Sets the step thread's OpenMP team size for each step (a no-op off the CPU), cut by
    ``share`` while other processes busy some of the CPUs (None: not measured)."""

    def __init__(self, device_type: str, full: int | None = None,
                 large: int | None = None, share: Share | None = None,
                 choose: bool = False) -> None:
        self.full = full if full is not None else torch.get_num_threads()
        self.large = large if large is not None else self.full
        self.enabled = device_type == "cpu" and max(self.full, self.large) > 1
        self.share = share if self.enabled else None
        self.current: int | None = None
        # A decode step of SMALL_STEP_TOKENS rows or more: one thread or the whole team,
        # whichever its measured cost favours (ops/team.py); None: always the whole team.
        self.chooser = TeamChooser((1, self.full)) \
            if choose and self.enabled and self.full > 1 else None
        self._open: tuple[int, int, float] | None = None  # (team, rows, start): a chosen step
        self.helper = False  # whether the current step may share its work with the helper

    def chosen(self, num_tokens: int, rows: int | None = None) -> bool:
        """Whether a step of ``num_tokens`` tokens over ``rows`` sequences has its team
        chosen by measured cost: a decode step of SMALL_STEP_TOKENS rows or more."""
        extra = 0 if rows is None else num_tokens - rows
        return self.chooser is not None and extra < DRAFT_STEP_TOKENS \
            and SMALL_STEP_TOKENS <= num_tokens < LARGE_STEP_TOKENS

    def for_tokens(self, num_tokens: int, rows: int | None = None) -> int:
        """The team size for a step of ``num_tokens`` tokens over ``rows`` sequences
        (None: as many as tokens, a decode step)."""
        if not self.enabled:
            return self.full
        extra = 0 if rows is None else num_tokens - rows  # tokens past one per row
        if num_tokens >= LARGE_STEP_TOKENS or extra >= PREFILL_STEP_TOKENS:
            wanted = self.large
        elif self.chooser is not None and self.chosen(num_tokens, rows):
            wanted = self.chooser.choose(num_tokens if rows is None else rows)
        else:
            wanted = 1 if num_tokens < SMALL_STEP_TOKENS and extra < DRAFT_STEP_TOKENS \
                else self.full
        if wanted > 1 and self.share is not None:
            return self.share.cap(wanted)
        return wanted

    def use_for(self, num_tokens: int, rows: int | None = None,
                started: float | None = None) -> None:
        """Size the calling thread's team for a step of ``num_tokens`` tokens over
        ``rows`` sequences that started (``time.perf_counter``) at ``started``: the
        chosen step before it cost the time since its own start."""
        if not self.enabled:
            return
        if self._open is not None and started is not None and self.chooser is not None:
            team, n_rows, began = self._open
            self.chooser.record(team, started - began, n_rows)
        n = self.for_tokens(num_tokens, rows)
        chosen = self.chosen(num_tokens, rows)
        self._open = (n, num_tokens if rows is None else rows, started) \
            if started is not None and chosen else None
        self.helper = chosen and n == 1 and (self.share is None or self.share.cap(2) > 1)
        if n != self.current:
            torch.set_num_threads(n)
            self.current = n

    def end_run(self) -> None:
        """The engine whose steps these were is gone: the open step's cycle would run into
        the next engine's start-up, which is no step's cost (ops/team.py)."""
        self._open = None


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run the block on one torch thread in this thread; the count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
