"""flash-attn 2's `flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, softmax_scale=, causal=True, window_size=(left, 0), softcap=, block_table=)` as an attention
provider (flash-attn 2.5 … 2.8; `softcap=` exists only from 2.6.0, so it is passed only for soft-capped layers,
which older versions decline): one call for a mixed batch over the paged cache, NHD layout (the HAL default,
split on its first axis).

Upstream flash-attn 2 takes paged KV only in pages of a multiple of 256 tokens (128 on its ROCm build), so with
Resin's default 16-token blocks it declines and the Triton kernel serves; it applies to engines built with
block_size=256. No sinks. Not graph-safe (host max lengths).
UNTESTED ON HARDWARE: no NVIDIA GPU in this project so far.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import re

import torch

from resin.backends.cuda.flashinfer_attention import kv_writer
from resin.hal.attention import AttentionBackend, AttentionLayer, AttentionMetadata


def _version() -> tuple[int, ...]:
    """The installed flash-attn's (major, minor); (0,) where it cannot be read."""
    try:
        found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("flash-attn"))
    except importlib.metadata.PackageNotFoundError:
        return (0,)
    return tuple(int(g) for g in found.groups()) if found else (0,)


class FlashAttnAttention(AttentionBackend):
    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        if block_size % 256:
            return f"block size {block_size}: flash-attn 2's paged KV needs pages of a multiple of 256 tokens"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"{dtype}: flash-attn runs fp16/bf16"
        if any(layer.head_size > 256 or layer.head_size % 8 for layer in layers):
            return "flash-attn needs head sizes that are multiples of 8, at most 256"
        if any(layer.has_sinks for layer in layers):
            return "flash-attn 2 has no attention sinks"
        if any(layer.logits_soft_cap for layer in layers) and _version() < (2, 6):
            return f"logit soft-cap needs flash-attn >= 2.6 (installed: {'.'.join(map(str, _version()))})"
        return None

    def __init__(self, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layers, block_size, dtype, device)
        self._attend = importlib.import_module("flash_attn").flash_attn_varlen_func
        self._write_kv = kv_writer()
        self._softcap = [{"softcap": layer.logits_soft_cap} if layer.logits_soft_cap else {} for layer in layers]

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.cu_seqlens_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=meta.seq_lens.device)
        torch.cumsum(meta.seq_lens, 0, out=self.cu_seqlens_k[1:])

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        layer, meta = self.layers[layer_idx], self.meta
        self._write_kv(kv_cache, k, v, meta.slot_mapping)
        t = q.shape[0]
        out = self._attend(q.reshape(t, layer.num_heads, layer.head_size), kv_cache[0], kv_cache[1],
                           meta.query_start_loc, self.cu_seqlens_k, meta.max_query_len, meta.max_seq_len,
                           softmax_scale=layer.scale, causal=True,
                           window_size=(layer.sliding_window - 1, 0) if layer.sliding_window else (-1, -1),
                           block_table=meta.block_tables, **self._softcap[layer_idx])
        return out.reshape(t, layer.num_heads * layer.head_size)
