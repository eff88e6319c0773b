"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2): attention over a cache of one compressed latent per
token and layer instead of per-head keys and values.

Each token's cached row is c = [kv_latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]. The model folds the key
up-projection W_UK into the query ("weight absorption": q_latent = q_nope W_UK per head), so the score of head h
against token j is q_latent_h . kv_latent_j + q_rope_h . k_rope_j, a dot product with the whole row c_j; the value
is kv_latent_j, the first kv_lora_rank entries of the same row, and W_UV turns each head's latent output into its
value. So MLA is multi-query attention with one KV head of size L + R whose values are a prefix of its keys, and
its backends keep the attention-backend contract (plan per step, forward per layer, graph hooks): forward takes
the queries after rotary (T, H * (qk_nope + qk_rope)), `k` the new latent rows and, in place of values, the
layer's up-projection kv_b_proj (H, qk_nope + v, L), and returns each head's value (T, H * v). Owning the
up-projection lets a backend choose the form per sequence: absorbed (latent_forward, what every kernel computes)
or, for a prefill, expanded (kv_b_proj applied to the context's latents, then ordinary attention with per-head
keys and values; `expanded_prefill_pays` says when). The cache is one tensor (pages, page size, 1, L + R):
FlashMLA's and aiter's layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from resin.hal.attention import ATTENTION, AttentionLayer, NativeAttention
from resin.hal.registry import Op


