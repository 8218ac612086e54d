"""The KV block pool: which cache blocks are free, shared or cached. Owned by the Scheduler.

The Worker owns the cache *tensors*; the Scheduler owns the *numbers*. A block is in
exactly one of three places:

- **in use**: one or more live sequences hold it (``refs[b]`` counts them). A sequence
  named by the step in flight keeps its references until that step's result is back
  (the step fence, DESIGN.md §1 invariant 3), so "no references" also means "no step in
  flight reads it".
- **cached**: no references, but its contents are known (a full, computed block,
  identified by :func:`hash_block`); it sits in an LRU set and is reused on a hit, or
  evicted (its hash forgotten) when a fresh block is needed and none is free.
- **free**: no references, contents unknown.

Prefix caching follows vLLM v1's design: a full block's hash chains the previous block's
hash with its own token ids, so equal hashes mean equal prefixes, hence equal K/V.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

BlockHash = bytes

# The chain's root. Anything else that changed the K/V of a block (LoRA, multimodal
# inputs) would go into the hash too; actorllm has none: one model per engine.
_ROOT = b"\0" * 16


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The identity of a full block: its tokens after the prefix ``parent`` names.

    A 128-bit BLAKE2b digest: a collision would hand one request another's
    K/V, so the hash is cryptographic rather than Python's ``hash``.
    """
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_hashes(hashes: list[BlockHash], tokens: Sequence[int], block_size: int,
                  num_tokens: int) -> list[BlockHash]:
    """Grow ``hashes`` (a prefix's full-block hashes) to cover the full blocks of the first
    ``num_tokens`` of ``tokens``; returns it."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, tokens[i * block_size:(i + 1) * block_size]))
    return hashes


class BlockPoolError(AssertionError):
    """A block was freed more often than taken (a scheduler bug)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # no refs, hashed; LRU first
        self.refs: dict[int, int] = {}  # in use: block -> number of holders
        self.hash_of: dict[int, BlockHash] = {}
        self.by_hash: dict[BlockHash, int] = {}
        self.evictions = 0
        # vLLM's prefix_cache_queries / _hits: tokens looked up at each admission
        # (recomputes after preemption too), and found (blocks.admit counts them).
        self.queries = self.hits = 0

    @property
    def num_used(self) -> int:
        return len(self.refs)

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free ones, then cached ones by eviction."""
        return len(self._free) + len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` fresh blocks (one reference each); the caller checked ``can_allocate``.

        Free blocks go first; then the least recently used cached block is evicted.
        """
        if n > self.num_available:
            raise BlockPoolError(f"asked for {n} blocks, {self.num_available} available")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._cached.popitem(last=False)
                self._evict(b)
            self.refs[b] = 1
            out.append(b)
        return out

    def _evict(self, block: int) -> None:
        """Forget a cached block's contents (it is about to be overwritten)."""
        del self.by_hash[self.hash_of.pop(block)]
        self.evictions += 1

    def lookup(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The cached or shared blocks holding the longest prefix of ``hashes`` (no
        references are taken)."""
        out = []
        if self.enable_caching:
            for h in hashes:
                b = self.by_hash.get(h)
                if b is None:
                    break
                out.append(b)
        return out

    def cost_of(self, hits: Iterable[int]) -> int:
        """How many of ``hits`` must leave the cached set (and so stop being available)."""
        return sum(1 for b in hits if b in self._cached)

    def share(self, blocks: Iterable[int]) -> None:
        """Take one more reference to each of ``blocks`` (a prefix-cache hit)."""
        for b in blocks:
            if b in self.refs:
                self.refs[b] += 1
            else:
                del self._cached[b]  # KeyError: neither in use nor cached (a scheduler bug)
                self.refs[b] = 1

    def register(self, block: int, h: BlockHash) -> None:
        """``block`` (in use) now holds the full, computed block ``h``: later prompts may
        share it. If another block already holds ``h``, that one stays the cached copy."""
        if not self.enable_caching or block in self.hash_of or h in self.by_hash:
            return
        self.hash_of[block] = h
        self.by_hash[h] = block

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block. A block nobody holds any more becomes cached
        (most recently used) if its contents are known, else free. Callers pass a
        sequence's blocks last first, so a prefix outlives its tails in the LRU order."""
        for b in blocks:
            n = self.refs.get(b)
            if n is None:
                raise BlockPoolError(f"block {b} freed but not in use (double free?)")
            if n > 1:
                self.refs[b] = n - 1
                continue
            del self.refs[b]
            self._release(b)

    def _release(self, block: int) -> None:
        if block in self.hash_of:
            self._cached[block] = None
        else:
            self._free.append(block)

    # --- introspection (tests, the simulation) --------------------------------------------

    def free_blocks(self) -> list[int]:
        return list(self._free)

    def cached_blocks(self) -> list[int]:
        return list(self._cached)
