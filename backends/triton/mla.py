"""Paged latent attention (MLA) over a mixed prefill + decode flat batch, as one Triton kernel plus a split-K merge.

The cache holds one row per token, [latent (L) | k_rope (R)] (hal/mla.py); queries come absorbed, the same split
(NativeMla.forward applies the layer's up-projection around the kernel).
Each program owns a tile of BLOCK_Q query tokens of one sequence x BLOCK_H heads (every head reads the same rows,
so a row is loaded once per tile) and walks the sequence's pages with an online softmax: scores are the latent dot
plus the rope dot (two dots: L and R are padded apart to powers of two, 512 + 64 for DeepSeek, not 576 -> 1024),
the output accumulates the latent part of the same rows. Decode-only batches with too few programs split the key
range (flash-decoding) and attention.py's merge kernel combines the partial softmaxes.

Graph-safe for decode buckets, as the paged attention kernel is: the launch depends on the batch size alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resin.backends.triton.attention import _MAX_SPLITS, _dot, _merge_splits_kernel, _online_softmax, _store_output
from resin.backends.triton.tuning import Tuning, current
from resin.hal.attention import AttentionLayer, AttentionMetadata
from resin.hal.mla import MlaLayer, NativeMla


@triton.jit
def _write_rows_kernel(rows_ptr, cache_ptr, slot_ptr, rows_stride, row_size, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:  # -1: a padding row of a replayed graph
        offs = tl.arange(0, BLOCK)
        mask = offs < row_size
        row = tl.load(rows_ptr + tok * rows_stride + offs, mask=mask)
        tl.store(cache_ptr + slot * row_size + offs, row.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_mla_kernel(
        q_ptr, cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, prog_seq_ptr,
        prog_q0_ptr, q_stride, out_stride, bt_stride, blk_stride, num_heads, latent, rope, scale,
        NUM_SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(prog_seq_ptr + pid).to(tl.int64)
    q0 = tl.load(prog_q0_ptr + pid)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    qi = q0 + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_ok = (qi < q_len) & (head < num_heads)
    tok = (q_start + qi).to(tl.int64)
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    l_ok, r_ok = dl < latent, dr < rope
    q_row = q_ptr + tok[:, None] * q_stride + head[:, None] * (latent + rope)
    q_lat = tl.load(q_row + dl[None, :], mask=row_ok[:, None] & l_ok[None, :], other=0.0)
    q_rope = tl.load(q_row + latent + dr[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    q_pos = ctx + qi

    hi = tl.minimum(ctx + q0 + BLOCK_Q, seq_len)
    first_blk = 0
    last_blk = tl.cdiv(hi, BLOCK_SIZE)
    if NUM_SPLITS > 1:
        per = tl.cdiv(last_blk, NUM_SPLITS)
        first_blk = split * per
        last_blk = tl.minimum(first_blk + per, last_blk)

    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_L], tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    for j in range(first_blk, last_blk):
        blk = tl.load(block_tables_ptr + seq * bt_stride + j).to(tl.int64)
        page = cache_ptr + blk * blk_stride + offs[:, None] * (latent + rope)
        k_lat = tl.load(page + dl[None, :], mask=l_ok[None, :], other=0.0)
        k_rope = tl.load(page + latent + dr[None, :], mask=r_ok[None, :], other=0.0)
        s = (_dot(q_lat, tl.trans(k_lat), IEEE) + _dot(q_rope, tl.trans(k_rope), IEEE)) * scale
        k_pos = j * BLOCK_SIZE + offs
        ok = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
        p, alpha, m_i, l_i = _online_softmax(tl.where(ok, s, float("-inf")), m_i, l_i)
        acc = acc * alpha[:, None] + _dot(p.to(k_lat.dtype), k_lat, IEEE)

    _store_output(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tok, head, dl, row_ok, l_ok, out_stride,
                  latent, num_heads, split, NUM_SPLITS, BLOCK_L)


class TritonMla(NativeMla):
    """The cache layout (and page copy) of NativeMla; planning and the kernel of its own.

    Every row runs absorbed, prefill chunks included, though expanded_prefill_pays says a fresh prompt costs ~3x
    fewer multiply-adds per (query, key) pair expanded: the expanded form needs per-head K and V of the chunk's
    whole context, which the latent cache does not hold, so it wants a ragged (varlen) attention kernel over
    freshly expanded tensors, not this paged one. Until one is measured on a GPU, prefill stays on this kernel
    (the cpu provider does choose per sequence)."""

    supports_graphs = True

    def __init__(self, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype, device: torch.device,
                 tuning: Tuning | None = None):
        super().__init__(layers, block_size, dtype, device)
        self.tuning = tuning or current()
        self._graph_state: tuple[torch.Tensor, torch.Tensor] | None = None
        self.block_h = min(16, triton.next_power_of_2(max(layer.num_heads for layer in layers)))
        self.head_blocks = max(-(-layer.num_heads // self.block_h) for layer in layers)

    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        reason = super().unsupported_reason(layers, block_size, dtype, device)
        if reason:
            return reason
        if block_size < 16 or block_size & (block_size - 1):
            return f"block size {block_size}: the triton MLA kernel needs a power of two >= 16"
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"KV cache dtype {dtype} is not supported by the triton MLA kernel"
        for layer in layers:
            assert isinstance(layer, MlaLayer)
            if not 16 <= layer.latent_size <= 512 or not 16 <= layer.rope_size <= 128:
                return (f"latent {layer.latent_size} + rope {layer.rope_size}: the triton MLA kernel takes a latent of "
                        f"16..512 and rope dims of 16..128")
        return None

    def _programs(self, q_lens: torch.Tensor, block_q: int) -> None:
        progs = -(-q_lens // block_q)
        starts = torch.cumsum(progs, 0) - progs
        prog_seq = torch.repeat_interleave(torch.arange(len(q_lens)), progs)
        prog_q0 = (torch.arange(int(progs.sum())) - starts[prog_seq]) * block_q
        self.prog_seq = prog_seq.to(torch.int32).to(self.device, non_blocking=True)
        self.prog_q0 = prog_q0.to(torch.int32).to(self.device, non_blocking=True)

    def _splits(self, num_seqs: int, max_blocks: int) -> int:
        want = self.tuning.decode_target_programs // max(1, num_seqs * self.head_blocks)
        n = max(1, min(_MAX_SPLITS, want, max_blocks))
        return 1 << (n.bit_length() - 1)

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        qsl = meta.query_start_loc_host if meta.query_start_loc_host is not None else meta.query_start_loc.cpu()
        self.block_q = max(1, 16 // self.block_h)  # 16 rows a tile: tokens x heads
        self._programs((qsl[1:] - qsl[:-1]).long(), self.block_q)
        decode_only = meta.max_query_len == 1
        self.num_splits = self._splits(meta.num_seqs, -(-meta.max_seq_len // self.block_size)) if decode_only else 1

    def capture_state(self, max_batch: int) -> None:
        zeros = torch.zeros(max_batch, dtype=torch.int32, device=self.device)
        self._graph_state = (torch.arange(max_batch, dtype=torch.int32, device=self.device), zeros)

    def plan_for_replay(self, batch_size: int, meta: AttentionMetadata) -> None:
        assert self._graph_state is not None, "capture_state() first"
        self.meta = meta
        self.block_q = max(1, 16 // self.block_h)
        self.prog_seq, self.prog_q0 = (t[:batch_size] for t in self._graph_state)
        self.num_splits = self._splits(batch_size, _MAX_SPLITS)

    def latent_forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                       kv_cache: torch.Tensor) -> torch.Tensor:
        layer, meta, tuning = self.layers[layer_idx], self.meta, self.tuning
        h, d, lat = layer.num_heads, layer.head_size, layer.latent_size
        num_tokens = q.shape[0]
        bs = kv_cache.shape[1]
        rows = k.reshape(num_tokens, d)
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        if num_tokens:
            _write_rows_kernel[(num_tokens,)](rows, kv_cache, meta.slot_mapping, rows.stride(0), d,
                                              BLOCK=triton.next_power_of_2(d),
                                              **tuning.launch(tuning.elementwise_warps))
        q2 = q.reshape(num_tokens, h * d)
        q2 = q2 if q2.stride(-1) == 1 else q2.contiguous()
        out = torch.empty(num_tokens, h * lat, dtype=q.dtype, device=q.device)
        splits, block_l = self.num_splits, triton.next_power_of_2(lat)
        part_acc = part_ml = out
        if splits > 1:
            part_acc = torch.empty(num_tokens * h * splits * block_l, dtype=torch.float32, device=q.device)
            part_ml = torch.empty(num_tokens * h * splits * 2, dtype=torch.float32, device=q.device)
        grid = (self.prog_seq.shape[0], -(-h // self.block_h), splits)
        if grid[0]:
            _paged_mla_kernel[grid](
                q2, kv_cache, out, part_acc, part_ml, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                self.prog_seq, self.prog_q0, q2.stride(0), out.stride(0), meta.block_tables.stride(0), bs * d, h,
                lat, d - lat, layer.scale, NUM_SPLITS=splits, BLOCK_Q=self.block_q, BLOCK_H=self.block_h,
                BLOCK_L=block_l, BLOCK_R=triton.next_power_of_2(d - lat), BLOCK_SIZE=bs,
                IEEE=q.dtype == torch.float32, **tuning.launch(tuning.attention_warps, tuning.attention_stages))
            if splits > 1:
                _merge_splits_kernel[(num_tokens, h)](
                    part_acc, part_ml, out, out, out.stride(0), h, lat, HAS_SINKS=False, NUM_SPLITS=splits,
                    BLOCK_D=block_l, **tuning.launch(tuning.elementwise_warps))
        return out
