"""Loading a model: a Hugging Face folder of safetensors (single or sharded) or a GGUF file. Never pickle."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from resin.hal.distributed import parallel
from resin.hal.fp8 import FP8_DTYPES
from resin.models import resolve_architecture
from resin.models.fp8 import convert_after_loading, parse_quant_config, quantize_linears
from resin.models.gguf_loader import GgufCheckpoint
from resin.models.quantized import pack_gguf_layers, quantize_int8

log = logging.getLogger("resin.loader")


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


class CheckpointSlice:
    """A tensor still in its safetensors file: `narrow` reads only the rows or columns asked for, so a
    tensor-parallel rank reads its own slice of each weight and never the whole model."""

    def __init__(self, handle: Any, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def read(self) -> torch.Tensor:
        return self._slice[tuple(slice(None) for _ in self.shape)]


def _safetensors_tensors(files: list[Path], sliced: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs; sliced: (name, CheckpointSlice) instead, read when a loader takes its part."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, CheckpointSlice(st, name) if sliced else st.get_tensor(name)


def read_checkpoint(path: str | Path, sliced: bool = False) -> tuple[dict[str, Any], Iterator[tuple[str, Any]]
                                                                   | GgufCheckpoint, Path | None]:
    """(HF config dict, (name, tensor) pairs or the GGUF checkpoint to read them from, the GGUF file if any).
    sliced: safetensors tensors come as CheckpointSlices (see load_weights)."""
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
            return read_checkpoint(ggufs[0], sliced)
        pickles = [f.name for f in p.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        hint = (f" It has {pickles}: pickle checkpoints are never loaded (they can run code); convert them to "
                f"safetensors." if pickles else "")
        raise FileNotFoundError(f"no *.safetensors (or single .gguf) weights in {p}.{hint}")
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"{p} has weights but no config.json")
    return json.loads((p / "config.json").read_text()), _safetensors_tensors(files, sliced), None


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


def load_weights(model: nn.Module, tensors: Iterator[tuple[str, Any]]) -> None:
    """Each checkpoint tensor into its parameter. A CheckpointSlice goes as it is to loaders that take slices
    (`reads_slices`, which read only their part); every other loader gets the whole tensor in the parameter's
    dtype (fp8 and packed weights as stored)."""
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    ignore = getattr(model, "ignored_checkpoint_tensor", None)  # name -> why the family leaves it out, or None
    loaded: set[str] = set()
    ignored: dict[str, int] = {}
    for name, tensor in tensors:
        if "rotary_emb" in name:
            continue
        reason = ignore(name) if ignore is not None else None
        if reason is not None:
            ignored[reason] = ignored.get(reason, 0) + 1
            continue
        if name.startswith("lm_head.") and "lm_head.weight" not in params:
            continue  # tied embeddings: the checkpoint may still carry a copy
        target, shard = _param_for(model, name, packed)
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        if isinstance(tensor, CheckpointSlice) and not getattr(param, "reads_slices", False):
            tensor = tensor.read()
        if isinstance(tensor, torch.Tensor) and param.dtype not in FP8_DTYPES and tensor.is_floating_point():
            tensor = tensor.to(param.dtype)  # fp8 and packed weights: never cast
        param.weight_loader(param, tensor, shard)
        loaded.add(target if shard is None else f"{target}:{shard}")
    expected = set()
    for pname, param in params.items():
        shards = getattr(param, "shards", None)  # a parameter filled from several checkpoint tensors
        expected.update(f"{pname}:{s}" for s in shards) if shards else expected.add(pname)
    for reason, count in ignored.items():
        log.warning("%d checkpoint tensor(s) not loaded: %s", count, reason)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:4]}")


def check_tensor_parallel(architecture: str, cls: type) -> None:
    from resin.models import MODEL_REGISTRY

    if not getattr(cls, "tensor_parallel", False):
        ready = [name for name, c in MODEL_REGISTRY.items() if getattr(c, "tensor_parallel", False)]
        raise ValueError(f"{architecture} does not run under tensor parallelism yet (its layers are not split over "
                         f"ranks); families that do: {', '.join(ready)}. Use tensor_parallel_size=1")


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
    world = parallel().world
    config, tensors, gguf_file = read_checkpoint(path, sliced=world > 1)
    architecture, cls = resolve_architecture(config)
    quant = parse_quant_config(config, mxfp4_reader=getattr(cls, "reads_mxfp4", False))
    if world > 1:
        check_tensor_parallel(architecture, cls)
    model = cls(cls.parse_config(config), dtype)
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
