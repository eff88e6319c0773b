"""GGUF -> a Hugging Face-style folder Resin loads fastest: safetensors (dequantised fp32), config.json,
generation_config.json, and the tokenizer with its chat template (taken from the GGUF metadata)."""
from __future__ import annotations

import json
from pathlib import Path

from tqdm.auto import tqdm

from resin.models.gguf_loader import read_gguf


def convert_gguf(gguf_file: Path, out_dir: Path, progress: bool = True) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    config, tensors = read_gguf(gguf_file)
    weights = {}
    for name, tensor in tqdm(tensors, desc="dequantising", unit="tensor", disable=not progress):
        weights[name] = tensor.contiguous()
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt", "source": gguf_file.name})
    config.update({"hidden_act": "silu", "torch_dtype": "float32"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer.save_pretrained(str(out_dir))
