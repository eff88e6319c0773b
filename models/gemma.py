"""Gemma 2 and Gemma 3 (text): Gemma2ForCausalLM, Gemma3ForCausalLM.

Pure architecture over HAL ops. What sets the family apart from Llama: embeddings scaled by sqrt(hidden), RMSNorm
weights stored as an offset from 1 (folded into the weight on load), "sandwich" norms around both the attention
and the MLP, gelu-tanh gating, a query scale from `query_pre_attn_scalar`, sliding-window layers interleaved with
global ones (Gemma 2: every other layer; Gemma 3: five of six), logit soft-caps on attention scores and final
logits (Gemma 2), and q/k RMSNorm plus a separate rope base for the local layers (Gemma 3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resin import hal
from resin.models.layers import Embedding, GatedMLP, LMHead, QKVLinear, RMSNorm, Rotary, RowLinear

# Gemma stores each RMSNorm weight as w with scale (1 + w); Resin loads 1 + w once so the norm is the plain op.
# (In bf16 that rounds 1 + w to bf16, where Hugging Face multiplies by it in fp32: a last-bit difference.)
_NORM_OFFSET = 1.0


@dataclass
class GemmaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    hidden_act: str
    attention_bias: bool
    query_scale: float  # query_pre_attn_scalar ** -0.5
    sliding_windows: tuple[int | None, ...]  # per layer
    rope: tuple[tuple[float, dict[str, Any] | None], ...]  # per layer: (theta, scaling)
    tie_word_embeddings: bool = True
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    qk_norm: bool = False

    @classmethod
    def from_hf(cls, c: dict[str, Any], qk_norm: bool) -> "GemmaConfig":
        layers = c["num_hidden_layers"]
        types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                         for i in range(layers)]
        window = c.get("sliding_window")
        params = c.get("rope_parameters") or {}

        def rope_of(kind: str) -> tuple[float, dict[str, Any] | None]:
            p = dict(params.get(kind, params) or {})  # Gemma 3: one entry per layer type; Gemma 2: one for all
            theta = float(p.get("rope_theta", c.get("rope_theta", 10000.0)))
            return theta, (p if p.get("rope_type", "default") != "default" else None)

        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=layers, num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=head_dim, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            max_position_embeddings=c.get("max_position_embeddings", 8192),
            hidden_act=c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh",
            attention_bias=c.get("attention_bias", False),
            query_scale=float(c.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            sliding_windows=tuple(window if t == "sliding_attention" else None for t in types),
            rope=tuple(rope_of(t) for t in types), tie_word_embeddings=c.get("tie_word_embeddings", True),
            attn_soft_cap=c.get("attn_logit_softcapping"), final_soft_cap=c.get("final_logit_softcapping"),
            qk_norm=qk_norm)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: GemmaConfig, layer_idx: int, dtype: torch.dtype, rotary: Rotary):
        super().__init__()
        self.layer_idx = layer_idx
        self.d = cfg.head_dim
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, self.d, cfg.attention_bias, dtype)
        self.h, self.hk = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's heads
        self.o_proj = RowLinear(cfg.num_heads * self.d, cfg.hidden_size, cfg.attention_bias, dtype,
                                self.qkv_proj.o_part(self.d))
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype, weight_offset=_NORM_OFFSET)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype, weight_offset=_NORM_OFFSET)
        self.rotary = rotary  # shared by the layers of its kind
        self.spec = hal.AttentionLayer(self.h, self.hk, self.d, scale=cfg.query_scale,
                                       sliding_window=cfg.sliding_windows[layer_idx],
                                       logits_soft_cap=cfg.attn_soft_cap)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: hal.ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.h, self.d)).reshape(q.shape)
            k = self.k_norm(k.reshape(-1, self.hk, self.d)).reshape(k.shape)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(ctx.attention(self.layer_idx, q, k, v.contiguous()))


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norms around both blocks; the post-norms' outputs join the residual stream."""

    def __init__(self, cfg: GemmaConfig, layer_idx: int, dtype: torch.dtype, rotary: Rotary):
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer_idx, dtype, rotary)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype=dtype)
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, weight_offset=_NORM_OFFSET)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                ctx: hal.ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, ctx))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, cfg: GemmaConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        # the scale is rounded to the weights' dtype before multiplying, as Hugging Face does
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype, device="cpu").item()
        ropes: dict[str, Rotary] = {}  # one table per distinct rope (local and global layers differ in Gemma 3)
        for theta, scaling in cfg.rope:
            key = repr((theta, scaling))
            if key not in ropes:
                ropes[key] = Rotary(cfg.head_dim, cfg.head_dim, cfg.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, dtype, ropes[repr(cfg.rope[i])])
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, weight_offset=_NORM_OFFSET)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx: hal.ForwardContext) -> torch.Tensor:
        x, residual = self.embed_tokens(ids) * self.embed_scale, None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, ctx)
        return self.norm(x, residual)[0]


class Gemma2ForCausalLM(nn.Module):
    tensor_parallel = True  # every weight is split over tensor-parallel ranks (models/layers.py)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
    qk_norm = False

    @classmethod
    def parse_config(cls, c: dict[str, Any]) -> GemmaConfig:
        return GemmaConfig.from_hf(c, qk_norm=cls.qk_norm)

    def __init__(self, cfg: GemmaConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.model = GemmaModel(cfg, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(cfg.hidden_size, cfg.vocab_size, dtype)
        self.attention_layers = [layer.self_attn.spec for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: hal.ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.embed_tokens.project(hidden) if self.lm_head is None else self.lm_head(hidden)
        cap = self.config.final_soft_cap
        return logits if not cap else cap * torch.tanh(logits / cap)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
