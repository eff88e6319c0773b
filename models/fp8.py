"""fp8 checkpoints (w8a8): read the quantisation config, swap the model's linear layers for fp8 ones before
loading, convert e4m3fn weights to the platform's flavour after.

Formats read: compressed-tensors "float-quantized" (llm-compressor's FP8 / FP8_DYNAMIC schemes: per-tensor or
per-channel weight scales; static per-tensor or dynamic per-token activations) and the `quant_method: fp8`
per-tensor layout. Tensors: `<proj>.weight` (fp8 e4m3fn), `<proj>.weight_scale`, `<proj>.input_scale` (static).
Block-wise scales (DeepSeek-V3's `weight_scale_inv` with `weight_block_size`) are read by models/block_fp8.py.
Model files do not change: the swap works on any model built from layers.Linear / layers.MergedLinear.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resin import hal
from resin.models.block_fp8 import finish_block_fp8, quantize_block_fp8
from resin.models.layers import Linear, MergedLinear, reduce_rows, take


@dataclass(frozen=True)
class Fp8Config:
    static_input: bool  # a checkpoint input_scale per layer; else per-token scales computed at run time
    ignore: tuple[str, ...] = ()  # module names (or "re:<regex>") left unquantised
    per_channel: bool = False  # informational: scales are stored per output channel either way
    block: tuple[int, int] | None = None  # block-scale fp8: (rows, columns) of weights that share one scale

    def ignores(self, name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:") and re.fullmatch(pattern[3:], name):
                return True
            if name == pattern or name.endswith("." + pattern) or name.split(".")[-1] == pattern:
                return True
        return False


def parse_quant_config(hf_config: dict[str, Any], mxfp4_reader: bool = False) -> Fp8Config | None:
    """mxfp4_reader: the family dequantises MXFP4 tensors itself (GPT-OSS's experts), so there is nothing to do."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "mxfp4" and mxfp4_reader:
        return None
    if method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors checkpoint with {len(groups)} config groups: Resin reads one "
                             f"(an FP8 / FP8_DYNAMIC scheme over all Linear layers)")
        w, a = groups[0].get("weights") or {}, groups[0].get("input_activations")
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors weights {w.get('type')}/{w.get('num_bits')} bits: only fp8 "
                             f"(type float, 8 bits) is supported")
        if w.get("strategy") not in ("tensor", "channel"):
            raise ValueError(f"fp8 weight strategy {w.get('strategy')!r}: supported are 'tensor' and 'channel' "
                             f"(block-wise scales are not)")
        if not a or a.get("type") != "float" or a.get("num_bits") != 8:
            raise ValueError("fp8 weight-only checkpoints (no input_activations) are not supported; use w8a8 FP8 "
                             "or FP8_DYNAMIC")
        return Fp8Config(static_input=not a.get("dynamic", False), ignore=tuple(qc.get("ignore") or ()),
                         per_channel=w["strategy"] == "channel")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block:
            if len(block) != 2 or qc.get("activation_scheme", "dynamic") != "dynamic":
                raise ValueError(f"block-wise fp8 with weight_block_size {block} and activation_scheme "
                                 f"{qc.get('activation_scheme')!r}: Resin reads [rows, columns] blocks with dynamic "
                                 f"per-token-group activations (DeepSeek-V3's layout)")
            return Fp8Config(static_input=False, ignore=tuple(qc.get("modules_to_not_convert") or ()),
                             block=(int(block[0]), int(block[1])))
        return Fp8Config(static_input=qc.get("activation_scheme", "dynamic") == "static",
                         ignore=tuple(qc.get("modules_to_not_convert") or ()))
    raise ValueError(f"quantization method {method!r} is not supported; Resin loads fp8 (compressed-tensors "
                     f"float-quantized, or quant_method fp8), GGUF, MXFP4 experts of GptOssForCausalLM, and "
                     f"unquantised checkpoints")


