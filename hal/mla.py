"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2): attention over a cache of one compressed latent per
token and layer instead of per-head keys and values.

Each token's cached row is c = [kv_latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]. The model folds the key
up-projection W_UK into the query ("weight absorption": q_latent = q_nope W_UK per head), so the score of head h
against token j is q_latent_h . kv_latent_j + q_rope_h . k_rope_j, a dot product with the whole row c_j; the value
is kv_latent_j, the first kv_lora_rank entries of the same row. The backend returns each head's latent output and
the model applies W_UV. So MLA is multi-query attention with one KV head of size L + R whose values are a prefix
of its keys, and its backends keep the attention-backend contract (plan per step, forward per layer, graph
hooks) with `k` the new latent rows and no `v`. The cache is one tensor (pages, page size, 1, L + R): FlashMLA's
and aiter's layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from resin.hal.attention import ATTENTION, AttentionLayer, NativeAttention
from resin.hal.registry import Op


@dataclass(frozen=True)
class MlaLayer(AttentionLayer):
    """num_kv_heads is 1 and head_size L + R (the cached row); latent_size is L. expanded_kv_size: what one
    token's K and V expanded to every head would hold (heads x (qk_nope + qk_rope + v)), for the capacity report."""
    latent_size: int = 0
    expanded_kv_size: int = 0

    @property
    def kv_tensors(self) -> int:
        return 1  # keys only: the values are the keys' first latent_size entries


def mla_layer(num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int, v_head_dim: int,
              scale: float) -> MlaLayer:
    return MlaLayer(num_heads, 1, kv_lora_rank + qk_rope_head_dim, scale, latent_size=kv_lora_rank,
                    expanded_kv_size=num_heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim))


def write_latents(kv_cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new latent rows (T, L + R) at their slots of a (pages, page size, 1, L + R) cache."""
    nb, bs, _, d = kv_cache.shape
    kv_cache.view(nb * bs, d).index_copy_(0, slot_mapping, rows.view(-1, d).to(kv_cache.dtype))


class NativeMla(NativeAttention):
    """Reference MLA over a mixed prefill-chunk + decode batch, absorbed everywhere: queries scattered into a
    padded (B, max_q) grid, each sequence's latent rows gathered through its block table, one masked softmax.

    Absorbed prefill costs (L + R) + L multiply-adds per query, key and head against the expanded form's
    (qk_nope + qk_rope) + v, but reads only latents and needs no per-chunk expansion of the cached context; one
    form for every row of a mixed batch keeps the reference simple. Kernels may choose otherwise per batch."""

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_size)

    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv_cache.index_copy_(0, dst, kv_cache.index_select(0, src))

    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        if not all(isinstance(layer, MlaLayer) for layer in layers):
            return "MLA backends serve latent-attention layers only"
        return None

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q (T, H * (L + R)) absorbed queries, k (T, L + R) new latent rows -> (T, H * L) latent outputs."""
        layer = self.layers[layer_idx]
        h, d, lat = layer.num_heads, layer.head_size, layer.latent_size
        write_latents(kv_cache, k, self.slot_mapping)
        b, mq, mkv = self.num_seqs, self.max_q, self.max_kv
        qpad = q.new_zeros(b * mq, h, d)
        qpad[self.token_index] = q.view(-1, h, d)
        qpad = qpad.view(b, mq, h, d).transpose(1, 2).float()  # (B, H, mq, D)
        nb, bs = kv_cache.shape[:2]
        rows = kv_cache.view(nb * bs, d)[self.kv_slots].float().unsqueeze(1)  # (B, 1, mkv, D)
        scores = torch.matmul(qpad, rows.transpose(-1, -2)) * layer.scale  # (B, H, mq, mkv)
        scores = scores.masked_fill(~self._mask(None).view(b, 1, mq, mkv), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), rows[..., :lat])  # (B, H, mq, L)
        out = out.transpose(1, 2).reshape(b * mq, h, lat)[self.token_index]
        return out.to(q.dtype).reshape(-1, h * lat)


MLA_ATTENTION = Op("mla_attention", NativeMla, native_graph_safe=False,  # plans on the host from real lengths
                   doc="Paged latent-attention backend factory: MLA_ATTENTION(layers, block_size, dtype, device) "
                       "-> backend; forward(layer, q (T, H*(L+R)), latent rows (T, L+R), None, cache) -> (T, H*L).")


def attention_op(layers: list[AttentionLayer]) -> Op:
    """The backend op that serves a model's attention layers: MLA_ATTENTION for latent layers, else ATTENTION."""
    latent = {isinstance(layer, MlaLayer) for layer in layers}
    if len(latent) > 1:
        raise ValueError("a model mixes latent (MLA) and per-head attention layers; Resin's cache holds one kind")
    return MLA_ATTENTION if latent == {True} else ATTENTION
