"""Block pool and prefix cache: allocation, reference counts, hits and misses, LRU eviction."""
from __future__ import annotations

import pytest

from resin.core.block_pool import BlockPool, OutOfBlocks
from resin.core.kv_cache_manager import KVCacheManager
from resin.core.prefix_cache import block_hashes
from resin.core.request import Request
from resin.core.sampling_params import SamplingParams
from resin.core.scheduler import Scheduler

pytestmark = pytest.mark.unit


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), max_tokens=4)


def test_allocate_free_and_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1 and pool.usage == 0.75
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    pool.touch([a[0]])
    assert pool.ref_counts[a[0]] == 2
    pool.free(a)
    assert pool.num_free == 3 and pool.ref_counts[a[0]] == 1
    pool.free([a[0]])
    assert pool.num_free == 4
    with pytest.raises(AssertionError):
        pool.free([a[0]])


def test_chained_hashes_depend_on_everything_before():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different history
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, parents=a[:1]) == a


def admit(kv, r):
    """An admission that succeeds: the lookup, then its statistics."""
    tokens = kv.admit_cached_prefix(r)
    kv.count_prefix_query(r)
    return tokens


def test_prefix_hit_miss_and_refcounts():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = req("a", range(10))
    assert admit(kv, first) == 0
    assert kv.allocate(first, 10)
    first.num_computed_tokens = 10
    kv.cache_full_blocks(first)  # two full blocks indexed
    second = req("b", list(range(8)) + [99, 98, 97])
    assert admit(kv, second) == 8
    assert second.block_ids[0] == first.block_ids[0][:2]
    assert kv.pool.ref_counts[first.block_ids[0][0]] == 2
    assert kv.pool.stats.hit_blocks == 2 and kv.pool.stats.queried_blocks == 4  # the first admission missed 2
    # a prompt that is exactly cached still leaves its last token to compute
    third = req("c", range(8))
    assert admit(kv, third) == 4
    miss = req("d", [5] * 9)
    assert admit(kv, miss) == 0
    assert kv.pool.stats.queried_blocks == 4 + 1 + 2 and kv.pool.stats.hit_blocks == 3


def test_failed_admissions_do_not_count_as_queries():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    big, waiting = req("big", range(10)), req("w", range(20, 30))
    sched.add(big)
    sched.add(waiting)
    for _ in range(3):  # "w" cannot get blocks while "big" holds them: looked up and released each step
        batch = sched.schedule()
        assert batch.requests == [big]
        big.num_computed_tokens = big.num_tokens
    assert kv.pool.stats.queried_blocks == 2  # only big's one successful admission


def test_lru_eviction_prefers_least_recently_freed_and_tail_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    old = req("old", [1, 2, 3, 4, 5])
    kv.allocate(old, 5)
    old.num_computed_tokens = 4
    kv.cache_full_blocks(old)
    kv.free(old)  # cached blocks stay, unreferenced
    assert kv.pool.num_free == 4
    new = req("new", [7, 7, 7, 7, 7])
    kv.allocate(new, 5)  # three blocks: the never-used one, old's partial block, then old's cached tail block
    again = req("again", [1, 2, 3, 4, 9])
    assert kv.admit_cached_prefix(again) == 2  # head block survived, tail block was evicted
    assert kv.pool.stats.evictions == 1
