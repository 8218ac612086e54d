"""What the Scheduler does with one sequence's KV blocks: prefix-cache hits on admission,
reserving room for the next chunk, registering computed blocks, giving them back.

The pool (actorllm/scheduler/kv_pool.py) counts references; these functions keep a sequence's
``block_table`` and the pool agreeing: every block in a live sequence's table holds
exactly one reference for it.
"""

from __future__ import annotations

from collections.abc import Iterable

from actorllm.scheduler.kv_pool import BlockHash, BlockPool
from actorllm.scheduler.sequence import Sequence


def cache_hits(pool: BlockPool, seq: Sequence) -> list[int]:
    """The cached blocks a sequence about to be admitted may start from.

    Only full blocks, and never the block of its last token: that token is always
    computed, so there are logits to sample from (as vLLM v1). A sequence that owes
    prompt logprobs takes only blocks within ``skippable_prefix()``: the positions it
    still has to score must be computed.
    """
    if not pool.enable_caching:
        return []
    return pool.lookup(seq.hashes(pool.block_size)[: _cacheable(seq) // pool.block_size])


def _cacheable(seq: Sequence) -> int:
    """How many leading tokens a hit may cover (see ``cache_hits``)."""
    return min(seq.skippable_prefix(), seq.num_tokens - 1)


def next_block_computing(pool: BlockPool, seq: Sequence, hits: list[int],
                         computing: set[BlockHash]) -> bool:
    """Whether the block after ``hits`` is one this step computes for another sequence
    and ``seq`` could take it from the cache: then it is better to start a step later."""
    bs, k = pool.block_size, len(hits)
    if not computing or (k + 1) * bs > _cacheable(seq):
        return False
    return seq.hashes(bs)[k] in computing


def _cost(pool: BlockPool, hits: list[int], n: int) -> tuple[int, bool]:
    """(fresh blocks for ``n`` tokens after ``hits``, whether the pool has room for them)."""
    need = pool.blocks_for(len(hits) * pool.block_size + n) - len(hits)
    # Shared blocks that sit in the cached set stop being available to allocation.
    return need, need + pool.cost_of(hits) <= pool.num_available


def fits(pool: BlockPool, seq: Sequence, budget: int) -> bool:
    """Whether a waiting sequence's first chunk (at most ``budget`` tokens) would fit now."""
    hits = cache_hits(pool, seq)
    return _cost(pool, hits, min(seq.num_tokens - len(hits) * pool.block_size, budget))[1]


def admit(pool: BlockPool, seq: Sequence, hits: list[int], n: int) -> bool:
    """Give a sequence that holds no blocks the blocks ``hits`` (shared) and fresh ones for
    ``n`` tokens after them; False (and nothing changed) if the pool cannot."""
    assert not seq.block_table and not seq.num_computed, seq.rid
    need, room = _cost(pool, hits, n)
    if not room:
        return False
    cached = len(hits) * pool.block_size
    pool.share(hits)
    seq.block_table = [*hits, *pool.allocate(need)]
    seq.num_computed = seq.num_scheduled = cached
    seq.num_registered = len(hits)
    if pool.enable_caching:
        pool.queries += seq.num_tokens
        pool.hits += cached
    if seq.num_cached_tokens is None:  # the first admission's is the request's
        seq.num_cached_tokens = cached
    return True


def reserve(pool: BlockPool, seq: Sequence, n: int) -> bool:
    """Make sure ``seq`` has blocks for ``n`` more tokens after those already scheduled."""
    need = pool.blocks_for(seq.num_scheduled + n) - len(seq.block_table)
    if need <= 0:
        return True
    if not pool.can_allocate(need):
        return False
    seq.block_table.extend(pool.allocate(need))
    return True


def register(pool: BlockPool, seq: Sequence) -> None:
    """Its blocks that are now full and computed may serve later prompts."""
    full = seq.num_computed // pool.block_size
    if full > seq.num_registered and pool.enable_caching:
        hashes = seq.hashes(pool.block_size)
        for i in range(seq.num_registered, full):
            pool.register(seq.block_table[i], hashes[i])
    seq.num_registered = max(full, seq.num_registered)


def release(pool: BlockPool, seq: Sequence) -> None:
    """Drop its references, last block first (so its prefix stays cached longest)."""
    pool.free(reversed(seq.block_table))
    seq.block_table = []


def computing(pool: BlockPool, planned: Iterable[tuple[Sequence, int]]) -> set[BlockHash]:
    """The hashes of the full blocks the planned chunks complete in this step: a waiting
    prompt whose next block is among them waits a step and then finds it cached (so the
    children of an ``n > 1`` request prefill their prompt once)."""
    bs = pool.block_size
    out: set[BlockHash] = set()
    if not pool.enable_caching:
        return out
    for seq, n in planned:
        first, end = seq.num_scheduled // bs, (seq.num_scheduled + n) // bs
        if end > first:
            out.update(seq.hashes(bs)[first:end])
    return out
