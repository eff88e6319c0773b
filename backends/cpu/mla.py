"""CPU latent attention (MLA): the cpu attention provider's split of a step (backends/cpu/attention.py) over the
latent cache's one row per token (hal/mla.py).

- Decodes run together: one index_select gathers every decode sequence's pages as a contiguous (B, L, L + R)
  batch, then one baddbmm (scale + additive mask, all heads against the same rows) and one bmm against the rows'
  latent part, with the softmax in fp32; a few sequences run in fp32 throughout (the bf16 small-shape kernels are
  slower, as for per-head attention).
- Prefill chunks run one sequence at a time through torch's SDPA, in whichever form costs fewer multiply-adds
  (hal/mla.py's expanded_prefill_pays): expanded (kv_b_proj over the sequence's latents, per-head keys and values:
  every fresh prompt) or absorbed (the single latent "KV head" shared by every query head, the latent part of the
  rows as values: a short chunk after a long cached context).
Padding every sequence of a mixed batch to the longest query and context, as the native reference does, costs
the decodes of a step as much as its longest prefill.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from resin.backends.cpu.attention import CpuAttention, chunk_mask
from resin.hal.attention import AttentionLayer
from resin.hal.mla import (MlaLayer, NativeMla, absorb_queries, expand_rows, expanded_prefill_pays, latent_values,
                            write_latents)

_FP32_DECODE_SEQS = 4  # decode sequences up to which the decode matmuls run in fp32
# The expanded form holds every head's K and V of the sequence's whole context: past this many values (256 MiB in
# bf16; a DeepSeek-V3 layer on one rank reaches it at ~3k tokens) a prefill stays absorbed, which reads latents only
_EXPANDED_ELEMENTS = 1 << 27
_MASK_ELEMENTS = 1 << 24  # the absorbed form's folded (heads x queries, keys) mask, per SDPA call


class CpuMla(CpuAttention):
    kv_cache_shape = staticmethod(NativeMla.kv_cache_shape)
    copy_blocks = NativeMla.copy_blocks

    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        return NativeMla.unsupported_reason(layers, block_size, dtype, device)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.layers[layer_idx]
        h, vd = layer.num_heads, layer.value_size
        write_latents(kv_cache, k, self.slot_mapping)
        q = q.to(kv_cache.dtype)
        pages = kv_cache.view(kv_cache.shape[0], -1)  # (pages, block_size * (L + R))
        if self.decode_tokens is not None and self.decode_all:
            return self._decode_values(q, pages, layer, v)
        out = q.new_empty(q.shape[0], h * vd)
        if self.decode_tokens is not None:
            out.index_copy_(0, self.decode_tokens,
                            self._decode_values(q.index_select(0, self.decode_tokens), pages, layer, v))
        for p in self.prefills:
            rows = pages.index_select(0, p.blocks).view(-1, layer.head_size)[:p.seq_len]
            qp = q[p.start:p.start + p.q_len]
            if expanded_prefill_pays(p.q_len, p.seq_len, layer) and \
                    p.seq_len * layer.expanded_kv_size <= _EXPANDED_ELEMENTS:
                keys, values = expand_rows(rows, v, layer)
                mask = None if p.q_len == p.seq_len else chunk_mask(p, q.device)
                got = F.scaled_dot_product_attention(
                    qp.view(p.q_len, h, -1).transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                    values.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None, scale=layer.scale)
                out[p.start:p.start + p.q_len] = got[0].transpose(0, 1).reshape(p.q_len, h * vd)
            else:
                # every head reads the one latent row, so the heads fold into the query rows of one SDPA (enable_gqa
                # broadcasting the row over a masked chunk ran ~4x slower), the rows' latent part as values; a few
                # heads at a time, so the folded mask stays bounded however long the context
                qa = absorb_queries(qp, v, layer).transpose(0, 1)  # (H, q_len, L + R)
                mask = chunk_mask(p, q.device)
                step = max(1, min(h, _MASK_ELEMENTS // mask.numel()))
                got = torch.cat([F.scaled_dot_product_attention(
                    qa[g:g + step].reshape(1, 1, -1, qa.shape[-1]), rows[None, None],
                    rows[None, None, :, :layer.latent_size], attn_mask=mask.repeat(min(step, h - g), 1),
                    scale=layer.scale)[0, 0] for g in range(0, h, step)])  # (H * q_len, L)
                got = got.view(h, p.q_len, layer.latent_size).transpose(0, 1).reshape(p.q_len, -1)
                out[p.start:p.start + p.q_len] = latent_values(got, v, layer)
        return out

    def _decode_values(self, q: torch.Tensor, pages: torch.Tensor, layer: MlaLayer,
                       kv_b: torch.Tensor) -> torch.Tensor:
        """q (B, H * (nope + R)), one query per sequence, absorbed -> values (B, H * v)."""
        qa = absorb_queries(q, kv_b, layer)
        b, h, d = qa.shape
        length = self.decode_valid.shape[1]
        rows = pages.index_select(0, self.decode_blocks.flatten()).view(b, length, d)
        if b <= _FP32_DECODE_SEQS and rows.dtype != torch.float32:
            rows, qa = rows.float(), qa.float()
        bias = self._decode_bias(None, 1, h, rows.dtype)  # (B, H, length)
        scores = torch.baddbmm(bias, qa, rows.transpose(1, 2), alpha=layer.scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(rows.dtype)
        out = torch.bmm(probs, rows[..., :layer.latent_size]).to(self.dtype)
        return latent_values(out.reshape(b, -1), kv_b, layer)
