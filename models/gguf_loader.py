"""Reading a GGUF file as a Hugging Face-shaped config plus HF-named tensors.

llama.cpp's tensor names are mapped back to Hugging Face's, and for the Llama family the q/k row permutation
llama.cpp applies for its rotary layout is undone, so the rest of Resin sees the same weights a safetensors
checkpoint would give. Tensors the model keeps packed (`packed` names, see models/quantized.py) are read as their
raw (rows, row bytes) uint8 blocks; the rest are dequantised through the `gguf` package (to fp32).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Collection, Iterator

import numpy as np
import torch

from resin.hal.quant import FORMATS
from resin.models import MODEL_REGISTRY, MODEL_TYPES

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_tensor_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for tensors Resin does not use."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        mapped = _LAYER_NAMES.get(part)
        return f"model.layers.{idx}.{mapped}.{suffix}" if mapped else None
    mapped = _TOP_NAMES.get(base)
    return f"{mapped}.{suffix}" if mapped else None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert-time permutation of q/k rows (pairs interleaved per head)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: Any) -> dict[str, Any]:
    arch = field_value(reader, "general.architecture")
    if arch not in MODEL_TYPES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(MODEL_TYPES)}")

    def get(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    tokens = field_value(reader, "tokenizer.ggml.tokens")
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": [MODEL_TYPES[arch]], "model_type": arch,
        "vocab_size": get("vocab_size") or (len(tokens) if tokens else None),
        "hidden_size": hidden, "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
    }
    if config["vocab_size"] is None:
        config["vocab_size"] = next(t.shape for t in reader.tensors if t.name == "token_embd.weight")[-1]
    for key, hf_key in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                        ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        value = field_value(reader, key)
        if value is not None:
            config[hf_key] = int(value)
    return config


class GgufCheckpoint:
    """A GGUF file read lazily: its HF-shaped config, which tensors could stay packed, then the tensors."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.reader = GGUFReader(str(path))
        self.config = gguf_config(self.reader)
        self.permute = MODEL_REGISTRY[self.config["architectures"][0]].gguf_permutes_qk

    def packable(self) -> dict[str, str]:
        """HF name -> packed type, for each 2-D tensor stored in a type Resin's quant_linear takes packed."""
        out = {}
        for t in self.reader.tensors:
            name, qtype = hf_tensor_name(t.name), t.tensor_type.name.lower()
            if name is not None and qtype in FORMATS and len(t.shape) == 2:
                out[name] = qtype
        return out

    def tensors(self, packed: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize

        for t in self.reader.tensors:
            name = hf_tensor_name(t.name)
            if name is None:
                continue
            if name in packed:  # the file's blocks as they are: (rows, row bytes) uint8
                w = torch.from_numpy(np.array(t.data, dtype=np.uint8))
            else:
                data = dequantize(t.data, t.tensor_type)
                shape = tuple(int(x) for x in reversed(t.shape))
                w = torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))  # a writable copy
            if self.permute and name.endswith("q_proj.weight"):
                w = unpermute_qk(w, self.config["num_attention_heads"])
            elif self.permute and name.endswith("k_proj.weight"):
                w = unpermute_qk(w, self.config["num_key_value_heads"])
            yield name, w


def read_gguf(path: Path) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """(config, every tensor dequantised to fp32)."""
    checkpoint = GgufCheckpoint(path)
    return checkpoint.config, checkpoint.tensors()
