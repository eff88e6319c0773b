"""Block-scale fp8 checkpoints (`quant_method: fp8` with `weight_block_size: [bn, bk]`: DeepSeek-V3/R1, Kimi-K2,
Qwen3-*-FP8): every quantised projection stores `weight` (fp8 e4m3fn) and `weight_scale_inv` (float32, one value per
bn x bk tile, a multiplier despite its name); activations are quantised per token per bk columns at run time.

Swapped in before loading, like per-tensor fp8 (models/fp8.py): linear layers become BlockFp8Linear
(BLOCK_FP8_LINEAR), routed experts keep fp8 weights with their block scales (FUSED_MOE dequantises per block), and a
weight the model reads as a tensor (DenseWeight: MLA's kv_b_proj) is dequantised to the model dtype after loading.
Routers and the lm_head are never quantised (checkpoints keep them in bf16).

Fused projections (q/k/v, gate/up, MLA's q_a + kv_a) stack their shards' scale rows: a shard must start on a block
boundary (all but the last must fill whole blocks), and a tensor-parallel rank's rows and columns must too.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from resin import hal
from resin.hal.fp8 import expand_block_scales
from resin.models.layers import DenseWeight, Linear, default_loader, reduce_rows, take

Block = tuple[int, int]


def _blocks(size: int, block: int) -> int:
    return -(-size // block)


def _aligned(what: str, start: int, size: int, total: int, block: int) -> None:
    if start % block or (size % block and start + size != total):
        raise ValueError(f"{what} [{start}, {start + size}) of {total} does not fall on {block}-wide scale blocks; "
                         f"block-scale fp8 needs shard and tensor-parallel splits on block boundaries (choose a "
                         f"tensor_parallel_size that divides the layer into whole blocks)")


class BlockFp8Linear(nn.Module):
    """y = block_fp8_linear(x, W, block scales) + b, for a Linear, MergedLinear (shards at offsets) or RowLinear
    (columns in_part), whole or as this rank's slice."""

    def __init__(self, linear: Linear, block: Block):
        super().__init__()
        self.block = block
        bn, bk = block
        out_features, in_features = linear.weight.shape
        self.offsets: dict[Any, tuple[int, int]] = getattr(linear, "offsets", {})
        self.parts: dict[Any, tuple[int, int]] = getattr(linear, "parts", {})
        self.in_part: tuple[int, int] | None = getattr(linear, "in_part", None)
        for shard, (start, size) in self.offsets.items():
            _aligned(f"{shard} rows", start, size, out_features, bn)
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.zeros(_blocks(out_features, bn), _blocks(in_features, bk)),
                                             requires_grad=False)
        self.weight.weight_loader, self.weight_scale_inv.weight_loader = self._load_weight, self._load_scale
        self.weight.reads_slices = self.weight_scale_inv.reads_slices = True
        self.bias = linear.bias
        if list(self.offsets) not in ([], [None]):
            self.weight.shards = self.weight_scale_inv.shards = list(self.offsets)

    def _local(self, param: torch.Tensor, shard: Any, block: int) -> torch.Tensor:
        """The rows of `param` that shard fills (block: rows per param row: 1 for the weight, bn for scales)."""
        if shard not in self.offsets:
            return param.data
        start, size = self.offsets[shard]
        return param.data.narrow(0, start // block, _blocks(size, block))

    def _mine(self, tensor: Any, shard: Any, block: Block) -> torch.Tensor:
        """This rank's part of a checkpoint tensor whose rows / columns each cover block[0] / block[1] weights
        (the weight: (1, 1), checked to split on block boundaries; its scales: the block)."""
        rows, cols = tensor.shape
        weight = block == (1, 1)
        if shard in self.parts:
            start, size = self.parts[shard]
            if weight:
                _aligned(f"rank rows of {shard}", start, size, rows, self.block[0])
            return take(tensor, 0, start // block[0], _blocks(size, block[0]))
        if self.in_part is not None:
            start, size = self.in_part
            if weight:
                _aligned("rank columns", start, size, cols, self.block[1])
            return take(tensor, 1, start // block[1], _blocks(size, block[1]))
        return take(tensor, 0, 0, rows)

    def _load_weight(self, param: nn.Parameter, tensor: Any, shard: Any = None) -> None:
        tensor = self._mine(tensor, shard, (1, 1))
        if tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(f"block-fp8 checkpoint weight has dtype {tensor.dtype}; expected float8_e4m3fn")
        default_loader(self._local(param, shard, 1), tensor)

    def _load_scale(self, param: nn.Parameter, tensor: Any, shard: Any = None) -> None:
        default_loader(self._local(param, shard, self.block[0]), self._mine(tensor, shard, self.block).float())

    def to_fp8_flavour(self, fp8_dtype: torch.dtype | None) -> None:
        """e4m3fn -> e4m3fnuz on gfx942: bits reinterpreted, block scales doubled."""
        if fp8_dtype is None or fp8_dtype == self.weight.dtype:
            return
        w, scale, _ = hal.e4m3fn_to_e4m3fnuz(self.weight.data, self.weight_scale_inv.data)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.weight_scale_inv.data.copy_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_part is not None:
            return reduce_rows(lambda bias: hal.BLOCK_FP8_LINEAR(x, self.weight, self.weight_scale_inv, self.block,
                                                                 bias), self.bias)
        return hal.BLOCK_FP8_LINEAR(x, self.weight, self.weight_scale_inv, self.block, self.bias)


class DequantizedWeight(nn.Module):
    """A DenseWeight read from a block-fp8 checkpoint: loaded as fp8 + scales, dequantised to the model dtype once
    loading is done (`finish`), so the model sees the dense `weight` it expects."""

    def __init__(self, dense: DenseWeight, block: Block):
        super().__init__()
        self.block, self.part, self.dtype = block, dense.part, dense.weight.dtype
        rows, cols = dense.weight.shape
        _aligned("rank rows", self.part[0], rows, self.part[0] + rows, block[0])
        self.weight = nn.Parameter(torch.zeros(rows, cols, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.zeros(_blocks(rows, block[0]), _blocks(cols, block[1])),
                                             requires_grad=False)
        self.weight.weight_loader = lambda p, t, shard=None: default_loader(p, take(t, 0, *self.part))
        self.weight_scale_inv.weight_loader = lambda p, t, shard=None: default_loader(
            p, take(t, 0, self.part[0] // block[0], p.shape[0]).float())
        self.weight.reads_slices = self.weight_scale_inv.reads_slices = True

    def finish(self) -> None:
        dense = self.weight.float() * expand_block_scales(self.weight_scale_inv, self.block, tuple(self.weight.shape))
        self.weight = nn.Parameter(dense.to(self.dtype), requires_grad=False)
        del self.weight_scale_inv


def quantize_block_fp8(model: nn.Module, block: Block, targets: list[tuple[str, nn.Module]]) -> None:
    """Swap the given linear layers, every DenseWeight and every MoE's experts to their block-fp8 forms."""
    for name, module in targets:
        _swap(model, name, BlockFp8Linear(module, block))
    for name, module in list(model.named_modules()):
        if isinstance(module, DenseWeight):
            _swap(model, name, DequantizedWeight(module, block))
        elif hasattr(module, "use_block_fp8"):
            module.use_block_fp8(block)


def finish_block_fp8(model: nn.Module, fp8_dtype: torch.dtype | None) -> None:
    for module in list(model.modules()):
        if isinstance(module, DequantizedWeight):
            module.finish()
        elif isinstance(module, BlockFp8Linear):
            module.to_fp8_flavour(fp8_dtype)
        elif hasattr(module, "use_block_fp8"):
            module.experts_to_fp8_flavour(fp8_dtype)


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
