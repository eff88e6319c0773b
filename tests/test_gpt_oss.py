"""GPT-OSS beyond the shared parity gate: MXFP4 expert checkpoints (as released) dequantised on load to exactly
the weights transformers computes from them, with sinks and expert biases large enough to matter."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from parity import LogitsRecorder, hf_logits, run_and_compare
from resin import LLM
from resin.models.mxfp4 import dequantize_mxfp4
from resin.tiny import random_hf_model, tiny_hf_config

pytestmark = pytest.mark.parity


def random_mxfp4(rows_shape: tuple[int, ...], cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed e2m1 codes and e8m0 exponents for (..., cols) weights: groups of 32 values, 16 bytes."""
    blocks = torch.randint(0, 256, (*rows_shape, cols // 32, 16), dtype=torch.uint8)
    scales = torch.randint(127 - 7, 127 - 3, (*rows_shape, cols // 32), dtype=torch.uint8)
    return blocks, scales


def test_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((3, 40), 96)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (3, 96, 40): transformers transposes
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), ref.transpose(1, 2))
    with pytest.raises(ValueError, match="do not pair up"):
        dequantize_mxfp4(blocks, scales[..., :1], torch.float32)


def write_mxfp4_checkpoint(tmp_path):
    """A tiny GPT-OSS checkpoint with MXFP4 experts (and real sinks and biases); returns the transformers model
    holding its dequantised weights."""
    cfg = tiny_hf_config("GptOssForCausalLM")
    hf = random_hf_model(cfg, seed=9)
    e, h, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            layer.self_attn.sinks.mul_(40)  # ~2: sinks that take a real share of each softmax
            experts = layer.mlp.experts
            experts.gate_up_proj_bias.normal_(0, 0.5)
            experts.down_proj_bias.normal_(0, 0.5)
            for name, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
                blocks, scales = random_mxfp4((e, rows), cols)
                getattr(experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales
    hf.save_pretrained(tmp_path, safe_serialization=True)
    weights = {k: v for k, v in load_file(tmp_path / "model.safetensors").items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**weights, **packed}, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                        "model.embed_tokens"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return hf


def test_mxfp4_checkpoint_matches_transformers_on_its_dequantised_weights(tmp_path):
    hf = write_mxfp4_checkpoint(tmp_path)
    rec = LogitsRecorder()
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=16,
              logits_observer=rec)
    rng = random.Random()
    prompts = [[rng.randrange(211) for _ in range(n)] for n in (5, 41, 13)]  # 41: past the window and YaRN's 32
    run_and_compare(llm, rec, hf, prompts, max_tokens=4)
    # the sinks matter: without them transformers' own logits move far beyond the gate's tolerance
    with torch.no_grad():
        before = hf_logits(hf, prompts[1])
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e9)
        assert (hf_logits(hf, prompts[1]) - before).abs().max() > 1e-1
