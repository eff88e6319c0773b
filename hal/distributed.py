"""Tensor parallelism's side of the HAL: the process group a model's layers shard over, and the collectives they
call as ops.

The group is set once per process at startup (resin/parallel.py), before the model is built, like the selected
backend; a process that never sets one is rank 0 of 1 and every collective is the identity. Layers read it when
they size their shards and when they reduce.

Collectives are HAL ops whose native implementations are torch.distributed's (gloo on a CPU, NCCL on NVIDIA, RCCL
through the same API on ROCm). The startup self-check does not replay them against native: a collective has no
single-rank answer to compare with, and every rank would have to replay it in lockstep.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from resin.hal.registry import Op


@dataclass(frozen=True)
class ParallelGroup:
    rank: int = 0
    world: int = 1
    device_group: Any = None  # the model's collectives (NCCL/RCCL on GPUs, gloo on a CPU)
    cpu_group: Any = None  # host-side messages: the step inputs rank 0 broadcasts (always gloo)
    expert_parallel: bool = False  # MoE layers place whole experts on ranks instead of splitting each expert
    host_exchange: Any = None  # CPU ranks of one machine: a shared-memory segment for fast collectives
    # What GPU collective providers set up for this group on their first call (peer-mapped buffers, by provider
    # name); each has close(), called when the process leaves the group.
    device_resources: dict[str, Any] = field(default_factory=dict)


_GROUP = ParallelGroup()


def parallel() -> ParallelGroup:
    return _GROUP


def set_parallel(group: ParallelGroup) -> None:
    global _GROUP
    _GROUP = group


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when `total` items are split into `parts` as evenly as they go: the first
    total % parts parts hold one more. Uneven splits let a 9-head model run on 2 ranks."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


def rank_range(total: int) -> tuple[int, int]:
    """This rank's (start, size) of `total` items split over the tensor-parallel group."""
    g = parallel()
    return split_range(total, g.world, g.rank)


def row_max(x: torch.Tensor) -> torch.Tensor:
    """The elementwise max of x over the ranks: at load time, a quantisation scale over a row split across ranks
    (not an op: it never runs in a step)."""
    g = parallel()
    if g.world > 1:
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX, group=g.device_group)
    return x


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the tensor-parallel ranks (every rank gets it); x itself on one rank."""
    g = parallel()
    if g.world == 1:
        return x
    torch.distributed.all_reduce(x, group=g.device_group)
    return x


def _all_gather(x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """Every rank's x concatenated along the last dim, in rank order; rank r's x has sizes[r] columns (uneven
    shards are padded to the largest for the collective, then trimmed)."""
    g = parallel()
    if g.world == 1:
        return x
    width = max(sizes)
    if x.shape[-1] < width:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    parts = [torch.empty_like(x) for _ in range(g.world)]
    torch.distributed.all_gather(parts, x.contiguous(), group=g.device_group)
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


ALL_REDUCE = Op("all_reduce", _all_reduce, self_checked=False)
ALL_GATHER = Op("all_gather", _all_gather, self_checked=False)
