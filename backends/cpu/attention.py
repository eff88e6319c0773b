"""CPU paged attention: each batch shape on its fastest plain-torch path (measured in bench/attention_paths.py).

A step's sequences are split into decodes (one query each) and prefill chunks.
- Decodes run together. The cache is head-major (2, Hk, blocks, block_size, D), so one index_select over the
  block tables gathers whole blocks of K and V for every KV head into a contiguous (2, Hk*B, L, D) batch (no
  transposing copy before the matmul); then one baddbmm (scale + additive mask) for scores and one bmm for values
  with the query heads sharing each KV head stacked (GQA without copying K/V), and an fp32 softmax. For one
  query row this beat SDPA 5-10x in bf16 at batch 32; for a few sequences K/V are upcast and the matmuls run
  in fp32, which torch's small-shape kernels do faster than bf16.
- Prefill chunks run one sequence at a time through torch's fused SDPA: causal without a mask when the chunk is
  the whole context, with a small mask when it continues cached context or has a sliding window. Padding
  sequences of different lengths into one masked call measured 2x slower.
Soft-capping and sinks are not handled here: layers with them fall through to native.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from resin.backends.cpu.kernels import brgemm_bf16, extension, flash_prefill_f32
from resin.hal.attention import AttentionBackend, AttentionLayer, AttentionMetadata


# torch's CPU flash-attention kernel (what SDPA runs without a mask), called directly because it also returns each
# query row's log-sum-exp, which merging two key ranges needs; it takes grouped KV heads as they are.
_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FP32_DECODE_ROWS = 12  # KV heads x decode sequences up to which decode attention runs in fp32


def gather_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """(2, Hk, n, block_size, D) copy of the listed blocks. index_select over whole rows of block_size * D
    copies row by row; advanced indexing (kv_cache[:, :, blocks]) went element by element, 4-5x slower."""
    two, hk, nb, bs, d = kv_cache.shape
    return torch.index_select(kv_cache.view(two * hk, nb, bs * d), 1, blocks).view(two, hk, -1, bs, d)


@dataclass
class _Prefill:
    start: int  # first token in the flat batch
    q_len: int
    seq_len: int
    blocks: torch.Tensor  # this sequence's block ids, enough to cover seq_len


def chunk_mask(p: _Prefill, device: torch.device, window: int | None = None) -> torch.Tensor:
    """(q_len, seq_len): which of its sequence's keys each query of a chunk (the tail of p.seq_len) sees: causal,
    and within the sliding window where there is one."""
    q_pos = torch.arange(p.seq_len - p.q_len, p.seq_len, device=device).unsqueeze(1)
    key_pos = torch.arange(p.seq_len, device=device).unsqueeze(0)
    mask = key_pos <= q_pos
    if window is not None:
        mask &= key_pos > q_pos - window
    return mask


class CpuAttention(AttentionBackend):
    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Head-major: one KV head's blocks gathered through a block table come out as one contiguous
        (B, L, D) matrix per sequence, which BLAS reads without a transposing copy."""
        return (2, num_kv_heads, num_blocks, block_size, head_size)

    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv_cache.index_copy_(2, dst, kv_cache.index_select(2, src))  # head-major: pages on axis 2

    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        if any(layer.logits_soft_cap for layer in layers):
            return "logit soft-cap is not supported by the cpu attention provider"
        if any(layer.has_sinks for layer in layers):
            return "attention sinks are not supported by the cpu attention provider"
        return None

    def plan(self, meta: AttentionMetadata) -> None:
        self.slot_mapping = meta.slot_mapping
        bs = self.block_size
        qsl, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        decode, self.prefills = [], []
        for i, (start, end, seq_len) in enumerate(zip(qsl, qsl[1:], seq_lens)):
            if end - start == 1:
                decode.append(i)
            else:
                self.prefills.append(_Prefill(start, end - start, seq_len, meta.block_tables[i, :-(-seq_len // bs)]))
        self.decode_tokens = None
        if decode:
            idx = torch.tensor(decode, device=meta.seq_lens.device)
            self.decode_tokens = meta.query_start_loc.long()[idx]
            self.decode_all = len(decode) == len(seq_lens)  # then tokens are exactly 0..B-1
            self._plan_decode(meta, idx)

    def _plan_decode(self, meta: AttentionMetadata, idx: torch.Tensor) -> None:
        bs = self.block_size
        lens = meta.seq_lens.long()[idx]
        nblk = -(-int(lens.max()) // bs)
        self.decode_blocks = meta.block_tables[idx, :nblk].long()  # (B, nblk)
        key_pos = torch.arange(nblk * bs, device=idx.device)
        self.decode_lens = lens
        self.decode_valid = key_pos.unsqueeze(0) < lens.unsqueeze(1)  # (B, L)
        self.decode_key_pos = key_pos
        self._biases: dict[tuple, torch.Tensor] = {}

    def _decode_bias(self, window: int | None, kv_heads: int, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (Hk*B, G, L): 0 where a key is visible, -inf elsewhere; made once per step."""
        key = (window, kv_heads, group, dtype)
        if key not in self._biases:
            visible = self.decode_valid
            if window is not None:
                visible = visible & (self.decode_key_pos.unsqueeze(0) > (self.decode_lens - 1 - window).unsqueeze(1))
            bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
            b, length = visible.shape
            self._biases[key] = bias.view(1, b, 1, length).expand(kv_heads, b, group, length).reshape(
                kv_heads * b, group, length)
        return self._biases[key]

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.layers[layer_idx]
        h, d = layer.num_heads, layer.head_size
        self._write_kv(k, v, kv_cache)
        q = q.view(-1, h, d).to(kv_cache.dtype)
        if self.decode_tokens is not None and self.decode_all:
            return self._decode(q, kv_cache, layer).reshape(-1, h * d)
        out = torch.empty_like(q)
        if self.decode_tokens is not None:
            out.index_copy_(0, self.decode_tokens, self._decode(q.index_select(0, self.decode_tokens), kv_cache, layer))
        for p in self.prefills:
            out[p.start:p.start + p.q_len] = self._prefill(q[p.start:p.start + p.q_len], kv_cache, layer, p)
        return out.reshape(-1, h * d)

    def _write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Store the new keys/values at their slots, head-major."""
        _, hk, nb, bs, d = kv_cache.shape
        for i, new in enumerate((k, v)):
            kv_cache[i].view(hk, nb * bs, d).index_copy_(1, self.slot_mapping,
                                                         new.view(-1, hk, d).transpose(0, 1).to(kv_cache.dtype))

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        """q (B, H, D) -> (B, H, D), one query per sequence."""
        b, h, d = q.shape
        hk = layer.num_kv_heads
        g = h // hk
        # One gather of whole blocks for K and V of every KV head: (2, Hk, B, nblk, bs, D), contiguous, so each
        # (KV head, sequence) pair is a (L, D) matrix and one bmm covers them all without copying K/V again.
        length = self.decode_valid.shape[1]
        kv = gather_blocks(kv_cache, self.decode_blocks.flatten()).view(2, hk * b, length, d)
        qg = q.view(b, hk, g, d).transpose(0, 1).reshape(hk * b, g, d)  # query heads grouped by KV head
        # For a few (KV head, sequence) pairs the bf16 bmm kernels cost more than upcasting K/V and running
        # fp32 ones (bench/attention_paths.py: faster at batch 1-4 with 3 KV heads, several times slower from batch 8).
        if hk * b <= _FP32_DECODE_ROWS and kv.dtype != torch.float32:
            kv, qg = kv.float(), qg.float()
        # scale and mask in one op; the softmax runs in fp32
        scores = torch.baddbmm(self._decode_bias(layer.sliding_window, hk, g, kv.dtype), qg, kv[0].transpose(1, 2),
                               alpha=layer.scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(kv.dtype)
        out = torch.bmm(probs, kv[1]).to(q.dtype)  # (Hk*B, G, D)
        return out.view(hk, b, g, d).transpose(0, 1).reshape(b, h, d)

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: AttentionLayer, p: _Prefill) -> torch.Tensor:
        """q (q_len, H, D) of one sequence whose context is p.seq_len tokens (the chunk is its tail)."""
        h, hk = layer.num_heads, layer.num_kv_heads
        kv = gather_blocks(kv_cache, p.blocks).flatten(2, 3)[:, :, :p.seq_len]  # (2, Hk, seq_len, D)
        keys, values = kv[0].unsqueeze(0), kv[1].unsqueeze(0)
        qh = q.transpose(0, 1).unsqueeze(0)  # (1, H, q_len, D)
        window = layer.sliding_window
        if p.q_len == p.seq_len and window is None:
            out = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=layer.scale,
                                                 enable_gqa=hk != h)
        elif window is None:
            # A chunk after a prefix: the prefix's keys unmasked and the chunk's own keys causal, each a flash call
            # (no mask to build or apply: an 8k-token prefill's last 2048-row chunk 115 -> 81 ms a layer), merged
            # by their log-sum-exps in fp32.
            start = p.seq_len - p.q_len
            o1, lse1 = _flash_with_lse(qh, keys[:, :, :start], values[:, :, :start], scale=layer.scale)
            o2, lse2 = _flash_with_lse(qh, keys[:, :, start:], values[:, :, start:], is_causal=True,
                                       scale=layer.scale)
            top = torch.maximum(lse1, lse2)
            w1, w2 = (lse1 - top).exp_().unsqueeze(-1), (lse2 - top).exp_().unsqueeze(-1)
            out = ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(q.dtype)
        else:
            mask = chunk_mask(p, q.device, window)
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=layer.scale,
                                                 enable_gqa=hk != h)
        return out[0].transpose(0, 1)


class CppAttention(CpuAttention):
    """CpuAttention with decode rows and the KV write on Resin's C++ kernels (backends/cpu/kernels.py): the
    kernel reads K and V in place through the block table, so no gather, no mask and no per-step bias. bf16
    prefill chunks without a sliding window go to the brgemm flash kernel where torch's ukernels have AMX tiles
    (csrc/prefill_attention.cpp: the query heads of a KV head stacked as one GEMM's rows, K/V packed once per
    call, a chunk after cached context in one pass; `python bench/attention_paths.py --prefill` times it against
    SDPA); fp32 ones, and bf16 ones where there is no AMX, to its AVX2 counterpart (csrc/prefill_attention_f32.cpp:
    fp32 products, or bf16 ones by vdpbf16ps on AVX512-BF16); other prefills stay on SDPA."""

    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"Resin's C++ attention takes float32/bfloat16/float16, not {dtype}"
        return super().unsupported_reason(layers, block_size, dtype, device)

    def _plan_decode(self, meta: AttentionMetadata, idx: torch.Tensor) -> None:
        all_rows = idx.shape[0] == meta.seq_lens.shape[0]
        self.decode_tables = meta.block_tables if all_rows else meta.block_tables[idx]
        self.decode_seq_lens = meta.seq_lens if all_rows else meta.seq_lens[idx]
        if self.decode_tables.dtype != torch.int32 or self.decode_tables.stride(-1) != 1:
            self.decode_tables = self.decode_tables.to(torch.int32).contiguous()
        self.decode_seq_lens = self.decode_seq_lens.to(torch.int32).contiguous()

    def _write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> None:
        slots = self.slot_mapping
        if (k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype or k.dim() != 2 or v.dim() != 2
                or k.stride(-1) != 1 or v.stride(-1) != 1 or slots.dtype != torch.int64 or not slots.is_contiguous()):
            return super()._write_kv(k, v, kv_cache)
        extension().write_kv(kv_cache, k, v, slots)

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: AttentionLayer, p: _Prefill) -> torch.Tensor:
        if layer.sliding_window is not None or q.dtype != kv_cache.dtype:
            return super()._prefill(q, kv_cache, layer, p)
        amx = brgemm_bf16()
        if q.dtype == torch.bfloat16 and layer.head_size % 64 == 0 and amx:
            kernel = extension().flash_prefill_attention
        elif (q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and not amx)) and layer.head_size % 16 == 0 \
                and flash_prefill_f32():  # bf16 with AMX but another head size: SDPA, which has oneDNN's AMX paths
            kernel = extension().flash_prefill_attention_f32
        else:
            return super()._prefill(q, kv_cache, layer, p)
        out = kernel(q.reshape(p.q_len, -1), kv_cache, p.blocks, p.seq_len, layer.num_heads, layer.scale)
        return out.view(q.shape)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        b, h, d = q.shape
        out = extension().paged_decode_attention(q.reshape(b, h * d), kv_cache, self.decode_tables,
                                                 self.decode_seq_lens, h, layer.scale, layer.sliding_window or 0)
        return out.view(b, h, d)
