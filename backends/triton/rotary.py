"""Rotary embedding of q and k in one launch: one program per token, every head of q then k.

Neox style rotates the two halves of the rotary dims, GPT-J style interleaved pairs; dims past rot_dim (partial
rotary) are copied through. Out of place, like the native op.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resin.backends.triton.tuning import Tuning, current


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, src_stride, dst_stride, tok, num_heads, cos, sin, half_offs, half_mask, head_size, rot_half,
                  IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    base = tok * src_stride + heads[:, None] * head_size  # q and k may be views into a fused qkv row
    out = tok * dst_stride + heads[:, None] * head_size
    if IS_NEOX:
        i1 = half_offs
        i2 = half_offs + rot_half
    else:
        i1 = 2 * half_offs
        i2 = 2 * half_offs + 1
    m = hmask[:, None] & half_mask[None, :]
    x1 = tl.load(src_ptr + base + i1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + base + i2[None, :], mask=m, other=0.0).to(tl.float32)
    ty = dst_ptr.dtype.element_ty
    tl.store(dst_ptr + out + i1[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(ty), mask=m)
    tl.store(dst_ptr + out + i2[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(ty), mask=m)
    # pass-through dims (partial rotary)
    d = tl.arange(0, BLOCK_D)
    pm = hmask[:, None] & (d[None, :] >= 2 * rot_half) & (d[None, :] < head_size)
    tl.store(dst_ptr + out + d[None, :], tl.load(src_ptr + base + d[None, :], mask=pm, other=0.0), mask=pm)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr, q_stride, k_stride, cache_stride,
                   q_out_stride, k_out_stride,
                   num_q_heads, num_k_heads, head_size, rot_half, IS_NEOX: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    half_offs = tl.arange(0, BLOCK_HALF)
    half_mask = half_offs < rot_half
    # cos/sin rounded to the activation dtype first, as the native op does.
    ty = q_out_ptr.dtype.element_ty
    cos = tl.load(cache_ptr + pos * cache_stride + half_offs, mask=half_mask, other=0.0).to(ty).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + rot_half + half_offs, mask=half_mask,
                  other=0.0).to(ty).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, q_stride, q_out_stride, tok, num_q_heads, cos, sin, half_offs, half_mask,
                  head_size, rot_half, IS_NEOX, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr, k_out_ptr, k_stride, k_out_stride, tok, num_k_heads, cos, sin, half_offs, half_mask,
                  head_size, rot_half, IS_NEOX, BLOCK_HK, BLOCK_D)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
           head_size: int, is_neox: bool = True, tuning: Tuning | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    tuning = tuning or current()
    num_tokens = positions.shape[0]
    q2, k2 = q.reshape(num_tokens, -1), k.reshape(num_tokens, -1)
    q2 = q2 if q2.stride(-1) == 1 else q2.contiguous()
    k2 = k2 if k2.stride(-1) == 1 else k2.contiguous()
    q_out = torch.empty(q2.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k2.shape, dtype=k.dtype, device=k.device)
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    rot_half = cache.shape[-1] // 2
    hq, hk = q2.shape[1] // head_size, k2.shape[1] // head_size
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, q2, k2, cache, q_out, k_out, q2.stride(0), k2.stride(0), cache.stride(0), q_out.stride(0),
            k_out.stride(0), hq, hk, head_size,
            rot_half, IS_NEOX=is_neox, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
            BLOCK_HALF=triton.next_power_of_2(rot_half), BLOCK_D=triton.next_power_of_2(head_size),
            **tuning.launch(tuning.elementwise_warps))
    return q_out.view(q.shape), k_out.view(k.shape)
