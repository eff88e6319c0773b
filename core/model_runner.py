"""ModelRunner: turns a scheduled batch into one flat forward and returns the logits that will be used.

The flat batch holds every scheduled token back to back (prefill chunks and decodes mixed); the attention
backend of each cache group plans once per step from query start offsets, context lengths, the group's block
tables and slot mapping. Block tables live in a persistent buffer with one row per running request, so a step
writes only the blocks that are new since the last step. Logits are computed only at positions that are sampled or asked for prompt logprobs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from resin.core.cache_layout import CacheLayout
from resin.core.graph_runner import DecodeGraphs
from resin.core.kv_cache_manager import NULL_BLOCK
from resin.core.request import Request
from resin.core.scheduler import ScheduledBatch
from resin.core.step_channel import Command, StepChannel, StepInputs
from resin.hal import (AttentionBackend, AttentionLayer, AttentionMetadata, ForwardContext, RecurrentMetadata,
                       zeros_on_huge_pages)
from resin.hal.mla import attention_op
from resin.hal.registry import GraphUnsafeError, graph_phase, graph_substitutions

log = logging.getLogger("resin.runner")


class CausalLM(Protocol):
    attention_layers: list[AttentionLayer]
    # and, for families with per-sequence recurrent state: recurrent_layers: list[RecurrentLayer]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class BlockTableBuffer:
    """(groups, max_num_seqs, max_blocks) int32 tables; a row per running request, appended to as its blocks grow.

    A block a sliding window dropped keeps its old page in the row: attention never reads keys outside the window,
    so the entry is dead either way, and rewriting it would cost a copy per step.
    """

    def __init__(self, num_groups: int, max_rows: int, max_blocks: int, null_page: int):
        self.table = torch.zeros(num_groups, max_rows, max_blocks, dtype=torch.int32)
        self.null_page = null_page
        self._row: dict[str, int] = {}
        self._written: list[list[int]] = [[0] * max_rows for _ in range(num_groups)]
        self._free_rows = list(range(max_rows - 1, -1, -1))

    def row_of(self, req: Request) -> int:
        row = self._row.get(req.request_id)
        if row is None:
            row = self._row[req.request_id] = self._free_rows.pop()
            for written in self._written:
                written[row] = 0
        for g, held in enumerate(req.block_ids):
            start, n = self._written[g][row], len(held)
            if n > start:
                self.table[g, row, start:n] = torch.tensor(
                    [self.null_page if b == NULL_BLOCK else b for b in held[start:]], dtype=torch.int32)
                self._written[g][row] = n
        return row

    def release(self, req: Request) -> None:
        row = self._row.pop(req.request_id, None)
        if row is not None:
            self._free_rows.append(row)


@dataclass
class RunnerOutput:
    sample_requests: list[Request]
    sample_logits: torch.Tensor | None  # (len(sample_requests), vocab); None when nothing is sampled
    # (request, first prompt position, hidden states of the positions whose next prompt token wants a logprob):
    # hidden, not logits, so the engine can turn them into logits a bounded number of rows at a time.
    prompt_chunks: list[tuple[Request, int, torch.Tensor]] = field(default_factory=list)
    # sequences whose step failed with the batch and must compute again from the start (see core/contained.py)
    recompute: list[Request] = field(default_factory=list)

    @staticmethod
    def concat(parts: list["RunnerOutput"]) -> "RunnerOutput":
        logits = [p.sample_logits for p in parts if p.sample_logits is not None]
        return RunnerOutput([r for p in parts for r in p.sample_requests], torch.cat(logits) if logits else None,
                            [c for p in parts for c in p.prompt_chunks], [r for p in parts for r in p.recompute])


class ModelRunner:
    def __init__(self, model: CausalLM, layout: CacheLayout, num_blocks: int, max_num_seqs: int,
                 max_model_len: int, dtype: torch.dtype, device: torch.device, graph_batch: int = 0,
                 channel: StepChannel | None = None):
        """num_blocks pages serve every cache group (core/cache_layout.py); one more, the null page, stands for
        dropped blocks and takes the writes of graph padding rows. graph_batch > 0: capture decode graphs for
        batches up to that size. Captured steps use each op's first graph-safe provider, eager steps its first
        provider: one that cannot be captured costs graphs nothing. channel: on tensor-parallel rank 0, where its
        steps go to the other ranks (core/tp_worker.py runs them there)."""
        self.model, self.layout, self.channel = model, layout, channel
        self.block_size, self.num_blocks = layout.block_size, num_blocks
        self.device = device
        self.attns = self._group_backends(model.attention_layers, dtype, device)
        decode_attns = self._graph_attention(model.attention_layers, dtype, device) if graph_batch > 0 else None
        route = layout.route()
        slots = [zeros_on_huge_pages(self.attn.kv_cache_shape(num_blocks + 1, self.block_size, hk, d), dtype, device)
                 for hk, d in self._slot_shapes(model.attention_layers)]
        self.kv_caches = [slots[j] for _, j in route]
        self.cache_slots = slots
        max_blocks = -(-max_model_len // self.block_size)
        self.block_tables = BlockTableBuffer(len(layout.groups), max_num_seqs, max_blocks, null_page=num_blocks)
        # one state slot per running sequence, and one more that graph padding rows use
        self.states = [layer.allocate(max_num_seqs + 1, dtype, device)
                       for layer in getattr(model, "recurrent_layers", [])]
        self._state_tensors = [state for layer in self.states for state in layer]  # every (slots, ...) tensor
        self.ctx = ForwardContext(self.attns, self.kv_caches, route, self.states)
        self.graphs: DecodeGraphs | None = None
        if decode_attns is not None:
            start = time.perf_counter()
            decode_ctx = ForwardContext(decode_attns, self.kv_caches, route, self.states)
            self.graphs = DecodeGraphs(model.forward, decode_ctx, graph_batch, max_blocks, scratch_block=num_blocks,
                                       block_size=self.block_size, device=device)
            try:
                self.graphs.capture()
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:  # an op no graph-safe provider takes, or one that syncs inside capture
                log.warning("decode graphs off: capture failed (%s); decode steps run eagerly", e)
                self.graphs = None
            else:
                swaps = {**graph_substitutions(), attention_op(model.attention_layers).name:
                         (type(self.attn).__name__, type(decode_attns[0]).__name__)}
                swapped = "; ".join(f"{op}: {eager} eagerly, {captured} in graphs"
                                    for op, (eager, captured) in swaps.items() if eager != captured)
                log.info("captured decode graphs for batch sizes %s in %.1f s%s", self.graphs.buckets,
                         time.perf_counter() - start, f" ({swapped}: not graph-safe)" if swapped else "")

    @property
    def attn(self) -> AttentionBackend:
        """The attention provider (every cache group runs the same one: they share the cache tensors)."""
        return self.attns[0]

    def _slot_shapes(self, layers: list[AttentionLayer]) -> list[tuple[int, int]]:
        shapes: dict[int, tuple[int, int]] = {}
        for group in self.layout.groups:
            for j, i in enumerate(group.layers):
                shapes[j] = (layers[i].num_kv_heads, layers[i].head_size)
        return [shapes[j] for j in range(len(shapes))]

    def _group_backends(self, layers: list[AttentionLayer], dtype: torch.dtype,
                        device: torch.device) -> list[AttentionBackend]:
        """One backend per cache group, all of the provider chosen for the whole model."""
        first = attention_op(layers)(layers, self.block_size, dtype, device)
        if len(self.layout.groups) == 1:
            return [first]
        return [type(first)([layers[i] for i in g.layers], self.block_size, dtype, device)
                for g in self.layout.groups]

    def _graph_attention(self, layers: list[AttentionLayer], dtype: torch.dtype,
                         device: torch.device) -> list[AttentionBackend] | None:
        """The attention backends captured decode steps use: the eager ones when graph-safe, else the first
        graph-safe provider that takes this configuration and reads the same cache layout (None: no graphs)."""
        if self.attn.supports_graphs:
            return self.attns
        try:
            with graph_phase():
                decode_attns = self._group_backends(layers, dtype, device)
        except GraphUnsafeError as e:
            log.warning("decode graphs off: %s", e)
            return None
        shapes = self._slot_shapes(layers)
        if any(decode_attns[0].kv_cache_shape(2, self.block_size, hk, d)
               != self.attn.kv_cache_shape(2, self.block_size, hk, d) for hk, d in shapes):
            log.warning("decode graphs off: %s (graph-safe) keeps its KV cache in another layout than %s",
                        type(decode_attns[0]).__name__, type(self.attn).__name__)
            return None
        return decode_attns

    def graphs_match_eager(self) -> str | None:
        """The start-up check of capture itself (DecodeGraphs.replay_matches_eager) on the pool's first blocks,
        which no request owns before serving starts."""
        assert self.graphs is not None
        return self.graphs.replay_matches_eager(self.num_blocks)

    def release(self, req: Request) -> None:
        self.block_tables.release(req)

    def _zero_states(self, slots: torch.Tensor) -> None:
        for state in self._state_tensors:
            state.index_fill_(0, slots, 0)

    @torch.inference_mode()
    def copy_for_fork(self, pages: list[tuple[int, int]], src_slot: int | None, dst_slot: int | None) -> None:
        """A forked sequence's own copies: pages (source, destination) in every cache tensor (a page belongs to
        one group, so copying it in the others' tensors is harmless), and its parent's recurrent state."""
        if self.channel is not None:
            self.channel.send(Command.FORK, [torch.tensor(pages, dtype=torch.long).view(-1, 2),
                                             torch.tensor([-1 if src_slot is None else src_slot,
                                                           -1 if dst_slot is None else dst_slot])])
        if pages:
            src, dst = (torch.tensor(side, dtype=torch.long, device=self.device) for side in zip(*pages))
            for cache in self.cache_slots:
                self.attn.copy_blocks(cache, src, dst)
        if src_slot is not None and dst_slot is not None:
            for state in self._state_tensors:
                state[dst_slot].copy_(state[src_slot])

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The step's inputs on the host, from the scheduled batch (rank 0 only: it alone has the requests)."""
        reqs, counts = batch.requests, batch.num_new_tokens
        starts = [r.num_computed_tokens for r in reqs]
        flat: list[int] = []
        for r, s, n in zip(reqs, starts, counts):
            flat.extend(r.token_ids[s:s + n])
        num_tokens = len(flat)
        counts_t = torch.tensor(counts)
        qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        torch.cumsum(counts_t, 0, out=qsl[1:])
        seq_of_token = torch.repeat_interleave(torch.arange(len(reqs)), counts_t, output_size=num_tokens)
        positions = torch.tensor(starts)[seq_of_token] + torch.arange(num_tokens) - qsl[:-1][seq_of_token]
        rows = torch.tensor([self.block_tables.row_of(r) for r in reqs])
        seq_lens = [s + n for s, n in zip(starts, counts)]
        bs = self.block_size
        block_tables = self.block_tables.table[:, rows, :-(-max(seq_lens) // bs)]  # (groups, B, blocks)
        slots = block_tables[:, seq_of_token, positions // bs].long() * bs + positions % bs  # (groups, T)
        empty = torch.zeros(0, dtype=torch.int32)
        state_slots = fresh = empty
        if self.states:
            state_slots = torch.tensor([r.state_slot for r in reqs], dtype=torch.int32)
            fresh = torch.tensor([r.state_slot for r, s in zip(reqs, starts) if s == 0], dtype=torch.int32)
        sampled = [int(qsl[i + 1]) - 1 for i, (r, s, n) in enumerate(zip(reqs, starts, counts))
                   if s + n == r.num_tokens]
        return StepInputs(torch.tensor(flat), positions, qsl, torch.tensor(seq_lens, dtype=torch.int32),
                          block_tables, slots, state_slots, fresh, torch.tensor([s > 0 for s in starts]),
                          torch.tensor(sampled, dtype=torch.long))

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over one step's tokens -> hidden states (T, hidden). Every tensor-parallel rank runs this with
        the same inputs."""
        dev, num_tokens = self.device, inputs.num_tokens
        num_seqs = inputs.seq_lens.shape[0]
        state_slots = inputs.state_slots if self.states else None
        if inputs.fresh_slots.numel():  # a reused slot holds its last owner's state: a new sequence starts from 0
            self._zero_states(inputs.fresh_slots.long().to(dev))
        if self.graphs is not None and num_tokens == num_seqs and self.graphs.bucket_for(num_tokens):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.seq_lens, inputs.block_tables,
                                   inputs.slot_mapping, inputs.max_seq_len, state_slots)
        qsl = inputs.query_start_loc
        qsl_dev, seq_lens_dev = qsl.to(dev), inputs.seq_lens.to(dev)
        max_query_len = inputs.max_query_len
        if self.states:
            self.ctx.recurrent = RecurrentMetadata(qsl_dev, state_slots.to(dev), inputs.continuing.to(dev),
                                                   decode_only=max_query_len == 1)
        for attn, tables, group_slots in zip(self.attns, inputs.block_tables, inputs.slot_mapping):
            attn.plan(AttentionMetadata(
                query_start_loc=qsl_dev, seq_lens=seq_lens_dev, block_tables=tables.to(dev),
                slot_mapping=group_slots.to(dev), max_query_len=max_query_len, max_seq_len=inputs.max_seq_len,
                query_start_loc_host=qsl))
        return self.model.forward(inputs.input_ids.to(dev), inputs.positions.to(dev), self.ctx)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        inputs = self.prepare(batch)
        if self.channel is not None:
            self.channel.send(Command.STEP, inputs.tensors())
        hidden = self.forward(inputs)
        out = RunnerOutput([], None)
        q0 = inputs.query_start_loc.tolist()
        dev = self.device
        for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            s = r.num_computed_tokens
            if r.wants_prompt_logprobs:
                first = max(s, len(r.prompt_logprobs) - 1)  # the first position not reported yet
                end = min(s + n, r.num_prompt_tokens - 1)
                if end > first:
                    rows_t = torch.arange(q0[i] + first - s, q0[i] + end - s, device=dev)
                    out.prompt_chunks.append((r, first, hidden[rows_t]))
            if s + n == r.num_tokens:
                out.sample_requests.append(r)
        if inputs.logits_indices.numel():
            out.sample_logits = self.model.compute_logits(hidden[inputs.logits_indices.to(dev)])
        return out

    def step_logits(self, inputs: StepInputs, hidden: torch.Tensor) -> None:
        """A tensor-parallel rank's side of execute's logits (the vocabulary-parallel head gathers them)."""
        if inputs.logits_indices.numel():
            self.model.compute_logits(hidden[inputs.logits_indices.to(self.device)])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.channel is not None:
            self.channel.send(Command.LOGITS, [hidden])
        return self.model.compute_logits(hidden)
