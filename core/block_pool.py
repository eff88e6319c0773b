"""BlockPool: the KV cache's blocks, their reference counts, and the prefix-cache index over full blocks.

Unreferenced blocks wait in one LRU queue whether or not they hold cached content, so a cached block stays
reusable until the pool needs its space: allocation takes the least recently freed block and evicts its hash.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class OutOfBlocks(RuntimeError):
    pass


@dataclass
class PrefixCacheStats:
    queried_blocks: int = 0
    hit_blocks: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self._hash_of: dict[int, bytes] = {}  # block id -> content key, for cached full blocks
        self._block_of: dict[bytes, int] = {}  # content key -> block id
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
            self.stats.evictions += 1

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit); they leave the free queue if they were in it."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference each. Pass blocks tail-first: the queue then evicts a sequence's tail before its
        head, keeping shared prefixes longest."""
        for block in blocks:
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Record that `block` holds the full block whose chained key (prefix_cache.block_hashes) is `block_hash`."""
        if not self.enable_caching or block in self._hash_of or block_hash in self._block_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def reset_prefix_cache(self) -> None:
        self._hash_of.clear()
        self._block_of.clear()
