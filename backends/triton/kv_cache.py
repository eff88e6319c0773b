"""KV-cache write by slot mapping into the (2, num_blocks, block_size, kv_heads, head_size) layout.

A slot of -1 means "no slot" (padding rows of a replayed graph) and is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resin.backends.triton.tuning import Tuning, current


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, k_stride, v_stride, plane, row_size,
                     BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_size
        ty = cache_ptr.dtype.element_ty
        k = tl.load(k_ptr + tok * k_stride + offs, mask=mask).to(ty)
        v = tl.load(v_ptr + tok * v_stride + offs, mask=mask).to(ty)
        tl.store(cache_ptr + slot * row_size + offs, k, mask=mask)
        tl.store(cache_ptr + plane + slot * row_size + offs, v, mask=mask)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             tuning: Tuning | None = None) -> None:
    tuning = tuning or current()
    _, nb, bs, hk, d = kv_cache.shape
    num_tokens = slot_mapping.shape[0]
    k2, v2 = k.reshape(num_tokens, hk * d), v.reshape(num_tokens, hk * d)
    k2 = k2 if k2.stride(-1) == 1 else k2.contiguous()
    v2 = v2 if v2.stride(-1) == 1 else v2.contiguous()
    row = hk * d
    block = min(triton.next_power_of_2(row), 2048)
    if num_tokens:
        _write_kv_kernel[(num_tokens, triton.cdiv(row, block))](
            k2, v2, kv_cache, slot_mapping, k2.stride(0), v2.stride(0), nb * bs * row, row, BLOCK=block,
            **tuning.launch(tuning.elementwise_warps))
