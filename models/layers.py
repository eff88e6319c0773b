"""Building blocks of model files, each a thin nn.Module over HAL ops (no device code here either).

Parameters that Hugging Face stores as several tensors but Resin computes as one GEMM (q/k/v, gate/up) carry a
`weight_loader(param, tensor, shard)` that copies each checkpoint tensor into its rows.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from resin import hal


def default_loader(param: nn.Parameter, tensor: torch.Tensor, shard: Any = None) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit parameter of shape "
                         f"{tuple(param.shape)}")
    param.data.copy_(tensor)


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = default_loader
    return p


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = param(out_features, in_features, dtype=dtype)
        self.bias = param(out_features, dtype=dtype) if bias else None

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
                p.shards = list(shards)

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard: str) -> None:
        start, size = self.offsets[shard]
        default_loader(param.data.narrow(0, start, size), tensor)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up as one GEMM: the dense MLP of every family here."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [inter, inter], ["gate", "up"], bias, dtype)
        self.down_proj = Linear(inter, hidden, bias, dtype)
        self.act = act_and_mul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoe(nn.Module):
    """A mixture-of-experts MLP: a router picks top_k experts per token (MOE_ROUTE, softmax scoring), the experts
    run fused (FUSED_MOE). Expert weights are stacked: w13 (E, 2I, H) = [gate | up] rows, w2 (E, H, I); each
    checkpoint tensor loads into its slice, shard ("gate" | "up", expert) or expert."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, renormalize: bool,
                 act: str = "silu", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.top_k, self.renormalize, self.inter = top_k, renormalize, inter
        if act not in ("silu", "swish", "gelu"):
            raise ValueError(f"MoE hidden_act {act!r} is not supported; supported: silu, gelu")
        self.act = "gelu" if act == "gelu" else "silu"
        self.gate = Linear(hidden, num_experts, dtype=dtype)
        self.w13 = param(num_experts, 2 * inter, hidden, dtype=dtype)
        self.w13.weight_loader = self._load_w13
        self.w13.shards = [(which, e) for e in range(num_experts) for which in ("gate", "up")]
        self.w2 = param(num_experts, hidden, inter, dtype=dtype)
        self.w2.weight_loader = self._load_w2
        self.w2.shards = list(range(num_experts))

    def _load_w13(self, param: nn.Parameter, tensor: torch.Tensor, shard: tuple[str, int]) -> None:
        which, expert = shard
        default_loader(param.data[expert].narrow(0, 0 if which == "gate" else self.inter, self.inter), tensor)

    def _load_w2(self, param: nn.Parameter, tensor: torch.Tensor, expert: int) -> None:
        default_loader(param.data[expert], tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = hal.MOE_ROUTE(self.gate(x), self.top_k, "softmax", self.renormalize)
        return hal.FUSED_MOE(x, self.w13, self.w2, weights, ids, self.act)


class RMSNorm(nn.Module):
    """weight_offset: a checkpoint that stores the scale as an offset (Gemma's 1 + w) is loaded as the scale."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype = torch.float32, weight_offset: float = 0.0):
        super().__init__()
        self.weight = param(size, dtype=dtype)
        self.eps = eps
        if weight_offset:
            self.weight.weight_loader = lambda param, tensor, shard=None: default_loader(param, tensor + weight_offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return hal.RMS_NORM(x, self.weight, self.eps)
        return hal.FUSED_ADD_RMS_NORM(x, residual, self.weight, self.eps)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = param(num_embeddings, dim, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return hal.EMBEDDING(ids, self.weight)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits through the table: the lm_head of a model with tied embeddings."""
        return hal.LINEAR(hidden, self.weight)


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