class Fp8Linear(nn.Module):
    """y = fp8_linear(x, W, per-channel scales, input scale) + b. For fused projections each checkpoint shard
    brings its own scales: per-tensor ones are spread over the shard's rows (so one GEMM serves all shards), and
    a static input scale is the largest of the shards' (vLLM does the same)."""

    def __init__(self, linear: Linear, static_input: bool):
        super().__init__()
        out_features, in_features = linear.weight.shape
        self.offsets: dict[str, tuple[int, int]] = getattr(linear, "offsets", {})
        # tensor parallelism: the checkpoint rows each shard takes (column-split), or the columns (row-split)
        self.parts: dict[Any, tuple[int, int]] = getattr(linear, "parts", {})
        self.in_part: tuple[int, int] | None = getattr(linear, "in_part", None)
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        self.weight.weight_loader = self._load_rows
        self.weight.reads_slices = True
        self.weight_scale = nn.Parameter(torch.zeros(out_features, dtype=torch.float32), requires_grad=False)
        self.weight_scale.weight_loader = self._load_scale
        self.input_scale = None
        if static_input:
            self.input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32), requires_grad=False)
            self.input_scale.weight_loader = self._load_input_scale
        self.bias = linear.bias
        if self.offsets:
            for p in (self.weight, self.weight_scale, self.input_scale):
                if p is not None:
                    p.shards = list(self.offsets)

    def _rows(self, param: torch.Tensor, shard: str | None) -> torch.Tensor:
        if shard not in self.offsets:
            return param.data
        start, size = self.offsets[shard]
        return param.data.narrow(0, start, size)

    def _mine(self, tensor: Any, shard: str | None) -> torch.Tensor:
        """This rank's part of a checkpoint weight (all of it with one rank)."""
        if shard in self.parts:
            return take(tensor, 0, *self.parts[shard])
        return take(tensor, 1, *self.in_part) if self.in_part is not None else take(tensor, 0, 0, tensor.shape[0])

    def _load_rows(self, param: nn.Parameter, tensor: Any, shard: str | None = None) -> None:
        tensor = self._mine(tensor, shard)
        rows = self._rows(param, shard)
        if tensor.shape != rows.shape:
            raise ValueError(f"fp8 weight of shape {tuple(tensor.shape)} does not fit {tuple(rows.shape)}")
        if tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8 checkpoint weight has dtype {tensor.dtype}; expected float8_e4m3fn")
        rows.copy_(tensor)

    def _load_scale(self, param: nn.Parameter, tensor: torch.Tensor, shard: str | None = None) -> None:
        rows = self._rows(param, shard)
        flat = tensor.float().reshape(-1)
        if shard in self.parts and flat.numel() > 1:  # per channel: this rank's rows
            flat = flat.narrow(0, *self.parts[shard])
        if flat.numel() not in (1, rows.numel()):
            raise ValueError(f"weight_scale with {flat.numel()} values for {rows.numel()} output rows: expected "
                             f"one (per tensor) or one per row (per channel)")
        rows.copy_(flat.expand(rows.numel()))

    def _load_input_scale(self, param: nn.Parameter, tensor: torch.Tensor, shard: str | None = None) -> None:
        param.data.copy_(torch.maximum(param.data, tensor.float().reshape(-1)[:1]))

    def to_fp8_flavour(self, fp8_dtype: torch.dtype | None) -> None:
        """e4m3fn -> e4m3fnuz on gfx942 (bits reinterpreted, scales doubled); nothing otherwise."""
        if fp8_dtype is None or fp8_dtype == self.weight.dtype:
            return
        if fp8_dtype != getattr(torch, "float8_e4m3fnuz", None):
            raise ValueError(f"cannot convert fp8 {self.weight.dtype} weights to {fp8_dtype}")
        w, ws, xs = hal.e4m3fn_to_e4m3fnuz(self.weight.data, self.weight_scale.data,
                                           self.input_scale.data if self.input_scale is not None else None)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.weight_scale.data.copy_(ws)
        if self.input_scale is not None:
            self.input_scale.data.copy_(xs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_part is not None:
            return reduce_rows(lambda bias: hal.FP8_LINEAR(x, self.weight, self.weight_scale, self.input_scale, bias),
                               self.bias)
        return hal.FP8_LINEAR(x, self.weight, self.weight_scale, self.input_scale, self.bias)


def checkpoint_names(model: nn.Module, name: str) -> list[list[str]]:
    """The checkpoint's names for Resin module `name`, one list of aliases per shard: a fused projection has a
    shard per source (q/k/v_proj for qkv_proj), and a family may name a module differently
    (`checkpoint_module_names`, e.g. Mixtral's block_sparse_moe for Resin's mlp)."""
    parent, _, leaf = name.rpartition(".")
    sources = [src for src, (fused, _) in getattr(model, "packed_modules", {}).items() if fused == leaf]
    shards = [f"{parent}.{src}" if parent else src for src in sources] or [name]
    aliases = getattr(model, "checkpoint_module_names", None)
    return [aliases(n) if aliases else [n] for n in shards]


def _ignored(model: nn.Module, name: str, config: Fp8Config) -> bool:
    shards = checkpoint_names(model, name)
    ignored = [any(config.ignores(alias) for alias in aliases) for aliases in shards]
    if any(ignored) and not all(ignored):
        raise ValueError(f"the checkpoint quantises only some of {[a[0] for a in shards]}, which Resin runs as one "
                         f"fused GEMM ({name}); quantise all of them or none")
    return all(ignored)


def quantize_linears(model: nn.Module, config: Fp8Config) -> list[str]:
    """Replace every Linear / MergedLinear not ignored by an Fp8Linear; returns the names replaced. Ignore lists
    name checkpoint modules, so they are matched against each module's checkpoint names."""
    # lm_head stays in the model dtype (fp8 checkpoints leave it unquantised too)
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, (Linear, MergedLinear)) and name != "lm_head"
               and not (config.block and getattr(module, "router", False)) and not _ignored(model, name, config)]
    if config.block:
        quantize_block_fp8(model, config.block, targets)
        return [name for name, _ in targets]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear(module, config.static_input))
    return [name for name, _ in targets]


def convert_after_loading(model: nn.Module, fp8_dtype: torch.dtype | None) -> None:
    finish_block_fp8(model, fp8_dtype)
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.to_fp8_flavour(fp8_dtype)
