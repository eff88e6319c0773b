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


# mixture-of-experts families: few small experts, top-2 (intermediate_size is the expert size for Mixtral)
TINY_FAMILY = {
    "MixtralForCausalLM": dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=32),
    "Qwen3MoeForCausalLM": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True),
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
