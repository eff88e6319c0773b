"""Llama-style decoders: LlamaForCausalLM, Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (q/k RMSNorm), and
their mixture-of-experts variants MixtralForCausalLM, Qwen3MoeForCausalLM and Qwen2MoeForCausalLM.

Pure architecture over HAL ops: GQA with an explicit head_dim, fused q/k/v and gate/up projections, tied or
untied embeddings, rope scaling as the config gives it, sparse MoE MLPs on the layers the config names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resin import hal
from resin.models.layers import (Embedding, GatedMLP, LMHead, QKVLinear, RMSNorm, Rotary, RowLinear, param,
                                 sliced_loader)
from resin.models.moe import MoeSpec, expert_checkpoint_name, make_moe


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    attention_sinks: bool = False  # a learned per-head logit in every softmax (GPT-OSS)
    sliding_windows: tuple[int | None, ...] = ()  # per layer; empty means full attention everywhere
    rot_dim: int | None = None  # rotary dims of a head (partial rotary); None: all of head_dim
    rope_neox: bool = True  # rotate the two halves of the rotary dims; False: interleaved pairs (GPT-J style)
    # mixture of experts: which layers have a sparse MoE MLP instead of the dense one (empty: none), and its router
    moe_layers: tuple[bool, ...] = ()
    moe: MoeSpec | None = None
    shared_experts_name: str = "shared_expert"  # the checkpoint's module name for the shared experts

    @classmethod
    def from_hf(cls, c: dict[str, Any], **family: Any) -> "DecoderConfig":
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
        heads = c["num_attention_heads"]
        windows: tuple[int | None, ...] = ()
        if c.get("layer_types") and c.get("sliding_window"):
            windows = tuple(c["sliding_window"] if t == "sliding_attention" else None for t in c["layer_types"])
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"], num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), rope_scaling=rope or None,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=c.get("tie_word_embeddings", False), hidden_act=c.get("hidden_act", "silu"),
            sliding_windows=windows, **family)

    def is_moe(self, layer_idx: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer_idx]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int, dtype: torch.dtype, rotary: Rotary):
        super().__init__()
        self.layer_idx = layer_idx
        self.d = cfg.head_dim
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, self.d, cfg.qkv_bias, dtype)
        self.h, self.hk = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's heads
        self.qkv_sizes = self.qkv_proj.sizes
        self.o_proj = RowLinear(cfg.num_heads * self.d, cfg.hidden_size, cfg.o_bias, dtype,
                                self.qkv_proj.o_part(self.d))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary  # one module (one cos/sin table) shared by every layer
        window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else None
        self.spec = hal.AttentionLayer(self.h, self.hk, self.d, scale=self.d ** -0.5, sliding_window=window,
                                       has_sinks=cfg.attention_sinks)
        self.sinks = None
        if cfg.attention_sinks:
            self.sinks = param(self.h, dtype=dtype)
            sliced_loader(self.sinks, 0, (self.qkv_proj.heads.q_start, self.h))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: hal.ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split_with_sizes(self.qkv_sizes, dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.h, self.d)).reshape(q.shape)
            k = self.k_norm(k.reshape(-1, self.hk, self.d)).reshape(k.shape)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(ctx.attention(self.layer_idx, q, k, v.contiguous(), self.sinks))


class DecoderLayer(nn.Module):
    attention: type[nn.Module] = Attention

    def __init__(self, cfg: DecoderConfig, layer_idx: int, dtype: torch.dtype, rotary: Rotary):
        super().__init__()
        self.self_attn = self.attention(cfg, layer_idx, dtype, rotary)
        self.mlp = self.make_mlp(cfg, layer_idx, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    @staticmethod
    def make_mlp(cfg: DecoderConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        if cfg.is_moe(layer_idx):
            return make_moe(cfg.hidden_size, cfg.moe, cfg.hidden_act, dtype, cfg.shared_experts_name)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias, dtype)

    def forward(self, x, residual, positions, ctx):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype, layer_cls: type[DecoderLayer] = DecoderLayer):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        # a table of max_position_embeddings x head_dim floats: built once, not per layer
        rotary = Rotary(cfg.head_dim, cfg.rot_dim or cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                        cfg.rope_scaling, cfg.rope_neox)
        self.layers = nn.ModuleList(layer_cls(cfg, i, dtype, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, ids, positions, ctx):
        x, residual = self.embed_tokens(ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, ctx)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    tensor_parallel = True  # every weight is split over tensor-parallel ranks (models/layers.py)
    # checkpoint projection name -> (Resin's fused module, shard)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
    # llama.cpp stores this family's q/k rows permuted for its rotary layout; the GGUF loader undoes it
    gguf_permutes_qk = True
    decoder_layer: type[DecoderLayer] = DecoderLayer

    @classmethod
    def parse_config(cls, c: dict[str, Any]) -> DecoderConfig:
        bias = c.get("attention_bias", False)
        return DecoderConfig.from_hf(c, qkv_bias=bias, o_bias=bias, mlp_bias=c.get("mlp_bias", False))

    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, dtype, self.decoder_layer)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(cfg.hidden_size, cfg.vocab_size, dtype)
        self.attention_layers = [layer.self_attn.spec for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: hal.ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens.project(hidden) if self.lm_head is None else self.lm_head(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    gguf_permutes_qk = False

    @classmethod
    def parse_config(cls, c: dict[str, Any]) -> DecoderConfig:
        return DecoderConfig.from_hf(c, qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    gguf_permutes_qk = False

    @classmethod
    def parse_config(cls, c: dict[str, Any]) -> DecoderConfig:
        bias = c.get("attention_bias", False)
        return DecoderConfig.from_hf(c, qkv_bias=bias, o_bias=bias, qk_norm=True)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 with sparse MoE MLPs on every decoder_sparse_step-th layer not in mlp_only_layers."""

    @classmethod
    def parse_config(cls, c: dict[str, Any]) -> DecoderConfig:
        cfg = super().parse_config(c)
        return qwen_moe_layers(cfg, c)

    def checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """Per-expert checkpoint tensors -> slices of the stacked expert weights (and the router, beside them
        when there are shared experts)."""
        return expert_checkpoint_name(name, shared=bool(self.config.moe.shared_intermediate_size))


