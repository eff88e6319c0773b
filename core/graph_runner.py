"""Decode steps replayed from captured graphs, one per batch-size bucket.

At startup the runner captures a decode-only step (one token per sequence) for each bucket size, over static
input buffers it owns. A later decode batch of n sequences is padded to the smallest bucket >= n: padding rows
read and write a scratch KV block that no request owns, so they cannot disturb real sequences, and their outputs
are dropped. Attention backends (one per KV cache group, each with its own static block tables and slot mapping)
take part through capture_state / plan_for_replay. Prefill chunks, mixed batches and batches larger than the
biggest bucket run eagerly.
"""
from __future__ import annotations

from typing import Callable

import torch

from resin.core.provider_check import compare
from resin.hal.attention import AttentionBackend, AttentionMetadata, ForwardContext, step_metadata
from resin.hal.graphs import CAPTURE_GRAPH, StepGraph
from resin.hal.recurrent import RecurrentMetadata
from resin.hal.registry import DEFAULT_TOLERANCE, graph_phase

Forward = Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (vLLM's ladder), and max_batch itself."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, forward: Forward, ctx: ForwardContext, max_batch: int, max_blocks: int,
                 scratch_block: int, block_size: int, device: torch.device):
        self.forward, self.ctx = forward, ctx
        self.buckets = bucket_sizes(max_batch)
        self.scratch_block, self.block_size = scratch_block, block_size
        n, groups = self.buckets[-1], len(ctx.backends)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((groups, n), scratch_block * block_size, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.query_start_loc_host = torch.arange(n + 1, dtype=torch.int32)  # decode-only: offsets are 0..n
        self.block_tables = torch.full((groups, n, max_blocks), scratch_block, dtype=torch.int32, device=device)
        # recurrent layers: each row's state slot; padding rows use the last slot, which no sequence owns
        self.scratch_slot = ctx.states[0][0].shape[0] - 1 if ctx.states else 0
        self.state_slots = torch.full((n,), self.scratch_slot, dtype=torch.int32, device=device)
        self.continues = torch.ones(n, dtype=torch.bool, device=device)  # a decode step always continues a state
        self.hidden: torch.Tensor | None = None  # (n, hidden_size), sized by a warm-up forward in capture()
        self.graphs: dict[int, StepGraph] = {}
        self.replays = 0

    @property
    def attns(self) -> list[AttentionBackend]:
        return self.ctx.backends

    def _plan_for_replay(self, bs: int, max_seq_len: int) -> None:
        if self.ctx.states:
            self.ctx.recurrent = RecurrentMetadata(self.query_start_loc[:bs + 1], self.state_slots[:bs],
                                                   self.continues[:bs], decode_only=True)
        for g, attn in enumerate(self.attns):
            attn.plan_for_replay(bs, AttentionMetadata(
                query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.seq_lens[:bs],
                block_tables=self.block_tables[g, :bs], slot_mapping=self.slot_mapping[g, :bs], max_query_len=1,
                max_seq_len=max_seq_len, query_start_loc_host=self.query_start_loc_host[:bs + 1]))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool. Every op call inside
        runs its first graph-safe provider (graph_phase), also when a replay re-runs the step eagerly."""
        n = self.buckets[-1]
        for attn in self.attns:
            attn.capture_state(n)
        self._plan_for_replay(n, self.block_tables.shape[-1] * self.block_size)
        with graph_phase():
            warm = self.forward(self.input_ids, self.positions, self.ctx)  # output size, lazy inits
        self.hidden = torch.zeros_like(warm)
        pool = None
        for bs in reversed(self.buckets):
            self._plan_for_replay(bs, self.block_tables.shape[-1] * self.block_size)

            def step(bs: int = bs) -> None:
                with graph_phase():
                    self.hidden[:bs].copy_(self.forward(self.input_ids[:bs], self.positions[:bs], self.ctx))
            graph = CAPTURE_GRAPH(step, pool)
            pool = graph.pool()
            self.graphs[bs] = graph

    @torch.inference_mode()
    def replay_matches_eager(self, free_blocks: int) -> str | None:
        """Capture checked at start-up: a few sequences get real context (prefilled eagerly into the first free
        blocks, each cache group its own), then one decode step is replayed from the graph of a bucket one larger
        than the batch (so a padding row runs too) and the same padded step, from the same static buffers, runs
        eagerly with the same providers. None when they agree, else how they differ."""
        bs, groups = self.block_size, len(self.attns)
        bucket = self.buckets[min(2, len(self.buckets) - 1)]
        per_seq = -(-(bs + 4) // bs)
        n = max(1, min(bucket - 1, free_blocks // (per_seq * groups)))
        ctx_lens = [bs + 1 + i for i in range(n)]  # past a block boundary: paging and splits take part
        tables = torch.arange(groups * n * per_seq, dtype=torch.int32).view(groups, n, per_seq)
        dev = self.input_ids.device
        positions = torch.cat([torch.arange(c) for c in ctx_lens])
        state_slots = torch.arange(n, dtype=torch.int32)
        with graph_phase():
            for attn, group_tables in zip(self.attns, tables):
                attn.plan(step_metadata(group_tables, ctx_lens, [0] * n, bs, dev))
            if self.ctx.states:
                qsl = torch.zeros(n + 1, dtype=torch.int32)
                qsl[1:] = torch.cumsum(torch.tensor(ctx_lens), 0)
                self.ctx.recurrent = RecurrentMetadata(qsl.to(dev), state_slots.to(dev),
                                                       torch.zeros(n, dtype=torch.bool, device=dev), False)
            self.forward((positions % 7).to(dev), positions.to(dev), self.ctx)
        step = torch.tensor(ctx_lens)
        slots = tables[:, torch.arange(n), step // bs].long() * bs + step % bs
        states = [s for layer in self.ctx.states for s in layer]
        saved = [s.clone() for s in states]  # the eager run below starts from these too
        replayed = self.run(torch.arange(n), step, (step + 1).to(torch.int32), tables, slots,
                            max(ctx_lens) + 1, state_slots).clone()
        for state, before in zip(states, saved):
            state.copy_(before)
        padded = self.bucket_for(n)
        with graph_phase():  # the plan run() made for the bucket still holds
            eager = self.forward(self.input_ids[:padded], self.positions[:padded], self.ctx)[:n]
        _, error, _ = compare(replayed, eager, DEFAULT_TOLERANCE)
        return None if error is None else f"a replayed decode step differs from the same step run eagerly: {error}"

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
            block_tables: torch.Tensor, slot_mapping: torch.Tensor, max_seq_len: int,
            state_slots: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step for n sequences (CPU tensors from the runner; block_tables (groups, n, width),
        slot_mapping (groups, n), and each sequence's state slot if the model has recurrent layers): refill,
        replay, return (n, hidden)."""
        n = input_ids.shape[0]
        bs = self.bucket_for(n)
        assert bs is not None, "batch larger than the largest captured bucket"
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.slot_mapping[:, :n].copy_(slot_mapping, non_blocking=True)
        width = block_tables.shape[-1]
        self.block_tables[:, :n, :width].copy_(block_tables, non_blocking=True)
        if state_slots is not None:
            self.state_slots[:n].copy_(state_slots, non_blocking=True)
        if bs > n:  # padding rows: one token at position 0 of the scratch block
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.seq_lens[n:bs].fill_(1)
            self.slot_mapping[:, n:bs].fill_(self.scratch_block * self.block_size)
            self.block_tables[:, n:bs, 0].fill_(self.scratch_block)
            self.state_slots[n:bs].fill_(self.scratch_slot)
        self._plan_for_replay(bs, max_seq_len)
        self.graphs[bs].replay()
        self.replays += 1
        return self.hidden[:n]
