"""DeepSeek-V2 / V3 (and Kimi-K2, which is V3-shaped): multi-head latent attention over a latent cache, then
DeepSeek MoE (dense MLPs on the first layers, routed experts with shared experts after them).

Attention per token: a low-rank query (q_a_proj -> RMSNorm -> q_b_proj; V2-Lite projects directly with q_proj)
split into a non-rotary part and a rotary part per head; one shared compressed row kv_a_proj_with_mqa(x) =
[latent (kv_lora_rank) | k_rope (qk_rope_head_dim)], the latent RMS-normed. kv_b_proj would expand the latent into
each head's k_nope and v; the attention backend applies it (hal/mla.py): absorbed, W_UK into the query so attention
runs over the cached rows [latent | k_rope] themselves and W_UV into the latent output, or expanding a prefill's
context where that is cheaper. The cache holds kv_lora_rank + qk_rope_head_dim values per token and layer
instead of heads x (k + v).

Rotary: V2 rotates interleaved pairs (its complex form); V3 too under `rope_interleave` (the default), else the two
halves; q.k is the same either way as long as q and k agree. YaRN scales the softmax by mscale_all_dim as well.
The multi-token-prediction layer V3 checkpoints carry past num_hidden_layers is ignored (said at load).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resin import hal
from resin.hal.distributed import rank_range
from resin.hal.rotary import yarn_softmax_scale
from resin.models.glm4_moe import mtp_layer_tensor
from resin.models.layers import DenseWeight, MergedLinear, RMSNorm, Rotary, RowLinear
from resin.models.llama import DecoderConfig, DecoderLayer, LlamaForCausalLM
from resin.models.moe import deepseek_moe, expert_checkpoint_name

# The bottleneck norms (q_a_layernorm, kv_a_layernorm) use a fixed epsilon, not rms_norm_eps: so DeepSeek's own
# modelling code and transformers build them
LATENT_NORM_EPS = 1e-6


@dataclass
class MlaConfig(DecoderConfig):
    q_lora_rank: int | None = None  # None: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_scale: float = 1.0


class MlaAttention(nn.Module):
    """Under tensor parallelism each rank computes its own heads (q_b_proj, kv_b_proj rows, o_proj columns); the
    latent projection and the latent cache are the same on every rank."""

    def __init__(self, cfg: MlaConfig, layer_idx: int, dtype: torch.dtype, rotary: Rotary):
        super().__init__()
        self.layer_idx = layer_idx
        self.nope, self.rope, self.lat, self.vd = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                                                   cfg.v_head_dim)
        qk, h = self.nope + self.rope, cfg.num_heads
        start, self.h = rank_range(h)
        self.q_lora = cfg.q_lora_rank
        q_rows = (start * qk, self.h * qk)  # this rank's heads
        sizes = ([self.q_lora] if self.q_lora else []) + [self.lat + self.rope]
        shards = (["q_a"] if self.q_lora else []) + ["kv_a"]
        # q_a_proj and kv_a_proj_with_mqa read the same input: one GEMM, whole on every rank
        self.qkv_a_proj = MergedLinear(cfg.hidden_size, sizes, shards, cfg.qkv_bias, dtype,
                                       parts=[(0, n) for n in sizes])
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(self.q_lora, LATENT_NORM_EPS, dtype)
            self.q_b_proj = MergedLinear(self.q_lora, [h * qk], [None], False, dtype, parts=[q_rows])
        else:
            self.q_proj = MergedLinear(cfg.hidden_size, [h * qk], [None], False, dtype, parts=[q_rows])
        self.kv_a_layernorm = RMSNorm(self.lat, LATENT_NORM_EPS, dtype)
        # kv_b_proj: latent -> each head's [k_nope | v] rows. Never a GEMM over the latents here: its halves are
        # absorbed into the query (W_UK) and the output (W_UV), so it is a plain weight, not a Linear (and a
        # block-fp8 checkpoint's copy is dequantised on load)
        self.kv_b_proj = DenseWeight(self.lat, (start * (self.nope + self.vd), self.h * (self.nope + self.vd)), dtype)
        self.o_proj = RowLinear(h * self.vd, cfg.hidden_size, cfg.o_bias, dtype, (start * self.vd, self.h * self.vd))
        self.rotary = rotary
        self.spec = hal.mla_layer(self.h, self.lat, self.rope, self.nope, self.vd, cfg.attention_scale)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: hal.ForwardContext) -> torch.Tensor:
        t, h = x.shape[0], self.h
        a = self.qkv_a_proj(x)
        if self.q_lora:
            q_a, kv_a = a.split([self.q_lora, self.lat + self.rope], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a.contiguous()))
        else:
            q, kv_a = self.q_proj(x), a
        q_nope, q_rope = q.view(t, h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rope = kv_a.split([self.lat, self.rope], dim=-1)
        q_rope, k_rope = self.rotary(positions, q_rope.reshape(t, h * self.rope), k_rope.contiguous())
        q = torch.cat((q_nope, q_rope.view(t, h, self.rope)), dim=-1).reshape(t, -1)
        rows = torch.cat((self.kv_a_layernorm(latent.contiguous()), k_rope), dim=-1)  # what the cache keeps
        # the backend applies kv_b_proj (absorbed into queries and outputs, or expanding a prefill's context)
        w = self.kv_b_proj.weight.view(h, self.nope + self.vd, self.lat)
        return self.o_proj(ctx.attention(self.layer_idx, q, rows, w))  # attention gives (T, H * v_head_dim)


class MlaDecoderLayer(DecoderLayer):
    attention = MlaAttention


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """Softmax routing (greedy, or group-limited greedy over n_group groups), interleaved rotary."""
    decoder_layer = MlaDecoderLayer
    gguf_permutes_qk = False
    noaux_routing = False  # V3: sigmoid scores, correction bias, grouped top-k
    packed_modules = {"q_a_proj": ("qkv_a_proj", "q_a"), "kv_a_proj_with_mqa": ("qkv_a_proj", "kv_a"),
                      "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    @classmethod
    def rope_neox(cls, c: dict[str, Any]) -> bool:
        return False

    @classmethod
    def parse_config(cls, c: dict[str, Any]) -> MlaConfig:
        rope, nope = c["qk_rope_head_dim"], c["qk_nope_head_dim"]
        bias = bool(c.get("attention_bias", False))
        # rotary tables over the rope dims; every head reads the one latent row (num_kv_heads is not used)
        cfg = MlaConfig.from_hf({**c, "head_dim": rope, "num_key_value_heads": c["num_attention_heads"]},
                                qkv_bias=bias, o_bias=bias, rope_neox=cls.rope_neox(c),
                                shared_experts_name="shared_experts", q_lora_rank=c.get("q_lora_rank") or None,
                                kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                                v_head_dim=c["v_head_dim"])
        cfg.attention_scale = (nope + rope) ** -0.5 * yarn_softmax_scale(cfg.rope_scaling,
                                                                         cfg.max_position_embeddings)
        cfg.moe_layers, cfg.moe = deepseek_moe(c, cfg.num_layers, noaux=cls.noaux_routing)
        return cfg

    def checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        return expert_checkpoint_name(name, shared=bool(self.config.moe and self.config.moe.shared_intermediate_size))

    def ignored_checkpoint_tensor(self, name: str) -> str | None:
        return mtp_layer_tensor(name, self.config.num_layers)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """Sigmoid routing with a correction bias over grouped experts, scaled; rotary interleaved by default."""
    noaux_routing = True

    @classmethod
    def rope_neox(cls, c: dict[str, Any]) -> bool:
        return not c.get("rope_interleave", True)