def qwen_moe_layers(cfg: DecoderConfig, c: dict[str, Any]) -> DecoderConfig:
    """Qwen-MoE placement and router: experts on every decoder_sparse_step-th layer not in mlp_only_layers,
    softmax scoring; a shared expert behind a sigmoid gate where shared_expert_intermediate_size says so."""
    step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or ())
    experts = c.get("num_experts", c.get("num_local_experts", 0))  # transformers 5 writes the latter
    cfg.moe_layers = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(cfg.num_layers))
    shared = c.get("shared_expert_intermediate_size") or 0
    cfg.moe = MoeSpec(experts, c["num_experts_per_tok"], c["moe_intermediate_size"], c.get("norm_topk_prob", False),
                      shared_intermediate_size=shared, shared_gate=shared > 0)
    return cfg


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2 (q/k/v bias, no q/k norm) with sparse MoE MLPs and a gated shared expert."""

    @classmethod
    def parse_config(cls, c: dict[str, Any]) -> DecoderConfig:
        return qwen_moe_layers(DecoderConfig.from_hf(c, qkv_bias=True), c)


class MixtralForCausalLM(LlamaForCausalLM):
    """Llama with a sparse MoE MLP (block_sparse_moe: experts w1 gate, w3 up, w2 down) on every layer; routing
    weights always renormalised over the top k."""
    gguf_permutes_qk = True

    @classmethod
    def parse_config(cls, c: dict[str, Any]) -> DecoderConfig:
        cfg = DecoderConfig.from_hf(c)
        cfg.moe_layers = (True,) * cfg.num_layers
        cfg.moe = MoeSpec(c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"], True)
        if c.get("sliding_window") and not c.get("layer_types"):
            cfg.sliding_windows = (c["sliding_window"],) * cfg.num_layers
        return cfg

    def checkpoint_module_names(self, name: str) -> list[str]:
        """Resin's `mlp` is the checkpoint's `block_sparse_moe` (fp8 ignore lists use the latter)."""
        return [name, name.replace(".mlp.", ".block_sparse_moe.")] if ".mlp." in name else [name]

    def checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        if ".block_sparse_moe." not in name:
            return None
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return expert_checkpoint_name(name, shared=False, names=("w1", "w3", "w2")) or (name, None)
