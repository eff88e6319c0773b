"""--quantization int8: weight-only int8 with one scale per output row for safetensors models, on the same
quant_linear kernels; parity with transformers given the same rounded weights, and the refusals."""
from __future__ import annotations

import pytest
import torch

from conftest import save_tiny
from parity import LogitsRecorder, run_and_compare
from resin import LLM
from resin.models.quantized import Int8Linear, describe_weights

pytestmark = pytest.mark.parity


def fake_int8(weight: torch.Tensor) -> torch.Tensor:
    """The values Resin's int8 layer holds: q * scale with scale = max |w| / 127 per row."""
    scale = (weight.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
    return torch.round(weight / scale).clamp(-127, 127) * scale


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_int8_matches_hf_on_the_rounded_weights(arch, tmp_path):
    hf = save_tiny(tmp_path, arch, seed=2)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(fake_int8(module.weight.float()))
    rec = LogitsRecorder()
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="4MiB", logits_observer=rec, quantization="int8")
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 4 * hf.config.num_hidden_layers and all(m.weight.dtype == torch.int8 for m in layers)
    assert "int8 x 8" in describe_weights(model)
    run_and_compare(llm, rec, hf, [[3, 4, 5, 6], list(range(10, 40))], max_tokens=6)


def test_unknown_quantization_names_the_choices(tmp_path):
    save_tiny(tmp_path, "LlamaForCausalLM")
    with pytest.raises(ValueError, match="quantization='int4' is not supported; choose one of: auto"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory="4MiB", quantization="int4")
