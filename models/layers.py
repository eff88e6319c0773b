"""Building blocks of model files, each a thin nn.Module over HAL ops (no device code here either).

Parameters that Hugging Face stores as several tensors but Resin computes as one GEMM (q/k/v, gate/up) carry a
`weight_loader(param, tensor, shard)` that copies each checkpoint tensor into its rows.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from resin import hal


def _default_loader(param: nn.Parameter, tensor: torch.Tensor, shard: Any = None) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit parameter of shape "
                         f"{tuple(param.shape)}")
    param.data.copy_(tensor)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = _default_loader
    return p


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hal.LINEAR(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked into one weight: shard i owns rows of size out_sizes[i]."""

    def __init__(self, in_features: int, out_sizes: list[int], shards: list[str], bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__(in_features, sum(out_sizes), bias, dtype)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in zip(shards, out_sizes):
            self.offsets[name] = (start, size)
            start += size
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard: str) -> None:
        start, size = self.offsets[shard]
        _default_loader(param.data.narrow(0, start, size), tensor)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = _param(size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return hal.RMS_NORM(x, self.weight, self.eps)
        return hal.FUSED_ADD_RMS_NORM(x, residual, self.weight, self.eps)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = _param(num_embeddings, dim, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return hal.EMBEDDING(ids, self.weight)


class Rotary(nn.Module):
    def __init__(self, head_size: int, rot_dim: int, max_positions: int, base: float,
                 scaling: dict[str, Any] | None = None, is_neox: bool = True):
        super().__init__()
        self.head_size, self.is_neox = head_size, is_neox
        self.register_buffer("cos_sin_cache", hal.rope_cos_sin_cache(rot_dim, max_positions, base, scaling),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return hal.ROTARY(positions, q, k, self.cos_sin_cache, self.head_size, self.is_neox)


def act_and_mul(name: str):
    """The fused gate activation for an MLP: hidden_act name from the config -> HAL op."""
    if name in ("silu", "swish"):
        return hal.SILU_AND_MUL
    if name in ("gelu", "gelu_pytorch_tanh", "gelu_new"):
        approximate = "none" if name == "gelu" else "tanh"
        return lambda x: hal.GELU_AND_MUL(x, approximate)
    raise ValueError(f"hidden_act {name!r} is not supported; supported: silu, gelu, gelu_pytorch_tanh")
