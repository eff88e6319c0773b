"""aiter rotary: `rotary_embedding_fwd(positions, query, key, head_size, cos_cache, sin_cache, is_neox,
is_nope_first)` (same in v0.1.7 and v0.1.20). In place on q and k, which the ROTARY contract allows; positions
int64; q/k 2-D (T, heads * head_size) with any token stride; cos and sin separate contiguous caches of
(max_pos, rot_dim / 2) in q's dtype, derived once per (cache, dtype) and kept beside the cache tensor."""
from __future__ import annotations

import torch

from resin.backends.rocm.aiter import aiter_module
from resin.hal.registry import derived


def supports_args(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *args, **kwargs) -> str | None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype}: aiter rotary takes fp16/bf16"
    if q.dim() != 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        return "aiter rotary wants 2-D q/k with contiguous rows"
    return None


def _cos_sin(cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cache.chunk(2, dim=-1)
        return cos.to(dtype).contiguous(), sin.to(dtype).contiguous()
    return derived(cache, ("aiter_cos_sin", dtype), make)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
           head_size: int, is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = _cos_sin(cos_sin_cache, q.dtype)
    aiter_module().rotary_embedding_fwd(positions.long(), q, k, head_size, cos, sin, is_neox, False)
    return q, k
