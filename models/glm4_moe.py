"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): a Llama-shaped decoder with q/k/v bias, optional q/k RMSNorm, rotary over
part of each head, dense MLPs on the first layers and DeepSeek-V3-style MoE after them (sigmoid scores with a
correction bias, grouped top-k, a scaling factor, shared experts). The multi-token-prediction layers a checkpoint
carries past num_hidden_layers are read over and ignored (see `ignored_checkpoint_tensor`)."""
from __future__ import annotations

from typing import Any

from resin.models.llama import DecoderConfig, LlamaForCausalLM
from resin.models.moe import deepseek_moe, expert_checkpoint_name


def mtp_layer_tensor(name: str, num_layers: int) -> str | None:
    """Why a tensor of a layer past the decoder's is left out: DeepSeek-V3 and GLM-4.5 checkpoints carry their
    multi-token-prediction layers there, which Resin does not run (they would serve as speculative heads)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers:
        return (f"multi-token-prediction layers (model.layers.{num_layers} and on) are ignored: Resin does not run "
                f"them as speculative heads yet")
    return None


class Glm4MoeForCausalLM(LlamaForCausalLM):
    gguf_permutes_qk = False

    @classmethod
    def parse_config(cls, c: dict[str, Any]) -> DecoderConfig:
        rope = dict(c.get("rope_parameters") or {})
        partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5))
        cfg = DecoderConfig.from_hf(c, qkv_bias=c.get("attention_bias", False), qk_norm=c.get("use_qk_norm", False),
                                    shared_experts_name="shared_experts")
        cfg.rot_dim = int(cfg.head_dim * partial)
        cfg.moe_layers, cfg.moe = deepseek_moe(c, cfg.num_layers, noaux=True)
        return cfg

    def checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        return expert_checkpoint_name(name, shared=bool(self.config.moe.shared_intermediate_size))

    def ignored_checkpoint_tensor(self, name: str) -> str | None:
        return mtp_layer_tensor(name, self.config.num_layers)
