"""GGUF weights kept packed: a tiny model written in every packed type (mixed within fused q/k/v and gate/up, as
Q4_K_M files are) runs on quant_linear and matches transformers given the same (dequantised) weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from parity import LogitsRecorder, run_and_compare
from resin import LLM
from resin.hal.quant import dequantize
from resin.models.quantized import QuantEmbedding, QuantLinear, describe_weights
from resin.tiny import random_hf_model, random_packed, tiny_hf_config
from test_gguf import GGUF_ARCH, gguf_name, gguf_writer, permute
from conftest import require_cpu_kernels, save_tiny

pytestmark = pytest.mark.parity
require_cpu_kernels()

# Per type, the fp16 scale range that gives weights of a few hundredths (K-quants multiply by 6-8 bit sub-scales).
SCALE = {"q8_0": 4e-4, "q4_0": 6e-3, "q4_1": 4e-3, "q4_k": 6e-5, "q5_k": 3e-5, "q6_k": 1.2e-5}
# q/k/v and gate/up in different types: their fused projections run as several segments
TYPES = {"self_attn.q_proj": "q4_k", "self_attn.k_proj": "q6_k", "self_attn.v_proj": "q8_0",
         "self_attn.o_proj": "q5_k", "mlp.gate_proj": "q4_0", "mlp.up_proj": "q4_1", "mlp.down_proj": "q6_k",
         "model.embed_tokens": "q8_0", "lm_head": "q4_k"}


def _qtype(name: str) -> str | None:
    module = name.removesuffix(".weight")
    return next((t for key, t in TYPES.items() if module.endswith(key)), None)


def write_packed_gguf(path, hf_model, arch: str, seed: int = 0) -> None:
    """Random packed blocks for every 2-D weight (per TYPES); hf_model's weights become their dequantised values."""
    import gguf

    g = torch.Generator().manual_seed(seed)
    cfg = hf_model.config
    a = GGUF_ARCH[arch]
    w = gguf_writer(path, hf_model, arch)
    for name, tensor in hf_model.state_dict().items():
        if "rotary" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        qtype = _qtype(name) if tensor.dim() == 2 else None
        if qtype is None:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(tensor.detach().float().numpy()))
            continue
        rows, cols = tensor.shape
        packed = random_packed(qtype, rows, cols, g, scale=SCALE[qtype])
        with torch.no_grad():
            tensor.copy_(dequantize(packed, qtype))
        data = packed.numpy()
        if a == "llama" and name.endswith("q_proj.weight"):
            data = permute(data, cfg.num_attention_heads)
        elif a == "llama" and name.endswith("k_proj.weight"):
            data = permute(data, cfg.num_key_value_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(data), raw_dtype=getattr(gguf.GGMLQuantizationType,
                                                                                     qtype.upper()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny(arch: str, tie: bool):
    # widths that are whole K-quant super-blocks (256)
    return random_hf_model(tiny_hf_config(arch, vocab_size=160, hidden_size=256, intermediate_size=512,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                          tie_word_embeddings=tie), seed=5)


@pytest.mark.parametrize("arch,tie", [("LlamaForCausalLM", False), ("Qwen2ForCausalLM", False),  # q/k/v biases
                                      ("Qwen3ForCausalLM", True)])
def test_packed_gguf_matches_hf(arch, tie, tmp_path):
    hf = _tiny(arch, tie)
    path = tmp_path / "model.gguf"
    write_packed_gguf(path, hf, arch)
    rec = LogitsRecorder()
    llm = LLM(str(path), dtype="float32", kv_cache_memory="4MiB", logits_observer=rec)
    model = llm.engine.runner.model
    assert llm.selection.table["quant_linear"].chosen == "cpp"  # not the native fallback after a failed self-check
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * 2 + (0 if tie else 1), describe_weights(model)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert [s.qtype for s in qkv.segments] == ["q4_k", "q6_k", "q8_0"]
    run_and_compare(llm, rec, hf, [[3, 4, 5, 6], list(range(10, 50))], max_tokens=6)


def test_dense_and_packed_paths_agree(tmp_path):
    """--quantization none dequantises the same file on load: the same greedy tokens, logits within fp32 noise."""
    arch = "LlamaForCausalLM"
    hf = _tiny(arch, False)
    path = tmp_path / "model.gguf"
    write_packed_gguf(path, hf, arch)
    runs = {}
    for quantization in ("auto", "none"):
        rec = LogitsRecorder()
        llm = LLM(str(path), dtype="float32", kv_cache_memory="4MiB", logits_observer=rec, quantization=quantization)
        packed = any(isinstance(m, QuantLinear) for m in llm.engine.runner.model.modules())
        assert packed == (quantization == "auto")
        runs[quantization] = run_and_compare(llm, rec, hf, [list(range(20, 45))], max_tokens=8)
    assert runs["auto"][0].outputs[0].token_ids == runs["none"][0].outputs[0].token_ids


def test_int8_refused_for_gguf_with_the_reason(tmp_path):
    hf = _tiny("LlamaForCausalLM", False)
    path = tmp_path / "model.gguf"
    write_packed_gguf(path, hf, "LlamaForCausalLM")
    with pytest.raises(ValueError, match="already quantised"):
        LLM(str(path), dtype="float32", kv_cache_memory="4MiB", quantization="int8")


def test_without_a_kernel_gguf_is_dequantised_on_load(tmp_path):
    """The native quant_linear would unpack every weight on every call: with no provider (here forced with
    --ops), auto loads the dense path, and int8 is refused with the reason."""
    hf = _tiny("LlamaForCausalLM", False)
    path = tmp_path / "model.gguf"
    write_packed_gguf(path, hf, "LlamaForCausalLM")
    llm = LLM(str(path), dtype="float32", kv_cache_memory="4MiB", ops="quant_linear=native")
    assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in llm.engine.runner.model.modules())
    tiny = tmp_path / "dense"
    save_tiny(tiny, "LlamaForCausalLM")
    with pytest.raises(ValueError, match="needs a quant_linear kernel"):
        LLM(str(tiny), dtype="float32", kv_cache_memory="4MiB", ops="quant_linear=native", quantization="int8")
