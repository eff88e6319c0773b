"""The model shapes whose Triton launches the cross-compile gate checks: the test models, the built-in model, and
real configurations of every family in `resin models` (their attention, norm, MLP and MoE dimensions as published),
plus the attention features the families to come need (soft-cap, sinks, windows, head size 256).

Only two things are cut from the real configurations, because no kernel specialises on them: the layer count (two
layers launch what every layer launches, and let the gate count launches per layer) and the vocabulary (embedding
and lm_head are torch ops).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from resin.hal.attention import AttentionLayer

GPU_DTYPES = (torch.bfloat16, torch.float16)
BF16_ONLY = (torch.bfloat16,)


@dataclass(frozen=True)
class ModelShape:
    name: str
    arch: str  # a MODEL_REGISTRY architecture
    config: dict[str, Any]  # Hugging Face config fields on top of the tiny defaults (resin.tiny)
    layers: int  # the real model's depth (launch counts per decode step are scaled to it)
    dtypes: tuple[torch.dtype, ...] = GPU_DTYPES
    fp8: bool = False  # also run it as a w8a8 fp8 checkpoint (per-channel weights, dynamic per-token inputs)
    block_fp8: bool = False  # also run it as a block-scale fp8 checkpoint (128x128 weight blocks, DeepSeek's format)


def _dense(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, **extra: Any) -> dict[str, Any]:
    return dict(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, max_position_embeddings=8192, **extra)


MODEL_SHAPES: tuple[ModelShape, ...] = (
    # the test suite's tiny models (tests/gpu runs parity in fp32 too)
    ModelShape("tiny-llama", "LlamaForCausalLM", {}, 2, dtypes=(torch.float32, *GPU_DTYPES)),
    ModelShape("tiny-qwen3-moe", "Qwen3MoeForCausalLM", {}, 2, dtypes=(torch.float32, *GPU_DTYPES)),
    ModelShape("tiny-mixtral", "MixtralForCausalLM", {}, 2, dtypes=(torch.float32, *GPU_DTYPES)),
    ModelShape("SmolLM2-135M (built-in)", "LlamaForCausalLM",
               _dense(576, 1536, 9, 3, 64, tie_word_embeddings=True), 30),
    ModelShape("Llama-3.1-8B", "LlamaForCausalLM", _dense(4096, 14336, 32, 8, 128), 32, fp8=True),
    ModelShape("Llama-3.1-70B", "LlamaForCausalLM", _dense(8192, 28672, 64, 8, 128), 80, fp8=True),
    ModelShape("Qwen2.5-7B", "Qwen2ForCausalLM", _dense(3584, 18944, 28, 4, 128), 28),
    ModelShape("Qwen3-8B", "Qwen3ForCausalLM", _dense(4096, 12288, 32, 8, 128), 36, fp8=True, block_fp8=True),
    ModelShape("Qwen3-30B-A3B", "Qwen3MoeForCausalLM",
               _dense(2048, 6144, 32, 4, 128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                      mlp_only_layers=[], decoder_sparse_step=1), 48, fp8=True, block_fp8=True),
    ModelShape("Qwen3-235B-A22B", "Qwen3MoeForCausalLM",
               _dense(4096, 12288, 64, 4, 128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                      mlp_only_layers=[], decoder_sparse_step=1), 94),
    ModelShape("Mixtral-8x7B", "MixtralForCausalLM",
               _dense(4096, 14336, 32, 8, 128, num_local_experts=8, num_experts_per_tok=2), 32),
    # one sliding and one full layer each: both kinds of layer launch (bf16 only: their fp16 specialisations differ
    # from these in the dtype alone, which the shapes above already compile)
    ModelShape("gemma-2-9b", "Gemma2ForCausalLM",
               _dense(3584, 14336, 16, 8, 256, sliding_window=4096, query_pre_attn_scalar=256,
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0), 42, dtypes=BF16_ONLY),
    ModelShape("gemma-3-27b", "Gemma3ForCausalLM",
               _dense(5376, 21504, 32, 16, 128, sliding_window=1024, query_pre_attn_scalar=168,
                      layer_types=["sliding_attention", "full_attention"], rope_parameters=None), 62,
               dtypes=BF16_ONLY),
    ModelShape("gpt-oss-20b", "GptOssForCausalLM",
               _dense(2880, 2880, 64, 8, 64, sliding_window=128, num_local_experts=32, num_experts_per_tok=4), 24,
               dtypes=BF16_ONLY),
    # a Gated DeltaNet layer and a gated full-attention one (the real model has 36 and 12)
    ModelShape("Qwen3-Next-80B-A3B", "Qwen3NextForCausalLM",
               _dense(2048, 5120, 16, 2, 256, linear_num_key_heads=16, linear_num_value_heads=32,
                      linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
                      num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                      mlp_only_layers=[], layer_types=["linear_attention", "full_attention"]), 48, dtypes=BF16_ONLY),
    # latent attention at DeepSeek's widths (512 latent + 64 rope, 16 heads: also V3's per rank at TP=8), a dense
    # first layer, then 64 experts (6 active) beside two shared ones
    ModelShape("DeepSeek-V2-Lite", "DeepseekV2ForCausalLM",
               _dense(2048, 10944, 16, 16, 64, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
                      qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
                      moe_intermediate_size=1408, n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
                      n_group=1, topk_group=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
               27, dtypes=BF16_ONLY),
)


@dataclass(frozen=True)
class AttentionShape:
    """An attention configuration no registered family uses yet, launched through the attention op directly."""
    name: str
    layer: AttentionLayer
    sinks: bool = False
    dtypes: tuple[torch.dtype, ...] = field(default=GPU_DTYPES)


ATTENTION_SHAPES: tuple[AttentionShape, ...] = (
    AttentionShape("gemma2-9b (soft-cap, window, head 256)",
                   AttentionLayer(16, 8, 256, 256 ** -0.5, sliding_window=4096, logits_soft_cap=50.0)),
    AttentionShape("gpt-oss (sinks, window 128)", AttentionLayer(64, 8, 64, 0.125, sliding_window=128), sinks=True),
    AttentionShape("MQA head 128", AttentionLayer(32, 1, 128, 128 ** -0.5)),
)
