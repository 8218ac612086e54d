"""The KV block pool: which cache blocks are free. Owned by the Scheduler alone.

The Worker owns the cache *tensors*; the Scheduler owns the *numbers*: a block id
is handed out by ``allocate`` and comes back exactly once through ``free``, and
only after the step fence (DESIGN.md §1, invariant 3). Both rules are asserted
here, where they hold.
"""

from __future__ import annotations

from collections import deque


class BlockPoolError(AssertionError):
    """A block was freed twice or freed without being allocated (a scheduler bug)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_used(self) -> int:
        return len(self._used)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks; the caller checked ``can_allocate``."""
        if n > len(self._free):
            raise BlockPoolError(f"asked for {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool; each must be in use, and is returned once."""
        for b in blocks:
            if b not in self._used:
                raise BlockPoolError(f"block {b} freed but not in use (double free?)")
            self._used.remove(b)
            self._free.append(b)
