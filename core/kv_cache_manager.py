"""KVCacheManager: which pages each request holds in each cache group, its recurrent-state slot, prefix-cache
lookups, and freeing.

A request holds one block list per cache group (core/cache_layout.py). A sliding-window group drops the blocks
that fell out of its window before each step: they go back to the pool (still indexed by the prefix cache until
reused) and the request's list keeps NULL_BLOCK in their place, so block positions still map to token positions.
A model with recurrent layers also gives each running request a state slot (there is one per max_num_seqs, so a
running request always finds one); a preempted request gives its slot back and recomputes its state.
"""
from __future__ import annotations

from resin.core.block_pool import BlockPool, OutOfBlocks
from resin.core.cache_layout import CacheGroup
from resin.core.prefix_cache import block_hashes
from resin.core.request import Request

NULL_BLOCK = -1  # a dropped block's place in a request's list; block tables map it to the pool's null page


def _group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block in one group: groups hold the same tokens in different pages."""
    return block_hash if group == 0 else block_hash + group.to_bytes(4, "little")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 groups: tuple[CacheGroup, ...] = (CacheGroup(None, ()),), num_state_slots: int = 0):
        self.block_size = block_size
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))
        self.has_state = num_state_slots > 0
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = [g.window for g in groups]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _first_live(self, window: int | None, start: int) -> int:
        """The first block that queries from position `start` on can see."""
        return 0 if window is None else max(0, start - window + 1) // self.block_size

    def admit_cached_prefix(self, req: Request) -> int:
        """On admission, take references on the longest cached prefix of full blocks; returns tokens reused.

        At least one token is always left to compute (its logits are needed to sample), and requests that
        want prompt logprobs skip the cache since every prompt position must be computed. A full-attention group
        needs every block of the prefix cached; a sliding-window group only the blocks its window still sees.
        """
        req.block_ids = [[] for _ in self.windows]
        if not self.enable_prefix_caching or req.prompt_logprobs is not None:
            return 0
        req.block_hashes = block_hashes(req.token_ids, self.block_size, req.block_hashes)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = req.block_hashes[:max_blocks]
        found = [[self.pool.lookup(_group_key(h, g)) for h in hashes] for g in range(len(self.windows))]
        hit = max_blocks
        changed = True
        while changed:  # lowering the hit for one group can move another's window onto a missing block
            changed = False
            for window, blocks in zip(self.windows, found):
                while hit > 0 and any(b is None for b in blocks[self._first_live(window, hit * self.block_size):hit]):
                    hit -= 1
                    changed = True
        req.num_indexed_blocks = hit
        req.prefix_query = (max_blocks, hit)  # counted by count_prefix_query once admission succeeds
        for window, blocks, held in zip(self.windows, found, req.block_ids):
            first = self._first_live(window, hit * self.block_size)
            self.pool.touch(blocks[first:hit])
            held.extend([NULL_BLOCK] * first + blocks[first:hit])
        return hit * self.block_size

    def count_prefix_query(self, req: Request) -> None:
        queried, hit = req.prefix_query
        self.pool.stats.queried_blocks += queried
        self.pool.stats.hit_blocks += hit
        req.prefix_query = (0, 0)

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of req; False (no block added) if the pool is short. Blocks a
        sliding window no longer sees are dropped first, so they can serve this very allocation."""
        if not req.block_ids:
            req.block_ids = [[] for _ in self.windows]
        if self.has_state and req.state_slot is None:
            if not self.free_state_slots:  # every slot is held (running sequences, forked siblings waiting)
                return False
            req.state_slot = self.free_state_slots.pop()
        self._drop_out_of_window(req)
        total = self.blocks_needed(req.num_computed_tokens + num_new_tokens)
        needs = [max(0, total - len(held)) for held in req.block_ids]
        if sum(needs) == 0:
            return True
        try:
            fresh = self.pool.allocate(sum(needs))
        except OutOfBlocks:
            return False
        for held, need in zip(req.block_ids, needs):
            held.extend(fresh[:need])
            fresh = fresh[need:]
        return True

    def _drop_out_of_window(self, req: Request) -> None:
        for window, held in zip(self.windows, req.block_ids):
            if window is None:
                continue
            dead = min(self._first_live(window, req.num_computed_tokens), len(held))
            # walk back from the last dead block: earlier ones were dropped at earlier steps
            i = dead - 1
            while i >= 0 and held[i] != NULL_BLOCK:
                i -= 1
            if dead - 1 > i:
                self.pool.free(held[i + 1:dead][::-1])
                held[i + 1:dead] = [NULL_BLOCK] * (dead - 1 - i)

    def fork(self, parent: Request, child: Request) -> tuple[list[tuple[int, int]], int] | None:
        """Give `child` what `parent` computed of their shared prompt, without recomputing it: the full blocks
        shared (one more reference each), a fresh copy of the partial last block, and a state slot of its own.
        Returns the (source, destination) pages and the child's slot for the runner to copy into, or None when
        the pool has no block or no slot to spare (the child then recomputes the prompt: correct, slower)."""
        computed = parent.num_computed_tokens
        full, partial = divmod(computed, self.block_size)
        if self.has_state and not self.free_state_slots:
            return None
        try:
            fresh = self.pool.allocate(len(self.windows) if partial else 0)
        except OutOfBlocks:
            return None
        child.block_ids, copies = [], []
        for held in parent.block_ids:
            shared = held[:full]
            self.pool.touch([b for b in shared if b != NULL_BLOCK])
            child.block_ids.append(list(shared))
            if partial:
                copies.append((held[full], fresh[len(copies)]))
                child.block_ids[-1].append(copies[-1][1])
        if self.has_state:
            child.state_slot = self.free_state_slots.pop()
        child.num_computed_tokens = computed
        return copies, child.state_slot

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free

    def cache_full_blocks(self, req: Request) -> None:
        """After a step, index the request's newly completed full blocks so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full, first = req.num_computed_tokens // self.block_size, req.num_indexed_blocks
        if num_full <= first:
            return
        req.block_hashes = block_hashes(req.token_ids[:num_full * self.block_size], self.block_size,
                                        req.block_hashes[:num_full])
        for g, held in enumerate(req.block_ids):
            for block, h in zip(held[first:num_full], req.block_hashes[first:num_full]):
                if block != NULL_BLOCK:
                    self.pool.cache(block, _group_key(h, g))
        req.num_indexed_blocks = num_full

    def num_blocks_held(self, req: Request) -> list[int]:
        """Live (not dropped) blocks per group."""
        return [sum(b != NULL_BLOCK for b in held) for held in req.block_ids]

    def free(self, req: Request) -> None:
        for held in req.block_ids:
            self.pool.free([b for b in reversed(held) if b != NULL_BLOCK])
        req.block_ids = []
        req.num_indexed_blocks = 0
        if req.state_slot is not None:
            self.free_state_slots.append(req.state_slot)
            req.state_slot = None

    @property
    def usage(self) -> float:
        return self.pool.usage
