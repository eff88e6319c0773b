"""Tiny random-weight models of each supported architecture, built from transformers configs: the porting
gate's workhorse (`resin parity ARCH`, `resin models`, the test suite)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from resin.models import MODEL_REGISTRY, MODEL_TYPES

TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, max_position_embeddings=512, rms_norm_eps=1e-5,
            tie_word_embeddings=False)


_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}

# mixture-of-experts families: few small experts, top-2 (intermediate_size is the expert size for Mixtral)
TINY_FAMILY = {
    "MixtralForCausalLM": dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=32),
    "Qwen3MoeForCausalLM": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True),
    # a gated shared expert beside 6 routed ones, weights not renormalised
    "Qwen2MoeForCausalLM": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1],
                                norm_topk_prob=False),
    # one dense layer, then sigmoid routing over 4 groups of 2 experts (best 2 groups), a correction bias, scaled
    # weights and a shared expert; q/k norm, q/k/v bias, half of each head rotated
    "Glm4MoeForCausalLM": dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, n_group=4, topk_group=2, first_k_dense_replace=1,
                               n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                               use_qk_norm=True, attention_bias=True),
    # latent attention: query through a rank-32 bottleneck, a 24-wide latent + 8 rotary dims cached per token
    # (against 4 heads x (16 + 8 + 12) expanded), YaRN with DeepSeek's mscale past 64 positions; one dense layer,
    # then sigmoid routing over 4 groups of 2 experts with a correction bias, scaled, and a shared expert
    "DeepseekV3ForCausalLM": dict(num_hidden_layers=3, num_key_value_heads=4, head_dim=8, q_lora_rank=32,
                                  kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4,
                                  topk_group=2, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, rope_parameters=_DEEPSEEK_YARN),
    # V2-Lite's shape: no query bottleneck; softmax routing, group-limited greedy, weights not renormalised
    "DeepseekV2ForCausalLM": dict(num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=24,
                                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
                                  topk_method="group_limited_greedy", first_k_dense_replace=1, n_shared_experts=2,
                                  routed_scaling_factor=1.5, norm_topk_prob=False, rope_parameters=_DEEPSEEK_YARN),
    # sliding-window families: windows shorter than the test prompts, soft-caps low enough to bend the logits
    "Gemma2ForCausalLM": dict(sliding_window=12, query_pre_attn_scalar=32, attn_logit_softcapping=4.0,
                              final_logit_softcapping=3.0),
    "Gemma3ForCausalLM": dict(num_hidden_layers=3, sliding_window=10, query_pre_attn_scalar=32,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1000000.0}}),
    # hybrid: three Gated DeltaNet layers, then gated full attention with a quarter of the head rotated; MoE with a
    # shared expert on every layer but the second
    "Qwen3NextForCausalLM": dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                 linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                 shared_expert_intermediate_size=32, mlp_only_layers=[1]),
    # sliding and full layers alternating, 8-token windows, 4 experts (2 active), YaRN past 32 positions
    "GptOssForCausalLM": dict(num_hidden_layers=2, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                              intermediate_size=32, head_dim=16,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 32}),
}


def tiny_hf_config(arch: str, **overrides: Any):
    from transformers import AutoConfig

    types = {v: k for k, v in MODEL_TYPES.items()}
    if arch not in types:
        raise ValueError(f"no tiny config for {arch!r}; architectures: {', '.join(MODEL_REGISTRY)}")
    values = {**TINY, **TINY_FAMILY.get(arch, {}), **overrides}
    cfg = AutoConfig.for_model(types[arch], **values)
    cfg.architectures = [arch]
    return cfg


def random_hf_model(cfg, seed: int = 0):
    """A transformers model with random weights, widened so logits differ meaningfully between tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 1 and p.shape[0] > 1:
                p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: make it move the experts chosen
                b.copy_(torch.rand_like(b) * 0.2)
    return model


def save_tiny_model(folder: Path, arch: str, seed: int = 0, tokenizer: Any = None, **overrides: Any):
    model = random_hf_model(tiny_hf_config(arch, **overrides), seed)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return model


# Where each packed GGUF type keeps its fp16 scales (byte offsets in a block): random bytes elsewhere are valid.
_SCALE_BYTES = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def random_packed(qtype: str, rows: int, in_features: int, generator: torch.Generator | None = None,
                  scale: float = 0.02) -> torch.Tensor:
    """Random (rows, row bytes) blocks of a packed GGUF type: every quant bit random, fp16 scales in
    [0, scale) (a min field is a scale too) so values stay finite."""
    from resin.hal.quant import quant_format

    fmt = quant_format(qtype)
    blocks = torch.randint(0, 256, (rows, in_features // fmt.block, fmt.block_bytes), dtype=torch.uint8,
                           generator=generator)
    for offset in _SCALE_BYTES[qtype]:
        value = (torch.rand(rows, in_features // fmt.block, 1, generator=generator) * scale).half()
        blocks[..., offset:offset + 2] = value.view(torch.uint8)
    return blocks.reshape(rows, -1).contiguous()
