"""GGUF loading: llama.cpp tensor names and the Llama q/k permutation undone, quantised tensors dequantised."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from resin.tiny import random_hf_model, tiny_hf_config
from parity import LogitsRecorder, run_and_compare
from resin import LLM
from resin.models.gguf_loader import unpermute_qk

pytestmark = pytest.mark.parity

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, idx, rest = hf.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        return f"blk.{idx}.{NAMES[module]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def gguf_writer(path, hf_model, arch: str):
    """A GGUFWriter with the model's hyperparameters written as llama.cpp names them."""
    import gguf

    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(hf_model.model.layers[0].self_attn.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    return w


def write_gguf(path, hf_model, arch: str, qtype=None):
    """Write hf_model as llama.cpp would; with qtype, 2-D weights are quantised and hf_model is updated in place
    to the dequantised values, so both sides hold the same numbers."""
    from gguf.quants import dequantize, quantize

    cfg = hf_model.config
    a = GGUF_ARCH[arch]
    w = gguf_writer(path, hf_model, arch)
    state = hf_model.state_dict()
    for name, tensor in state.items():
        if "rotary" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        data = tensor.detach().float().numpy()
        if qtype is not None and data.ndim == 2:
            q = quantize(data, qtype)
            data = dequantize(q, qtype).reshape(data.shape)
            tensor.copy_(torch.from_numpy(data))
        if a == "llama" and name.endswith("q_proj.weight"):
            data = permute(data, cfg.num_attention_heads)
        elif a == "llama" and name.endswith("k_proj.weight"):
            data = permute(data, cfg.num_key_value_heads)
        if qtype is not None and data.ndim == 2:
            w.add_tensor(gguf_name(name), quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.randn(4 * 12, 7)
    assert torch.equal(unpermute_qk(torch.from_numpy(permute(w.numpy(), 4)), 4), w)


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
@pytest.mark.parametrize("quant", [None, "Q8_0"])
def test_gguf_matches_hf(arch, quant, tmp_path):
    import gguf

    hf = random_hf_model(tiny_hf_config(arch, vocab_size=160, head_dim=24, hidden_size=64,
                                  tie_word_embeddings=arch == "Qwen3ForCausalLM"), seed=3)
    path = tmp_path / "model.gguf"
    write_gguf(path, hf, arch, getattr(gguf.GGMLQuantizationType, quant) if quant else None)
    rec = LogitsRecorder()
    llm = LLM(str(path), dtype="float32", kv_cache_memory="4MiB", logits_observer=rec)
    assert llm.architecture == arch and llm.get_tokenizer() is None
    run_and_compare(llm, rec, hf, [[3, 4, 5, 6], list(range(10, 40))], max_tokens=5)
