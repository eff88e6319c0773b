"""KV cache bytes per token (per layer kind) and recurrent-state bytes per sequence of each family with per-layer
cache kinds, for its tiny test config and its published real-size configs, in bf16 with 16-token blocks: from
Resin's own layout planner (core/cache_layout.py) and the models' recurrent specs, the models built on the meta
device (no weights are allocated).

    python bench/cache_bytes.py
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from resin.core.cache_layout import plan_cache_layout
from resin.models import resolve_architecture
from resin.tiny import tiny_hf_config

# the published config.json values that decide cache sizes (layers, KV heads, head size, windows, linear heads)
REAL = {
    "Gemma2ForCausalLM 2B": ("Gemma2ForCausalLM", dict(num_hidden_layers=26, hidden_size=2304, intermediate_size=9216,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=4096, query_pre_attn_scalar=256,
        vocab_size=256000)),
    "Gemma2ForCausalLM 9B": ("Gemma2ForCausalLM", dict(num_hidden_layers=42, hidden_size=3584, intermediate_size=14336,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=4096, query_pre_attn_scalar=256,
        vocab_size=256000)),
    "Gemma3ForCausalLM 1B": ("Gemma3ForCausalLM", dict(num_hidden_layers=26, hidden_size=1152, intermediate_size=6912,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512, vocab_size=262144,
        layer_types=None, sliding_window_pattern=6)),
    "Gemma3ForCausalLM 27B": ("Gemma3ForCausalLM", dict(num_hidden_layers=62, hidden_size=5376, intermediate_size=21504,
        num_attention_heads=32, num_key_value_heads=16, head_dim=128, sliding_window=1024, vocab_size=262208,
        layer_types=None, sliding_window_pattern=6)),
    "GptOssForCausalLM 20B": ("GptOssForCausalLM", dict(num_hidden_layers=24, num_local_experts=32,
        num_experts_per_tok=4, hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, sliding_window=128, vocab_size=201088, rope_parameters=None, max_position_embeddings=4096)),
    "GptOssForCausalLM 120B": ("GptOssForCausalLM", dict(num_hidden_layers=36, num_local_experts=128,
        num_experts_per_tok=4, hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, sliding_window=128, vocab_size=201088, rope_parameters=None, max_position_embeddings=4096)),
    "Qwen3NextForCausalLM 80B-A3B": ("Qwen3NextForCausalLM", dict(num_hidden_layers=48, hidden_size=2048,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        intermediate_size=5120, vocab_size=151936, layer_types=None, mlp_only_layers=[],
        max_position_embeddings=4096)),
}

def report(label: str, arch: str, overrides: dict[str, Any]) -> None:
    cfg = tiny_hf_config(arch, **overrides).to_dict()
    _, cls = resolve_architecture(cfg)
    with torch.device("meta"):
        model = cls(cls.parse_config(cfg), torch.bfloat16)
    layers = model.attention_layers
    layout = plan_cache_layout(layers, 16, torch.bfloat16)
    lines = layout.describe(layers, torch.bfloat16)
    rec = getattr(model, "recurrent_layers", [])
    if rec:
        per_seq = sum(r.bytes_per_sequence(torch.bfloat16) for r in rec)
        lines.append(f"recurrent: {len(rec)} layers, {per_seq} bytes/sequence ({per_seq / 2**20:.2f} MiB)")
    print(f"| {label} | " + "; ".join(lines) + " |")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print("| config | per layer kind |\n|---|---|")
    for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM", "Qwen3NextForCausalLM"):
        report(f"{arch} tiny", arch, {})
    for label, (arch, ov) in REAL.items():
        report(label, arch, ov)


if __name__ == "__main__":
    main()
