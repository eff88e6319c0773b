"""CPU latent attention (MLA): the cpu attention provider's split of a step (backends/cpu/attention.py) over the
latent cache's one row per token (hal/mla.py).

- Decodes run together: one index_select gathers every decode sequence's pages as a contiguous (B, L, L + R)
  batch, then one baddbmm (scale + additive mask, all heads against the same rows) and one bmm against the rows'
  latent part, with the softmax in fp32; a few sequences run in fp32 throughout (the bf16 small-shape kernels are
  slower, as for per-head attention).
- Prefill chunks run one sequence at a time through torch's SDPA with the single latent "KV head" shared by every
  query head (enable_gqa) and the latent part of the rows as values (values narrower than keys).
Padding every sequence of a mixed batch to the longest query and context, as the native reference does, costs
the decodes of a step as much as its longest prefill.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from resin.backends.cpu.attention import CpuAttention, _Prefill
from resin.hal.attention import AttentionLayer
from resin.hal.mla import NativeMla, write_latents

_FP32_DECODE_SEQS = 4  # decode sequences up to which the decode matmuls run in fp32


class CpuMla(CpuAttention):
    kv_cache_shape = staticmethod(NativeMla.kv_cache_shape)
    copy_blocks = NativeMla.copy_blocks

    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        return NativeMla.unsupported_reason(layers, block_size, dtype, device)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.layers[layer_idx]
        h, d, lat = layer.num_heads, layer.head_size, layer.latent_size
        write_latents(kv_cache, k, self.slot_mapping)
        q = q.view(-1, h, d).to(kv_cache.dtype)
        pages = kv_cache.view(kv_cache.shape[0], -1)  # (pages, block_size * (L + R))
        if self.decode_tokens is not None and self.decode_all:
            return self._decode_rows(q, pages, layer).reshape(-1, h * lat)
        out = q.new_empty(q.shape[0], h, lat)
        if self.decode_tokens is not None:
            out.index_copy_(0, self.decode_tokens,
                            self._decode_rows(q.index_select(0, self.decode_tokens), pages, layer))
        for p in self.prefills:
            out[p.start:p.start + p.q_len] = self._prefill_rows(q[p.start:p.start + p.q_len], pages, layer, p)
        return out.reshape(-1, h * lat)

    def _decode_rows(self, q: torch.Tensor, pages: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        """q (B, H, L + R), one query per sequence -> (B, H, L)."""
        b, h, d = q.shape
        length = self.decode_valid.shape[1]
        rows = pages.index_select(0, self.decode_blocks.flatten()).view(b, length, d)
        if b <= _FP32_DECODE_SEQS and rows.dtype != torch.float32:
            rows, q = rows.float(), q.float()
        bias = self._decode_bias(None, 1, h, rows.dtype)  # (B, H, length)
        scores = torch.baddbmm(bias, q, rows.transpose(1, 2), alpha=layer.scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(rows.dtype)
        return torch.bmm(probs, rows[..., :layer.latent_size]).to(self.dtype)

    def _prefill_rows(self, q: torch.Tensor, pages: torch.Tensor, layer: AttentionLayer,
                      p: _Prefill) -> torch.Tensor:
        """q (q_len, H, L + R) of one sequence whose context is p.seq_len tokens (the chunk is its tail)."""
        rows = pages.index_select(0, p.blocks).view(-1, layer.head_size)[:p.seq_len].view(1, 1, p.seq_len, -1)
        qh = q.transpose(0, 1).unsqueeze(0)  # (1, H, q_len, L + R)
        values = rows[..., :layer.latent_size]
        if p.q_len == p.seq_len:
            out = F.scaled_dot_product_attention(qh, rows, values, is_causal=True, scale=layer.scale,
                                                 enable_gqa=True)
        else:
            q_pos = torch.arange(p.seq_len - p.q_len, p.seq_len, device=q.device).unsqueeze(1)
            mask = torch.arange(p.seq_len, device=q.device).unsqueeze(0) <= q_pos
            out = F.scaled_dot_product_attention(qh, rows, values, attn_mask=mask, scale=layer.scale,
                                                 enable_gqa=True)
        return out[0].transpose(0, 1)
