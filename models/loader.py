"""Loading a model: a Hugging Face folder of safetensors (single or sharded) or a GGUF file. Never pickle."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from resin.hal.fp8 import FP8_DTYPES
from resin.models import resolve_architecture
from resin.models.fp8 import convert_after_loading, parse_quant_config, quantize_linears
from resin.models.gguf_loader import GgufCheckpoint
from resin.models.quantized import pack_gguf_layers, quantize_int8


@dataclass
class LoadedModel:
    model: nn.Module
    architecture: str
    hf_config: dict[str, Any]
    path: Path
    gguf_file: Path | None = None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    return sorted(folder.glob("*.safetensors"))


def _safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]] | GgufCheckpoint,
                                              Path | None]:
    """(HF config dict, (name, tensor) pairs or the GGUF checkpoint to read them from, the GGUF file if any)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist: give a folder with config.json and "
                                f"*.safetensors, or a .gguf file")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"{p} is a file but not a .gguf; give a .gguf file or a Hugging Face model folder")
        checkpoint = GgufCheckpoint(p)
        return checkpoint.config, checkpoint, p
    files = _safetensors_files(p)
    if not files:
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return read_checkpoint(ggufs[0])
        pickles = [f.name for f in p.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        hint = (f" It has {pickles}: pickle checkpoints are never loaded (they can run code); convert them to "
                f"safetensors." if pickles else "")
        raise FileNotFoundError(f"no *.safetensors (or single .gguf) weights in {p}.{hint}")
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"{p} has weights but no config.json")
    return json.loads((p / "config.json").read_text()), _safetensors_tensors(files), None


def _param_for(model: nn.Module, name: str, packed: dict[str, tuple[str, str]]) -> tuple[str, object]:
    """Checkpoint tensor name -> (parameter name, shard or None). A family may rename first
    (`checkpoint_name`, e.g. per-expert tensors into fused expert weights); then projections that Resin fuses
    (q/k/v, gate/up) map to their fused module and shard."""
    rename = getattr(model, "checkpoint_name", None)
    mapped = rename(name) if rename is not None else None
    if mapped is not None:
        return mapped
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            parts[i], shard = packed[part]
            return ".".join(parts), shard
    return name, None


def load_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    loaded: set[str] = set()
    for name, tensor in tensors:
        if "rotary_emb" in name:
            continue
        if name.startswith("lm_head.") and "lm_head.weight" not in params:
            continue  # tied embeddings: the checkpoint may still carry a copy
        target, shard = _param_for(model, name, packed)
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        if param.dtype not in FP8_DTYPES and tensor.is_floating_point():  # fp8 and packed weights: never cast
            tensor = tensor.to(param.dtype)
        param.weight_loader(param, tensor, shard)
        loaded.add(target if shard is None else f"{target}:{shard}")
    expected = set()
    for pname, param in params.items():
        shards = getattr(param, "shards", None)  # a parameter filled from several checkpoint tensors
        expected.update(f"{pname}:{s}" for s in shards) if shards else expected.add(pname)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:4]}")


QUANTIZATION = {
    "auto": "GGUF weights stay in their packed types where quant_linear takes them; other checkpoints as stored",
    "none": "GGUF weights are dequantised on load to --dtype (the dense path)",
    "int8": "the linear layers of a safetensors checkpoint become weight-only int8, one scale per output row",
}


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device, fp8_dtype: torch.dtype | None = None,
               quantization: str = "auto") -> LoadedModel:
    """fp8_dtype: the platform's fp8 flavour; fp8 checkpoints are converted to it (None keeps e4m3fn).
    quantization: one of QUANTIZATION."""
    if quantization not in QUANTIZATION:
        raise ValueError(f"quantization={quantization!r} is not supported; choose one of: "
                         + "; ".join(f"{k} ({v})" for k, v in QUANTIZATION.items()))
    config, tensors, gguf_file = read_checkpoint(path)
    architecture, cls = resolve_architecture(config)
    model = cls(cls.parse_config(config), dtype)
    quant = parse_quant_config(config, mxfp4_reader=getattr(cls, "reads_mxfp4", False))
    if quant is not None:
        quantize_linears(model, quant)
    if isinstance(tensors, GgufCheckpoint):
        if quantization == "int8":
            raise ValueError("--quantization int8 quantises safetensors checkpoints; a GGUF file is already "
                             "quantised (its packed types run as they are with --quantization auto)")
        packed = pack_gguf_layers(model, tensors.packable()) if quantization == "auto" else set()
        tensors = tensors.tensors(packed)
    load_weights(model, tensors)
    if quant is not None:
        convert_after_loading(model, fp8_dtype)
    if quantization == "int8":
        if quant is not None:
            raise ValueError("--quantization int8 needs an unquantised checkpoint; this one is already fp8")
        quantize_int8(model)
    return LoadedModel(model.to(device).eval(), architecture, config, Path(path), gguf_file)
