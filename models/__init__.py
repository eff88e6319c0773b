"""Model families, one file each, written only against HAL ops. The registry is keyed by the Hugging Face
`architectures` name; a config without `architectures` (as GGUF-derived ones are) falls back to `model_type`."""
from __future__ import annotations

from typing import Any

from resin.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from resin.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from resin.models.glm4_moe import Glm4MoeForCausalLM
from resin.models.gpt_oss import GptOssForCausalLM
from resin.models.llama import (LlamaForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM,
                                Qwen3ForCausalLM, Qwen3MoeForCausalLM)
from resin.models.qwen3_next import Qwen3NextForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
MODEL_TYPES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                               "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
               "qwen3_next": "Qwen3NextForCausalLM", "gpt_oss": "GptOssForCausalLM",
               "qwen2_moe": "Qwen2MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
               "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def resolve_architecture(config: dict[str, Any]) -> tuple[str, type]:
    names = list(config.get("architectures") or [])
    if not names and config.get("model_type") in MODEL_TYPES:
        names = [MODEL_TYPES[config["model_type"]]]
    for name in names:
        if name in MODEL_REGISTRY:
            return name, MODEL_REGISTRY[name]
    found = names or [f"model_type={config.get('model_type')!r}"]
    raise ValueError(f"unsupported architecture {', '.join(found)}; Resin supports: {', '.join(MODEL_REGISTRY)}. "
                     f"To add one, write its forward pass against HAL ops (docs/porting.md)")


__all__ = ["MODEL_REGISTRY", "MODEL_TYPES", "resolve_architecture"]
