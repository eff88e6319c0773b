"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and freeing."""
from __future__ import annotations

from resin.core.block_pool import BlockPool, OutOfBlocks
from resin.core.prefix_cache import block_hashes
from resin.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def admit_cached_prefix(self, req: Request) -> int:
        """On admission, take references on the longest cached prefix of full blocks; returns tokens reused.

        At least one token is always left to compute (its logits are needed to sample), and requests that
        want prompt logprobs skip the cache since every prompt position must be computed.
        """
        if not self.enable_prefix_caching or req.prompt_logprobs is not None:
            return 0
        req.block_hashes = block_hashes(req.token_ids, self.block_size, req.block_hashes)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        req.prefix_query = (max_blocks, len(hits))  # counted by count_prefix_query once admission succeeds
        self.pool.touch(hits)
        req.block_ids = hits
        return len(hits) * self.block_size

    def count_prefix_query(self, req: Request) -> None:
        queried, hit = req.prefix_query
        self.pool.stats.queried_blocks += queried
        self.pool.stats.hit_blocks += hit
        req.prefix_query = (0, 0)

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of req; False (and no change) if the pool is short."""
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        try:
            req.block_ids.extend(self.pool.allocate(need))
        except OutOfBlocks:
            return False
        return True

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free

    def cache_full_blocks(self, req: Request) -> None:
        """After a step, index the request's newly completed full blocks so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        if num_full == 0:
            return
        req.block_hashes = block_hashes(req.token_ids[:num_full * self.block_size], self.block_size,
                                        req.block_hashes[:num_full])
        for block, h in zip(req.block_ids[:num_full], req.block_hashes[:num_full]):
            self.pool.cache(block, h)

    def free(self, req: Request) -> None:
        self.pool.free(list(reversed(req.block_ids)))
        req.block_ids = []

    @property
    def usage(self) -> float:
        return self.pool.usage
