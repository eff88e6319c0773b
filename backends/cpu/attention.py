"""CPU paged attention, over K/V gathered from the paged cache, each batch shape on its fastest torch path.

The step's sequences are split into decodes (one query each) and prefill chunks; each group is padded only to
its own longest query and context, so a long prefill never inflates the decode rows (and vice versa). Prefill
chunks go through torch's fused scaled_dot_product_attention; decodes through two batched matmuls with the
query heads of each KV head stacked (GQA without copying K/V), which measured 5-10x faster than SDPA for one
query row in bf16 (bench/attention_paths.py). Everything stays in the cache dtype except the softmax (fp32).
Soft-capping and sinks are not handled here: layers with them fall through to native.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from resin.hal.attention import AttentionBackend, AttentionLayer, AttentionMetadata, write_kv


@dataclass
class _Group:
    tokens: torch.Tensor  # flat-batch indices of the group's tokens
    pad_index: torch.Tensor  # where each token sits in the (B_g * max_q) padded grid
    kv_slots: torch.Tensor  # (B_g, max_kv) cache slots to gather
    q_pos: torch.Tensor  # (B_g, max_q) position of each padded query
    key_pos: torch.Tensor  # (max_kv,)
    num_seqs: int
    max_q: int
    masks: dict


class CpuAttention(AttentionBackend):
    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        if any(layer.logits_soft_cap for layer in layers):
            return "logit soft-cap is not expressible in SDPA"
        if any(layer.has_sinks for layer in layers):
            return "attention sinks are not expressible in SDPA"
        return None

    def plan(self, meta: AttentionMetadata) -> None:
        self.slot_mapping = meta.slot_mapping
        qsl = meta.query_start_loc.long()
        q_lens = qsl[1:] - qsl[:-1]
        seq_lens = meta.seq_lens.long()
        q_lens_list = q_lens.tolist()
        decode = [i for i, n in enumerate(q_lens_list) if n == 1]
        prefill = [i for i, n in enumerate(q_lens_list) if n > 1]
        self.groups = [self._group(meta, qsl, q_lens, seq_lens, torch.tensor(idx, dtype=torch.long))
                       for idx in (decode, prefill) if idx]

    def _group(self, meta, qsl, q_lens, seq_lens, seqs: torch.Tensor) -> _Group:
        dev = qsl.device
        seqs = seqs.to(dev)
        g_qlens, g_seqlens = q_lens[seqs], seq_lens[seqs]
        max_q, max_kv = int(g_qlens.max()), int(g_seqlens.max())
        n = int(g_qlens.sum())
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs), device=dev), g_qlens, output_size=n)
        starts = torch.cumsum(g_qlens, 0) - g_qlens
        idx_in_seq = torch.arange(n, device=dev) - starts[seq_of_token]
        tokens = qsl[seqs][seq_of_token] + idx_in_seq
        nblk = -(-max_kv // self.block_size)
        offsets = torch.arange(self.block_size, device=dev)
        slots = (meta.block_tables[seqs, :nblk].long().unsqueeze(-1) * self.block_size + offsets).flatten(1)
        q_pos = (g_seqlens - g_qlens).unsqueeze(1) + torch.arange(max_q, device=dev)
        return _Group(tokens, seq_of_token * max_q + idx_in_seq, slots[:, :max_kv], q_pos,
                      torch.arange(max_kv, device=dev), len(seqs), max_q, {})

    @staticmethod
    def _mask(g: _Group, window: int | None) -> torch.Tensor:
        if window not in g.masks:
            mask = g.key_pos.view(1, 1, -1) <= g.q_pos.unsqueeze(-1)
            if window is not None:
                mask &= g.key_pos.view(1, 1, -1) > g.q_pos.unsqueeze(-1) - window
            g.masks[window] = mask.unsqueeze(1)  # (B, 1, max_q, max_kv)
        return g.masks[window]

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.layers[layer_idx]
        h, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_size
        write_kv(kv_cache, k, v, self.slot_mapping)
        _, nb, bs, _, _ = kv_cache.shape
        q = q.view(-1, h, d)
        out = torch.empty_like(q) if len(self.groups) > 1 else None
        for g in self.groups:
            qg = q.index_select(0, g.tokens) if out is not None else q
            if g.max_q > 1:
                qg = qg.new_zeros(g.num_seqs * g.max_q, h, d).index_copy_(0, g.pad_index, qg)
            qg = qg.view(g.num_seqs, g.max_q, h, d).transpose(1, 2).to(kv_cache.dtype)
            keys = kv_cache[0].view(nb * bs, hk, d)[g.kv_slots].transpose(1, 2)  # (B, Hk, max_kv, D)
            values = kv_cache[1].view(nb * bs, hk, d)[g.kv_slots].transpose(1, 2)
            mask = self._mask(g, layer.sliding_window)
            if g.max_q == 1:
                og = _decode(qg, keys, values, mask, layer.scale)
            else:
                og = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=layer.scale,
                                                    enable_gqa=hk != h)
            og = og.transpose(1, 2).reshape(g.num_seqs * g.max_q, h, d)
            if g.max_q > 1:
                og = og.index_select(0, g.pad_index)
            if out is None:
                return og.to(q.dtype).reshape(-1, h * d)
            out.index_copy_(0, g.tokens, og.to(q.dtype))
        return out.reshape(-1, h * d)


def _decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """One query per sequence: q (B, H, 1, D), keys/values (B, Hk, L, D), mask (B, 1, 1, L) -> (B, H, 1, D)."""
    b, h, _, d = q.shape
    hk, length = keys.shape[1], keys.shape[2]
    qg = q.reshape(b, hk, h // hk, d)  # the query heads sharing each KV head, side by side
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # (B, Hk, G, L)
    scores = scores.masked_fill(~mask.view(b, 1, 1, length), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).reshape(b, h, 1, d)
