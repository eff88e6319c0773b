"""Qwen3-Next: Qwen3NextForCausalLM, a hybrid of Gated DeltaNet linear-attention layers and gated full-attention
layers (three to one), zero-centred RMSNorm (scale 1 + w), and sparse MoE MLPs with a gated shared expert.

Pure architecture over HAL ops. A linear-attention layer keeps a per-sequence recurrent state instead of KV: the
last conv_width - 1 inputs of its short causal convolution and the (value heads, key dim, value dim) delta-rule
state; the core gives each running sequence a slot of both (hal.RecurrentLayer declares their shapes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from resin import hal
from resin.hal.distributed import parallel, split_range
from resin.models.layers import (Embedding, GatedMLP, LMHead, MergedLinear, RMSNorm, Rotary, RowLinear,
                                 default_loader, head_shard, param, sliced_loader)
from resin.models.moe import MoeSpec, SharedExpertMoe, expert_checkpoint_name

_NORM_OFFSET = 1.0  # zero-centred RMSNorm: the checkpoint stores w of the scale 1 + w


@dataclass
class Qwen3NextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    linear_layers: tuple[bool, ...]  # per layer: Gated DeltaNet (True) or gated full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rot_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    attention_bias: bool
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_width: int
    moe_layers: tuple[bool, ...]
    moe: MoeSpec  # routed experts and a gated shared expert

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "Qwen3NextConfig":
        layers = c["num_hidden_layers"]
        interval = c.get("full_attention_interval", 4)
        types = c.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                         for i in range(layers)]
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        experts = c.get("num_experts", 0)
        step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or ())
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=layers, linear_layers=tuple(t == "linear_attention" for t in types),
            num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"], head_dim=head_dim,
            rot_dim=int(head_dim * partial), rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=c.get("tie_word_embeddings", False), hidden_act=c.get("hidden_act", "silu"),
            attention_bias=c.get("attention_bias", False),
            linear_k_heads=c["linear_num_key_heads"], linear_v_heads=c["linear_num_value_heads"],
            linear_k_dim=c["linear_key_head_dim"], linear_v_dim=c["linear_value_head_dim"],
            conv_width=c["linear_conv_kernel_dim"],
            moe_layers=tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)),
            moe=MoeSpec(experts, c.get("num_experts_per_tok", 0), c.get("moe_intermediate_size", 0),
                        c.get("norm_topk_prob", True),
                        shared_intermediate_size=c.get("shared_expert_intermediate_size", 0), shared_gate=True))


class GatedAttention(nn.Module):
    """Full attention whose output is scaled by sigmoid of a per-head gate that q_proj emits beside each query
    (2 x head_dim rows per query head: its query, then its gate)."""

    def __init__(self, cfg: Qwen3NextConfig, attn_idx: int, dtype: torch.dtype, rotary: Rotary):
        super().__init__()
        self.attn_idx = attn_idx
        heads, d = head_shard(cfg.num_heads, cfg.num_kv_heads), cfg.head_dim
        self.h, self.hk, self.d = heads.q_count, heads.kv_count, d  # this rank's heads
        kv = (heads.kv_start * d, heads.kv_count * d)
        self.qkv_proj = MergedLinear(cfg.hidden_size, [2 * cfg.num_heads * d, cfg.num_kv_heads * d,
                                                       cfg.num_kv_heads * d], ["q", "k", "v"],
                                     bias=cfg.attention_bias, dtype=dtype,
                                     parts=[(2 * heads.q_start * d, 2 * heads.q_count * d), kv, kv])
        self.o_proj = RowLinear(cfg.num_heads * d, cfg.hidden_size, cfg.attention_bias, dtype,
                                (heads.q_start * d, heads.q_count * d))
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype, weight_offset=_NORM_OFFSET)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype, weight_offset=_NORM_OFFSET)
        self.rotary = rotary  # one table, shared by every attention layer
        self.spec = hal.AttentionLayer(self.h, self.hk, self.d, scale=self.d ** -0.5)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: hal.ForwardContext) -> torch.Tensor:
        qg, k, v = self.qkv_proj(x).split([2 * self.h * self.d, self.hk * self.d, self.hk * self.d], dim=-1)
        q, gate = qg.reshape(-1, self.h, 2 * self.d).chunk(2, dim=-1)  # per head: d query dims, then d gate dims
        q = self.q_norm(q.contiguous()).reshape(-1, self.h * self.d)
        k = self.k_norm(k.reshape(-1, self.hk, self.d)).reshape(-1, self.hk * self.d)
        q, k = self.rotary(positions, q, k)
        out = ctx.attention(self.attn_idx, q, k, v.contiguous())
        return self.o_proj(out * torch.sigmoid(gate.reshape(out.shape)))


class CausalConv1d(nn.Module):
    """Depthwise causal conv with silu, continuing each sequence from its conv state (the checkpoint's Conv1d
    weight is (channels, 1, width); Resin keeps (channels, width))."""

    def __init__(self, channels: int, width: int, dtype: torch.dtype, parts: list[tuple[int, int]]):
        """parts: the checkpoint channels this rank holds, (start, size) ranges in order."""
        super().__init__()
        self.weight = param(channels, width, dtype=dtype)
        self.weight.weight_loader = lambda p, w, shard=None: default_loader(
            p, torch.cat([w.narrow(0, *part) for part in parts]).squeeze(1))

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, meta: hal.RecurrentMetadata) -> torch.Tensor:
        if meta.decode_only:  # one token per sequence: the update op, which graphs can capture
            return hal.CAUSAL_CONV1D_UPDATE(x, self.weight, None, conv_state, meta.state_indices)
        return hal.CAUSAL_CONV1D(x, self.weight, None, conv_state, meta.query_start_loc, meta.state_indices,
                                 meta.has_initial_state)


class GatedDeltaNet(nn.Module):
    """Linear attention: a short causal conv over q|k|v, then the gated delta rule over a per-sequence state, then
    an RMSNorm gated by silu(z). Projections come grouped per key head (q, k, then the value and z heads it
    serves), as the checkpoint stores them."""

    def __init__(self, cfg: Qwen3NextConfig, state_idx: int, dtype: torch.dtype):
        super().__init__()
        self.state_idx = state_idx
        hk, hv, dk, dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
        self.ratio = hv // hk
        g = parallel()
        if hk < g.world:
            raise ValueError(f"tensor_parallel_size={g.world} exceeds the {hk} key heads of the linear-attention "
                             f"layers, which are split and not replicated: choose at most {hk}")
        k0, self.hk = split_range(hk, g.world, g.rank)  # this rank's key heads and the value heads they serve
        v0, self.hv, self.dk, self.dv = k0 * self.ratio, self.hk * self.ratio, dk, dv
        self.conv_dim = 2 * self.hk * dk + self.hv * dv
        group = 2 * dk + 2 * self.ratio * dv  # in_proj_qkvz rows of one key head: q, k, its values, its z
        self.in_proj_qkvz = MergedLinear(cfg.hidden_size, [hk * group], [None], dtype=dtype,
                                         parts=[(k0 * group, self.hk * group)])
        self.in_proj_ba = MergedLinear(cfg.hidden_size, [2 * hv], [None], dtype=dtype,
                                       parts=[(2 * v0, 2 * self.hv)])
        # conv channels: q of every key head, k of every key head, then every value head's v
        self.conv1d = CausalConv1d(self.conv_dim, cfg.conv_width, dtype,
                                   [(k0 * dk, self.hk * dk), (hk * dk + k0 * dk, self.hk * dk),
                                    (2 * hk * dk + v0 * dv, self.hv * dv)])
        self.dt_bias = param(self.hv, dtype=dtype)
        self.A_log = param(self.hv, dtype=dtype)
        sliced_loader(self.dt_bias, 0, (v0, self.hv))
        sliced_loader(self.A_log, 0, (v0, self.hv))
        self.norm = RMSNorm(self.dv, cfg.rms_norm_eps, dtype)
        self.out_proj = RowLinear(hv * dv, cfg.hidden_size, dtype=dtype, part=(v0 * dv, self.hv * dv))
        # the delta-rule state is kept in fp32: it accumulates over the whole sequence
        self.spec = hal.RecurrentLayer(((self.conv_dim, cfg.conv_width - 1), (self.hv, self.dk, self.dv)),
                                       (None, torch.float32))

    def forward(self, x: torch.Tensor, ctx: hal.ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, 2 * self.dk + 2 * self.ratio * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, self.ratio * self.dv, self.ratio * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.hk, 2 * self.ratio).split([self.ratio, self.ratio], dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        conv_state, state = ctx.states[self.state_idx]
        meta = ctx.recurrent
        mixed = self.conv1d(mixed, conv_state, meta)
        q, k, v = mixed.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        beta = torch.sigmoid(b.reshape(t, self.hv))
        g = -self.A_log.float().exp() * F.softplus(a.reshape(t, self.hv).float() + self.dt_bias)
        out = hal.GATED_DELTA_RULE(q.reshape(t, self.hk, self.dk), k.reshape(t, self.hk, self.dk),
                                   v.reshape(t, self.hv, self.dv), g, beta, state, meta.query_start_loc,
                                   meta.state_indices, meta.has_initial_state)
        normed = self.norm(out.reshape(t * self.hv, self.dv)).float()
        out = (normed * F.silu(z.reshape(t * self.hv, self.dv).float())).to(out.dtype)
        return self.out_proj(out.reshape(t, self.hv * self.dv))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig, layer_idx: int, mixer_idx: int, dtype: torch.dtype, rotary: Rotary):
        super().__init__()
        self.is_linear = cfg.linear_layers[layer_idx]
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, mixer_idx, dtype)
        else:
            self.self_attn = GatedAttention(cfg, mixer_idx, dtype, rotary)
        if cfg.moe_layers[layer_idx]:
            self.mlp = SharedExpertMoe(cfg.hidden_size, cfg.moe, cfg.hidden_act, dtype)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, weight_offset=_NORM_OFFSET)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, weight_offset=_NORM_OFFSET)

    def forward(self, x, residual, positions, ctx):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x, ctx) if self.is_linear else self.self_attn(x, positions, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3NextModel(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        seen = {True: 0, False: 0}  # attention layers and recurrent layers are numbered apart
        rotary = Rotary(cfg.head_dim, cfg.rot_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        layers = []
        for i in range(cfg.num_layers):
            kind = cfg.linear_layers[i]
            layers.append(Qwen3NextDecoderLayer(cfg, i, seen[kind], dtype, rotary))
            seen[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, weight_offset=_NORM_OFFSET)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx: hal.ForwardContext) -> torch.Tensor:
        x, residual = self.embed_tokens(ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, ctx)
        return self.norm(x, residual)[0]


class Qwen3NextForCausalLM(nn.Module):
    tensor_parallel = True  # every weight is split over tensor-parallel ranks (models/layers.py)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    @classmethod
    def parse_config(cls, c: dict[str, Any]) -> Qwen3NextConfig:
        return Qwen3NextConfig.from_hf(c)

    def __init__(self, cfg: Qwen3NextConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.model = Qwen3NextModel(cfg, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(cfg.hidden_size, cfg.vocab_size, dtype)
        layers = self.model.layers
        self.attention_layers = [layer.self_attn.spec for layer in layers if not layer.is_linear]
        self.recurrent_layers = [layer.linear_attn.spec for layer in layers if layer.is_linear]

    def checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """The router lives beside the stacked experts in Resin (SparseMoe), per-expert tensors stack into it."""
        return expert_checkpoint_name(name, shared=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: hal.ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens.project(hidden) if self.lm_head is None else self.lm_head(hidden)