@dataclass(frozen=True)
class MlaLayer(AttentionLayer):
    """num_kv_heads is 1 and head_size L + R (the cached row); latent_size is L; nope_size and value_size are each
    head's non-rotary key and value widths (what kv_b_proj expands a latent into)."""
    latent_size: int = 0
    nope_size: int = 0
    value_size: int = 0

    @property
    def rope_size(self) -> int:
        return self.head_size - self.latent_size

    def random_inputs(self, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries after rotary, new latent rows, and an up-projection scaled so each head's values stay near 1."""
        q = torch.randn(tokens, self.num_heads * (self.nope_size + self.rope_size), generator=gen)
        rows = torch.randn(tokens, self.head_size, generator=gen)
        kv_b = torch.randn(self.num_heads, self.nope_size + self.value_size, self.latent_size, generator=gen)
        return q, rows, kv_b / self.latent_size ** 0.5

    @property
    def expanded_kv_size(self) -> int:
        """What one token's K and V expanded to every head would hold, for the capacity report."""
        return self.num_heads * (self.nope_size + self.rope_size + self.value_size)

    @property
    def kv_tensors(self) -> int:
        return 1  # keys only: the values are the keys' first latent_size entries


def mla_layer(num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int, v_head_dim: int,
              scale: float) -> MlaLayer:
    return MlaLayer(num_heads, 1, kv_lora_rank + qk_rope_head_dim, scale, latent_size=kv_lora_rank,
                    nope_size=qk_nope_head_dim, value_size=v_head_dim)


def absorb_queries(q: torch.Tensor, kv_b: torch.Tensor, layer: MlaLayer) -> torch.Tensor:
    """q (T, H * (nope + R)) -> (T, H, L + R): each head's q_nope through its W_UK, beside its q_rope."""
    t, h = q.shape[0], layer.num_heads
    q_nope, q_rope = q.view(t, h, -1).split([layer.nope_size, layer.rope_size], dim=-1)
    q_latent = torch.bmm(q_nope.transpose(0, 1), kv_b[:, :layer.nope_size])  # (H, T, L)
    return torch.cat((q_latent.transpose(0, 1), q_rope), dim=-1)


def latent_values(out: torch.Tensor, kv_b: torch.Tensor, layer: MlaLayer) -> torch.Tensor:
    """Latent outputs (T, H * L) through each head's W_UV -> values (T, H * v)."""
    t, h = out.shape[0], layer.num_heads
    values = torch.bmm(out.view(t, h, layer.latent_size).transpose(0, 1), kv_b[:, layer.nope_size:].transpose(1, 2))
    return values.transpose(0, 1).reshape(t, h * layer.value_size)


def expand_rows(rows: torch.Tensor, kv_b: torch.Tensor, layer: MlaLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached rows (S, L + R) -> every head's keys (S, H, nope + R) and values (S, H, v): kv_b_proj applied to
    the latents, the one k_rope shared by the heads."""
    s, h = rows.shape[0], layer.num_heads
    latent, k_rope = rows.split([layer.latent_size, layer.rope_size], dim=-1)
    kv = (latent @ kv_b.reshape(-1, layer.latent_size).t()).view(s, h, -1)
    k_nope, values = kv.split([layer.nope_size, layer.value_size], dim=-1)
    return torch.cat((k_nope, k_rope.unsqueeze(1).expand(s, h, layer.rope_size)), dim=-1), values


def expanded_prefill_pays(q_len: int, seq_len: int, layer: MlaLayer) -> bool:
    """Whether a sequence's q_len new queries over seq_len keys cost fewer multiply-adds expanded than absorbed.

    Per head: absorbed pays q_len * L * (nope + v) to take the queries in and the outputs out of latent space, and
    (L + R) + L per (query, key) pair; expanded pays seq_len * L * (nope + v) to expand every key's latent and
    (nope + R) + v per pair. With P pairs (the causal chunk over its context), expanded wins when
    (seq_len - q_len) * L * (nope + v) < P * (2L - nope - v): for every fresh prompt where 2L > nope + v (as in
    every MLA model), never for a decode over a context (P = seq_len); for DeepSeek-V3 (L 512, nope 128, v 128) a
    chunk after cached context once it has more than ~170 queries. Memory is the provider's to weigh: the
    expanded form holds every head's K and V of the whole context for the chunk."""
    lat, nv = layer.latent_size, layer.nope_size + layer.value_size
    ctx = seq_len - q_len
    pairs = q_len * ctx + q_len * (q_len + 1) // 2
    return ctx * lat * nv < pairs * (2 * lat - nv)


def write_latents(kv_cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new latent rows (T, L + R) at their slots of a (pages, page size, 1, L + R) cache."""
    nb, bs, _, d = kv_cache.shape
    kv_cache.view(nb * bs, d).index_copy_(0, slot_mapping, rows.view(-1, d).to(kv_cache.dtype))


class NativeMla(NativeAttention):
    """Reference MLA over a mixed prefill-chunk + decode batch, absorbed everywhere: queries scattered into a
    padded (B, max_q) grid, each sequence's latent rows gathered through its block table, one masked softmax.

    One form for every row keeps the reference simple (and is what a decode needs); the cpu provider expands
    prefills where that is cheaper (expanded_prefill_pays), and its parity test holds both forms to this one.
    Subclasses that compute the absorbed form only override latent_forward."""

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

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q (T, H * (nope + R)) queries after rotary, k (T, L + R) new latent rows, v the layer's kv_b_proj
        weight (H, nope + v, L) -> (T, H * v) values."""
        layer = self.layers[layer_idx]
        return latent_values(self.latent_forward(layer_idx, absorb_queries(q, v, layer), k, kv_cache), v, layer)

    def latent_forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                       kv_cache: torch.Tensor) -> torch.Tensor:
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
                       "-> backend; forward(layer, q (T, H*(nope+R)), latent rows (T, L+R), kv_b_proj (H, nope+v, L), "
                       "cache) -> values (T, H*v).")


def attention_op(layers: list[AttentionLayer]) -> Op:
    """The backend op that serves a model's attention layers: MLA_ATTENTION for latent layers, else ATTENTION."""
    latent = {isinstance(layer, MlaLayer) for layer in layers}
    if len(latent) > 1:
        raise ValueError("a model mixes latent (MLA) and per-head attention layers; Resin's cache holds one kind")
    return MLA_ATTENTION if latent == {True} else ATTENTION
