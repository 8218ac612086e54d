"""How many OpenMP threads a CPU step runs on.

torch's intra-op threads are an OpenMP team. With ``OMP_WAIT_POLICY=PASSIVE`` (the
CLI's default: a spinning thread would take the core the event loop or the client
needs) the team's other threads sleep between parallel regions, and waking them costs
more than a small region saves: one decode step of 4 to 32 sequences of the embedded
model took 20-50 % longer on 2 threads than on 1 (``docs/architecture.md``, "Speed on
the CPU"). A step of fewer than ``SMALL_STEP_TOKENS`` tokens therefore runs on one
thread; larger ones (prefill chunks, big decode batches) on all the Worker has.

The count is the calling thread's own (OpenMP's ``nthreads-var`` is per thread), so
:meth:`StepThreads.use_for` must be called from the thread that runs the step. oneDNN's
matmuls and the C decode kernel read the same setting.
"""

from __future__ import annotations

import torch

SMALL_STEP_TOKENS = 32


class StepThreads:
    """Sets the step thread's OpenMP team size for each step (a no-op off the CPU)."""

    def __init__(self, device_type: str, full: int | None = None) -> None:
        self.full = full if full is not None else torch.get_num_threads()
        self.enabled = device_type == "cpu" and self.full > 1
        self.current: int | None = None

    def for_tokens(self, num_tokens: int) -> int:
        """The team size for a step of ``num_tokens`` tokens."""
        return 1 if self.enabled and num_tokens < SMALL_STEP_TOKENS else self.full

    def use_for(self, num_tokens: int) -> None:
        """Size the calling thread's team for a step of ``num_tokens`` tokens."""
        if not self.enabled:
            return
        n = self.for_tokens(num_tokens)
        if n != self.current:
            torch.set_num_threads(n)
            self.current = n
