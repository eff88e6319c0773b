"""aiter's Triton `unified_attention`: one call for a mixed prefill + decode batch (gfx942 and gfx950), KV written
by `reshape_and_cache_flash` into the layout it reads: K and V planes of (num_blocks, block_size, kv_heads, D),
which is the HAL's default cache layout split on its first axis.

Signature targeted (keywords after v_descale, which moved in v0.1.16): unified_attention(q, k, v, out,
cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal=True, window_size, block_table,
softcap, q_descale, k_descale, v_descale, sinks=...). It writes `out` in place (v0.1.7 returns None).
Graph capture is not claimed: the launch reads max_seqlen_q / max_seqlen_k from the host, so a captured graph
would freeze them. Eager steps (prefill, mixed) use this provider; captured decode steps use the graph-safe Triton
kernel behind it in the chain, over the same cache layout.
"""
from __future__ import annotations

import torch

from resin.backends.rocm.aiter import first_module
from resin.hal.attention import AttentionBackend, AttentionLayer, AttentionMetadata


class AiterUnifiedAttention(AttentionBackend):
    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        if block_size not in (16, 32, 64):
            return f"block size {block_size}: aiter unified_attention tiles by 16, 32 or 64"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"{dtype}: aiter unified_attention runs fp16/bf16 caches"
        if any(layer.head_size < 32 for layer in layers):
            return "head size < 32 (aiter unified_attention's minimum)"
        return None

    def __init__(self, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layers, block_size, dtype, device)
        ops = first_module("aiter.ops.triton.unified_attention", "aiter.ops.triton.attention.unified_attention")
        self._attend = ops.unified_attention
        self._write = first_module("aiter").reshape_and_cache_flash
        self._unit_scale = torch.ones(1, dtype=torch.float32, device=device)  # read even for bf16 caches

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.slots = meta.slot_mapping.long()

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        layer, meta = self.layers[layer_idx], self.meta
        h, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_size
        t = q.shape[0]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self._write(k.reshape(t, hk, d), v.reshape(t, hk, d), k_cache, v_cache, self.slots, "auto",
                    self._unit_scale, self._unit_scale)
        out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
        window = (layer.sliding_window - 1, 0) if layer.sliding_window else (-1, -1)
        self._attend(q=q.reshape(t, h, d), k=k_cache, v=v_cache, out=out, cu_seqlens_q=meta.query_start_loc,
                     max_seqlen_q=meta.max_query_len, seqused_k=meta.seq_lens, max_seqlen_k=meta.max_seq_len,
                     softmax_scale=layer.scale, causal=True, window_size=window, block_table=meta.block_tables,
                     softcap=layer.logits_soft_cap or 0.0, q_descale=None, k_descale=self._unit_scale,
                     v_descale=self._unit_scale, sinks=sinks)
        return out.view(t, h * d)
