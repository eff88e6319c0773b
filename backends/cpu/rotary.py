"""Neox-style rotary in a few whole-tensor ops: out = x * [cos|cos] + swap_halves(x) * [-sin|sin].

The native op spends ~15 small ops per call (and a dtype cast of cos/sin each time), which at batch-1 decode cost
~70 us a layer on this 2-core CPU; this form is ~25 us. Tables in the activation dtype are made once per cache
tensor. When q and k are adjacent column blocks of one row (the fused qkv projection's output), both are rotated
in one pass. Every product and sum rounds exactly where native's do (-sin is exact), so results are bit-equal.
Partial rotary and GPT-J style fall through to native.
"""
from __future__ import annotations

import torch

from resin.hal.registry import derived


def supports_args(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                  head_size: int, is_neox: bool = True) -> str | None:
    if not is_neox:
        return "GPT-J style rotary"
    if cos_sin_cache.shape[-1] != head_size:
        return "partial rotary"
    if q.dim() != 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        return "q/k not (tokens, heads * head_size) with contiguous rows"
    return None


def _table(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(max_pos, 2, head_size): [cos | cos] and [-sin | sin] in the activation dtype."""
    def make() -> torch.Tensor:
        cos, sin = cache.chunk(2, dim=-1)
        return torch.stack((torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)),
                           dim=1).contiguous()
    return derived(cache, ("cpu_rope", dtype), make)


def _rotate(x: torch.Tensor, table: torch.Tensor, half: int) -> torch.Tensor:
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * table[:, 0:1] + swapped * table[:, 1:2]


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
           head_size: int, is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    t = positions.shape[0]
    table = _table(cos_sin_cache, q.dtype).index_select(0, positions)  # (T, 2, D)
    half = head_size // 2
    hq, hk = q.shape[1] // head_size, k.shape[1] // head_size
    adjacent = (q.dtype == k.dtype and q.stride(0) == k.stride(0) and q.storage_offset() + q.shape[1]
                == k.storage_offset() and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr())
    if adjacent:
        qk = q.as_strided((t, hq + hk, head_size), (q.stride(0), head_size, 1))
        out = _rotate(qk, table, half)
        return out[:, :hq].reshape(t, hq * head_size), out[:, hq:].reshape(t, hk * head_size)
    rq = _rotate(q.view(t, hq, head_size), table, half)
    rk = _rotate(k.reshape(t, hk, head_size), table, half)
    return rq.reshape(q.shape), rk.reshape(k.shape)
