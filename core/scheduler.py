"""Scheduler: continuous batching under a per-step token budget, chunked prefill, preemption by recompute.

Each step first serves running requests in admission order (decodes and unfinished prefill chunks: decode-first
fairness), then admits waiting requests while the budget, `max_num_seqs` and free blocks allow. When a running
request cannot get a block, the newest running request is preempted: its blocks are freed and it goes back to
the front of the queue to be recomputed later, keeping the tokens it already produced.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from resin.core.kv_cache_manager import KVCacheManager
from resin.core.request import Request, Status


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per request, in order
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_front(self, req: Request) -> None:
        """Queue ahead of new requests (forked siblings of a request already running)."""
        self.waiting.appendleft(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        planned: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    break
            else:
                planned.append(req)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            break  # req itself was preempted; everything after it already went too
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            forked = bool(req.block_ids)  # a sibling given its parent's prompt blocks (and state) at the fork
            if not forked:
                req.num_computed_tokens = req.num_cached_tokens = self.kv.admit_cached_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate(req, n):
                self.kv.free(req)  # drop the prefix-cache references; the blocks stay cached and evictable
                req.num_computed_tokens = req.num_cached_tokens = 0  # a forked sibling now recomputes
                if not self.running and self._unfork_waiting():
                    continue  # nothing running would ever free what the waiting forks hold: try again
                break
            if not forked:
                self.kv.count_prefix_query(req)
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            planned.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        batch.requests = planned
        return batch

    def _unfork_waiting(self) -> bool:
        """Free the blocks and state slots of waiting forked siblings (they will recompute their prompts).
        True if there were any."""
        forked = [r for r in self.waiting if r.block_ids]
        for r in forked:
            self.kv.free(r)
            r.num_computed_tokens = r.num_cached_tokens = 0
        return bool(forked)

    def preempt(self, req: Request) -> None:
        """Back to the front of the queue, its blocks and state freed: it computes again from the start."""
        self._preempt(req, None)

    def _preempt(self, req: Request, batch: ScheduledBatch | None) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        if batch is not None:
            batch.preempted.append(req)

    def finish(self, req: Request) -> None:
        """Remove a finished (or aborted) request and free its blocks at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
