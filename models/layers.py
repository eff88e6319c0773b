"""Building blocks of model files, each a thin nn.Module over HAL ops (no device code here either).

Parameters that Hugging Face stores as several tensors but Resin computes as one GEMM (q/k/v, gate/up) carry a
`weight_loader(param, tensor, shard)` that copies each checkpoint tensor into its rows.

Under tensor parallelism (hal/distributed.py) each rank holds a slice of the weights: column-split projections
(q/k/v, gate/up) hold some output rows, row-split ones (o_proj, down_proj) the matching input columns and sum their
parts with one all-reduce; the embedding and lm_head split the vocabulary. A loader marked `reads_slices` takes its
rows or columns with `take`, which reads only those bytes from a checkpoint file (loader.CheckpointSlice). With one
rank every slice is the whole tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from resin import hal
from resin.hal.distributed import parallel, rank_range, split_range


def take(tensor: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """[start, start + size) of a checkpoint tensor along dim: a view of a loaded tensor, or just those bytes read
    from the file for a loader.CheckpointSlice."""
    return tensor.narrow(dim, start, size)


def default_loader(param: nn.Parameter, tensor: torch.Tensor, shard: Any = None) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit parameter of shape "
                         f"{tuple(param.shape)}")
    param.data.copy_(tensor)


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = default_loader
    return p


def sliced_loader(p: nn.Parameter, dim: int, part: tuple[int, int]) -> None:
    """p holds rows (dim 0) or columns (dim 1) [start, start + size) of its checkpoint tensor."""
    p.weight_loader = lambda param, tensor, shard=None: default_loader(param, take(tensor, dim, *part))
    p.reads_slices = True


class Linear(nn.Module):
    """A projection every rank holds whole (routers, small heads)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = param(out_features, in_features, dtype=dtype)
        self.bias = param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hal.LINEAR(x, self.weight, self.bias)


