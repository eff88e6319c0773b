"""Paged attention over a mixed prefill + decode flat batch, as one Triton kernel (plus a split-K reduce).

Each program owns a tile of BLOCK_Q query tokens of one sequence x the query heads sharing one KV head (GQA: K and
V are loaded once for the whole group), and walks that sequence's paged blocks through its block table with an
online softmax. Prefill chunks get several programs per sequence (causal varlen); decode tokens get one. When a
decode-only batch has too few programs to fill the GPU, the key range is split across NUM_SPLITS programs
(flash-decoding) and a second kernel merges the partial softmaxes. Sliding window, logit soft-cap and sinks are
handled in the kernel. Cache layout: (2, num_blocks, block_size, kv_heads, head_size).

Graph-safe for decode buckets: everything the launch depends on is a function of the batch size (capture_state
allocates it; plan_for_replay re-points it), while lengths and block tables are read from device memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resin.backends.triton.kv_cache import write_kv
from resin.backends.triton.tuning import Tuning, current
from resin.hal.attention import AttentionBackend, AttentionLayer, AttentionMetadata

_MAX_SPLITS = 16


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """fp32 operands: IEEE products (the default would round them to tf32 on NVIDIA)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One key block of an online softmax over rows of scores s (-inf where masked): the block's probabilities
    against the new running max, the factor that rescales what was accumulated, the new max and denominator."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _store_output(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tok, head, d, row_ok, d_ok, out_stride,
                  width, num_heads, split, NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows (token, head) of `width` outputs: normalised, or with split-K the split's accumulator and (max, sum)
    in the merge kernel's layout, (token, head, split) parts of BLOCK_D floats."""
    store_ok = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * out_stride + head[:, None] * width + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_ok)
    else:
        part = (tok[:, None] * num_heads + head[:, None]) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part * BLOCK_D + d[None, :], acc, mask=store_ok)
        tl.store(part_ml_ptr + part * 2 + tl.arange(0, 2)[None, :],
                 tl.where(tl.arange(0, 2)[None, :] == 0, m_i[:, None], l_i[:, None]), mask=row_ok[:, None])


@triton.jit
def _paged_attention_kernel(
        q_ptr, cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
        prog_seq_ptr, prog_q0_ptr, q_stride, out_stride, bt_stride, plane, blk_stride, tok_stride, scale, soft_cap,
        window, group, head_size, HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
        NUM_SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(prog_seq_ptr + pid).to(tl.int64)
    q0 = tl.load(prog_q0_ptr + pid)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # position of the sequence's first query token

    rows = tl.arange(0, BLOCK_Q * G_PAD)
    qi = q0 + rows // G_PAD
    g = rows % G_PAD
    row_ok = (qi < q_len) & (g < group)
    head = kvh * group + g
    tok = (q_start + qi).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_size
    q = tl.load(q_ptr + tok[:, None] * q_stride + head[:, None] * head_size + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx + qi

    hi = tl.minimum(ctx + q0 + BLOCK_Q, seq_len)  # one past the last key any row of this tile may see
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx + q0 - window + 1, 0)
    first_blk = lo // BLOCK_SIZE
    last_blk = tl.cdiv(hi, BLOCK_SIZE)
    if NUM_SPLITS > 1:
        per = tl.cdiv(last_blk - first_blk, NUM_SPLITS)
        first_blk = first_blk + split * per
        last_blk = tl.minimum(first_blk + per, last_blk)

    if HAS_SINKS and NUM_SPLITS == 1:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        l_i = tl.full([BLOCK_Q * G_PAD], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    kv_offs = offs[:, None] * tok_stride + kvh * head_size + d[None, :]
    for j in range(first_blk, last_blk):
        blk = tl.load(block_tables_ptr + seq * bt_stride + j).to(tl.int64)
        k = tl.load(cache_ptr + blk * blk_stride + kv_offs, mask=d_ok[None, :], other=0.0)
        v = tl.load(cache_ptr + plane + blk * blk_stride + kv_offs, mask=d_ok[None, :], other=0.0)
        s = _dot(q, tl.trans(k), IEEE) * scale
        if HAS_SOFTCAP:
            s = soft_cap * (2.0 / (1.0 + tl.exp(-2.0 * s / soft_cap)) - 1.0)  # cap * tanh(s / cap)
        k_pos = j * BLOCK_SIZE + offs
        ok = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
        if HAS_WINDOW:
            ok = ok & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)

    _store_output(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tok, head, d, row_ok, d_ok, out_stride,
                  head_size, group * tl.num_programs(1), split, NUM_SPLITS, BLOCK_D)


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_ml_ptr, sinks_ptr, out_ptr, out_stride, num_heads, head_size,
                         HAS_SINKS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (tok * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(part_ml_ptr + part * 2)
    l = tl.load(part_ml_ptr + part * 2 + 1)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_safe)
    denom = tl.sum(l * w, 0)
    if HAS_SINKS:
        denom += tl.exp(sink - m_safe)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], mask=d[None, :] < head_size, other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + tok * out_stride + head * head_size + d, out.to(out_ptr.dtype.element_ty), mask=d < head_size)


