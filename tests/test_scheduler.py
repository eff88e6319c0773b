"""Scheduler: token budget, chunked prefill, decode-first order, max_num_seqs, preemption newest-first."""
from __future__ import annotations

import pytest

from resin.core.kv_cache_manager import KVCacheManager
from resin.core.request import Request, Status
from resin.core.sampling_params import SamplingParams
from resin.core.scheduler import Scheduler

pytestmark = pytest.mark.unit


def req(rid, n, max_tokens=8):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def run_step(sched, batch):
    """What the engine does after a forward: count computed tokens, sample one token where a chunk completed."""
    for r, n in zip(batch.requests, batch.num_new_tokens):
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.token_ids.append(0)


def test_budget_and_chunked_prefill():
    sched = Scheduler(KVCacheManager(64, 4, False), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = req("a", 7), req("b", 12)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.num_new_tokens == [7, 3] and batch.total_tokens <= 10
    run_step(sched, batch)
    batch = sched.schedule()  # a decodes first, then b's next chunk
    assert [r.request_id for r in batch.requests] == ["a", "b"] and batch.num_new_tokens == [1, 9]
    run_step(sched, batch)
    assert b.num_computed_tokens == 12 and b.num_output_tokens == 1


def test_max_num_seqs_limits_running():
    sched = Scheduler(KVCacheManager(64, 4, False), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add(req(str(i), 3))
    batch = sched.schedule()
    assert len(batch) == 2 and len(sched.waiting) == 2


def test_preemption_newest_first_and_resume():
    kv = KVCacheManager(6, 4, False)  # 24 token slots
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = req("a", 7), req("b", 7), req("c", 7)
    for r in (a, b, c):
        sched.add(r)
    run_step(sched, sched.schedule())  # each holds 2 blocks: pool full
    assert kv.pool.num_free == 0
    run_step(sched, sched.schedule())  # token 8 fits in the second block for all three
    batch = sched.schedule()  # token 9 needs a third block for a: c (newest) is preempted
    assert [r.request_id for r in batch.preempted] == ["c"]
    assert c.status is Status.WAITING and c.num_computed_tokens == 0 and not c.block_ids
    assert c.num_output_tokens == 2  # kept: it resumes by recomputing prompt + outputs
    assert sched.waiting[0] is c and sched.num_preemptions == 1
    assert [r.request_id for r in batch.requests] == ["a", "b"]
    for r in (a, b):
        sched.finish(r)
    batch = sched.schedule()
    assert batch.requests == [c] and batch.num_new_tokens == [9]  # prompt 7 + 2 outputs recomputed


def test_finish_frees_blocks_at_once():
    kv = KVCacheManager(8, 4, False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a = req("a", 10)
    sched.add(a)
    sched.schedule()
    assert kv.pool.num_free == 5
    sched.finish(a)
    assert kv.pool.num_free == 8 and not sched.has_work()