class DenseWeight(nn.Module):
    """A weight the model uses as a tensor, never through a GEMM op (MLA's kv_b_proj, split and absorbed): rows
    part = (start, size) of the checkpoint's. A quantised checkpoint's copy is dequantised on load
    (models/block_fp8.py)."""

    def __init__(self, cols: int, part: tuple[int, int], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.part = part
        self.weight = param(part[1], cols, dtype=dtype)
        sliced_loader(self.weight, 0, part)


class MergedLinear(Linear):
    """Column-parallel: one or several projections of the same input stacked into one weight, each split over the
    ranks by output rows. parts[i] = (start, size): the rows of projection i this rank holds (default: an even
    split); shard i loads into rows offsets[shards[i]] of the local weight. One projection: shards=[None]."""

    def __init__(self, in_features: int, out_sizes: list[int], shards: list[Any], bias: bool = False,
                 dtype: torch.dtype = torch.float32, parts: list[tuple[int, int]] | None = None):
        parts = parts or [rank_range(size) for size in out_sizes]
        super().__init__(in_features, sum(size for _, size in parts), bias, dtype)
        self.parts = dict(zip(shards, parts))
        self.offsets: dict[Any, tuple[int, int]] = {}
        start = 0
        for name, (_, size) in zip(shards, parts):
            self.offsets[name] = (start, size)
            start += size
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self._load_shard
                p.reads_slices = True
                if shards != [None]:
                    p.shards = list(shards)

    def _load_shard(self, param: nn.Parameter, tensor: Any, shard: Any = None) -> None:
        start, size = self.offsets[shard]
        default_loader(param.data.narrow(0, start, size), take(tensor, 0, *self.parts[shard]))


def reduce_rows(project: Callable[[torch.Tensor | None], torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """A row-parallel projection's output: every rank's partial product, the bias added by rank 0 alone, summed."""
    g = parallel()
    if g.world == 1:
        return project(bias)
    return hal.ALL_REDUCE(project(bias if g.rank == 0 else None))


class RowLinear(Linear):
    """Row-parallel: the projection after a column-split one (o_proj, down_proj). Each rank holds input columns
    in_part = (start, size), multiplies its own activations and one all-reduce sums the parts (reduce_rows)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32,
                 part: tuple[int, int] | None = None):
        part = part or rank_range(in_features)
        super().__init__(part[1], out_features, bias, dtype)
        self.in_part = part
        sliced_loader(self.weight, 1, part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_rows(lambda bias: hal.LINEAR(x, self.weight, bias), self.bias)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads this rank computes: query heads [q_start, q_start + q_count) and the KV heads they
    read, [kv_start, kv_start + kv_count)."""
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_shard(num_heads: int, num_kv_heads: int) -> HeadShard:
    """KV heads split over the ranks with their query groups (unevenly where they do not divide: 3 KV heads on 2
    ranks are 2 + 1); with fewer KV heads than ranks, each rank takes an equal share of query heads and keeps a copy
    of the one KV head they read (replicated)."""
    g = parallel()
    group = num_heads // num_kv_heads
    if num_kv_heads >= g.world:
        kv_start, kv_count = split_range(num_kv_heads, g.world, g.rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if g.world % num_kv_heads or num_heads % g.world:
        raise ValueError(f"tensor_parallel_size={g.world} does not fit {num_heads} query heads over {num_kv_heads} "
                         f"KV heads: with fewer KV heads than ranks, the ranks must be a multiple of the KV heads "
                         f"and divide the query heads; choose a size that does")
    q_count = num_heads // g.world
    return HeadShard(g.rank * q_count, q_count, g.rank * q_count // group, 1)


class QKVLinear(MergedLinear):
    """q, k and v as one column-parallel GEMM over this rank's heads (head_shard)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        s, d = head_shard(num_heads, num_kv_heads), head_dim
        kv = (s.kv_start * d, s.kv_count * d)
        super().__init__(hidden, [num_heads * d, num_kv_heads * d, num_kv_heads * d], ["q", "k", "v"], bias, dtype,
                         parts=[(s.q_start * d, s.q_count * d), kv, kv])
        self.heads = s
        self.num_heads, self.num_kv_heads = s.q_count, s.kv_count  # this rank's
        self.sizes = [s.q_count * d, s.kv_count * d, s.kv_count * d]

    def o_part(self, head_dim: int) -> tuple[int, int]:
        """The input columns of the output projection that this rank's query heads feed."""
        return self.heads.q_start * head_dim, self.heads.q_count * head_dim


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up as one GEMM: the dense MLP of every family here. Under tensor
    parallelism each rank holds a slice of the intermediate size in both."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        part = rank_range(inter)
        self.gate_up_proj = MergedLinear(hidden, [inter, inter], ["gate", "up"], bias, dtype, parts=[part, part])
        self.down_proj = RowLinear(inter, hidden, bias, dtype, part)
        self.act = act_and_mul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


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


def vocab_sizes(vocab: int) -> tuple[int, ...]:
    """How many vocabulary rows each rank holds, in rank order."""
    g = parallel()
    return tuple(split_range(vocab, g.world, r)[1] for r in range(g.world))


class Embedding(nn.Module):
    """The token table, vocabulary-parallel: each rank holds rows part = (start, size), looks up the ids in its
    range and one all-reduce assembles the rows; as a tied lm_head, each rank's logits are gathered."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.part, self.sizes = rank_range(num_embeddings), vocab_sizes(num_embeddings)
        self.weight = param(self.part[1], dim, dtype=dtype)
        sliced_loader(self.weight, 0, self.part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if parallel().world == 1:
            return hal.EMBEDDING(ids, self.weight)
        start, size = self.part
        mine = (ids >= start) & (ids < start + size)
        rows = hal.EMBEDDING(torch.where(mine, ids - start, 0), self.weight)
        return hal.ALL_REDUCE(rows * mine.unsqueeze(-1).to(rows.dtype))

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits through the table: the lm_head of a model with tied embeddings."""
        logits = hal.LINEAR(hidden, self.weight)
        return logits if parallel().world == 1 else hal.ALL_GATHER(logits, self.sizes)


class LMHead(Linear):
    """The output projection, vocabulary-parallel: each rank computes the logits of its rows, gathered in order."""

    def __init__(self, hidden: int, vocab: int, dtype: torch.dtype = torch.float32):
        part = rank_range(vocab)
        super().__init__(hidden, part[1], dtype=dtype)
        self.part, self.sizes = part, vocab_sizes(vocab)
        sliced_loader(self.weight, 0, part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = hal.LINEAR(x, self.weight)
        return logits if parallel().world == 1 else hal.ALL_GATHER(logits, self.sizes)


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