class TritonAttention(AttentionBackend):
    supports_graphs = True

    def __init__(self, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype, device: torch.device,
                 tuning: Tuning | None = None):
        super().__init__(layers, block_size, dtype, device)
        self.tuning = tuning or current()
        self._graph_state: tuple[torch.Tensor, torch.Tensor] | None = None
        self.max_group = max(layer.num_heads // layer.num_kv_heads for layer in layers)
        self.max_kv_heads = max(layer.num_kv_heads for layer in layers)

    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        if block_size < 16 or block_size & (block_size - 1):
            return f"block size {block_size}: the triton kernel needs a power of two >= 16 (tensor-core tiles)"
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"KV cache dtype {dtype} is not supported by the triton attention kernel"
        if any(layer.head_size > 256 for layer in layers):
            return "head size > 256 does not fit the triton attention tile"
        if any(layer.head_size < 16 for layer in layers):
            return "head size < 16: tensor-core dots need 16 along the head dimension"
        return None

    # -- planning ---------------------------------------------------------------------------------------------
    def _tile(self, max_group: int, decode_only: bool) -> tuple[int, int]:
        g_pad = triton.next_power_of_2(max_group)
        rows = 16 if decode_only else self.tuning.attention_rows(self.dtype)
        return max(1, rows // g_pad), g_pad

    def _splits(self, num_seqs: int, max_blocks: int) -> int:
        want = self.tuning.decode_target_programs // max(1, num_seqs * self.max_kv_heads)
        n = max(1, min(_MAX_SPLITS, want, max_blocks))
        return 1 << (n.bit_length() - 1)  # a power of two: the merge kernel reduces over tl.arange(0, splits)

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        qsl = meta.query_start_loc_host if meta.query_start_loc_host is not None else meta.query_start_loc.cpu()
        q_lens = (qsl[1:] - qsl[:-1]).long()
        decode_only = meta.max_query_len == 1
        self.block_q, self.g_pad = self._tile(self.max_group, decode_only)
        progs = -(-q_lens // self.block_q)
        starts = torch.cumsum(progs, 0) - progs
        prog_seq = torch.repeat_interleave(torch.arange(len(q_lens)), progs)
        prog_q0 = (torch.arange(int(progs.sum())) - starts[prog_seq]) * self.block_q
        self.prog_seq = prog_seq.to(torch.int32).to(self.device, non_blocking=True)
        self.prog_q0 = prog_q0.to(torch.int32).to(self.device, non_blocking=True)
        self.num_splits = (self._splits(meta.num_seqs, -(-meta.max_seq_len // self.block_size))
                           if decode_only else 1)

    def capture_state(self, max_batch: int) -> None:
        zeros = torch.zeros(max_batch, dtype=torch.int32, device=self.device)
        self._graph_state = (torch.arange(max_batch, dtype=torch.int32, device=self.device), zeros)

    def plan_for_replay(self, batch_size: int, meta: AttentionMetadata) -> None:
        """Decode-only bucket of `batch_size` (padded) sequences: the launch depends on nothing else."""
        assert self._graph_state is not None, "capture_state() first"
        self.meta = meta
        self.block_q, self.g_pad = self._tile(self.max_group, True)
        self.prog_seq, self.prog_q0 = (t[:batch_size] for t in self._graph_state)
        self.num_splits = self._splits(batch_size, _MAX_SPLITS)

    # -- per layer ----------------------------------------------------------------------------------------------
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        layer, meta, tuning = self.layers[layer_idx], self.meta, self.tuning
        h, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_size
        write_kv(kv_cache, k, v, meta.slot_mapping, tuning)
        num_tokens = q.shape[0]
        q2 = q.reshape(num_tokens, h * d)
        q2 = q2 if q2.stride(-1) == 1 else q2.contiguous()
        out = torch.empty(num_tokens, h * d, dtype=q.dtype, device=q.device)
        _, nb, bs, _, _ = kv_cache.shape
        splits, block_d = self.num_splits, triton.next_power_of_2(d)
        part_acc = part_ml = out
        if splits > 1:
            part_acc = torch.empty(num_tokens * h * splits * block_d, dtype=torch.float32, device=q.device)
            part_ml = torch.empty(num_tokens * h * splits * 2, dtype=torch.float32, device=q.device)
        grid = (self.prog_seq.shape[0], hk, splits)
        if grid[0]:
            _paged_attention_kernel[grid](
                q2, kv_cache, out, part_acc, part_ml, sinks if sinks is not None else out, meta.block_tables,
                meta.seq_lens, meta.query_start_loc, self.prog_seq, self.prog_q0, q2.stride(0), out.stride(0),
                meta.block_tables.stride(0), nb * bs * hk * d, bs * hk * d, hk * d, layer.scale,
                layer.logits_soft_cap or 0.0, layer.sliding_window or 0, h // hk, d,
                HAS_SINKS=sinks is not None, HAS_SOFTCAP=bool(layer.logits_soft_cap),
                HAS_WINDOW=layer.sliding_window is not None, NUM_SPLITS=splits, BLOCK_Q=self.block_q,
                G_PAD=self.g_pad, BLOCK_D=block_d, BLOCK_SIZE=bs, IEEE=q.dtype == torch.float32,
                **tuning.launch(tuning.attention_warps, tuning.attention_stages))
            if splits > 1:
                _merge_splits_kernel[(num_tokens, h)](
                    part_acc, part_ml, sinks if sinks is not None else out, out, out.stride(0), h, d,
                    HAS_SINKS=sinks is not None, NUM_SPLITS=splits, BLOCK_D=block_d,
                    **tuning.launch(tuning.elementwise_warps))
        return out
