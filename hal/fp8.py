"""fp8 w8a8: activation quantisation, the fp8 linear op, and the e4m3fn -> e4m3fnuz checkpoint conversion.

Two encodings of 4-bit-exponent fp8 exist: e4m3fn (NVIDIA, gfx950; max 448) and e4m3fnuz (gfx942; max 240, no
negative zero, 0x80 is NaN, exponent bias one higher). The same bits read as fnuz are half the fn value, so a
checkpoint converts by reinterpreting the bits and doubling its scales; the one fn pattern with no fnuz value,
0x80 (-0.0), becomes 0.
"""
from __future__ import annotations

import torch

from resin.hal.registry import Op

FP8_DTYPES = tuple(d for d in (torch.float8_e4m3fn, getattr(torch, "float8_e4m3fnuz", None)) if d is not None)
_MIN_SCALE = 1e-12  # an all-zero row quantises with this scale instead of dividing by zero


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype,
                 scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) -> (fp8 (T, K), float32 scale): given a static per-tensor scale, or dynamic per token (T, 1)."""
    fmax = torch.finfo(dtype).max
    xf = x.float()
    if scale is None:
        scale = (xf.abs().amax(-1, keepdim=True) / fmax).clamp_min(_MIN_SCALE)
    scale = scale.float()
    return (xf / scale).clamp(-fmax, fmax).to(dtype), scale


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequant(weight).T + bias with x quantised to the weight's fp8 flavour first (w8a8).

    weight (N, K) fp8; weight_scale per tensor (a single value) or per output channel (N or (N, 1));
    input_scale static per tensor, or None for dynamic per-token scales. Products accumulate in fp32; the result
    has x's dtype.
    """
    xq, xs = quantize_fp8(x.reshape(-1, x.shape[-1]), weight.dtype, input_scale)
    out = (xq.float() @ weight.float().T) * xs.reshape(-1, 1) * weight_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def quantize_fp8_groups(x: torch.Tensor, dtype: torch.dtype, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) -> (fp8 (T, K), float32 scales (T, ceil(K / group))): one scale per token per `group` columns
    (DeepSeek-V3's activation quantisation, group = the weight's block width), amax / fp8 max."""
    t, k = x.shape
    fmax = torch.finfo(dtype).max
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(t, groups, group)
    scale = (xf.abs().amax(-1, keepdim=True) / fmax).clamp_min(_MIN_SCALE)
    q = (xf / scale).clamp(-fmax, fmax).to(dtype).view(t, groups * group)[:, :k]
    return q, scale.view(t, groups)


def expand_block_scales(scales: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """(ceil(N / bn), ceil(K / bk)) per-block scales -> (N, K), each block's value over its tile."""
    n, k = shape
    return scales.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def _block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Block-scale fp8 w8a8 (DeepSeek-V3, Qwen3-*-FP8): x @ dequant(weight).T + bias.

    weight (N, K) fp8 with one scale per block[0] x block[1] tile: weight_scale (ceil(N / bn), ceil(K / bk)), the
    checkpoint's `weight_scale_inv` (a multiplier, despite the name). x is quantised to the weight's flavour per
    token per bk columns. The reference: both dequantised to fp32, then one matmul; the result has x's dtype.
    """
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8_groups(x2, weight.dtype, block[1])
    xd = xq.float() * xs.repeat_interleave(block[1], 1)[:, :x2.shape[1]]
    out = xd @ (weight.float() * expand_block_scales(weight_scale, block, tuple(weight.shape))).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def e4m3fn_to_e4m3fnuz(weight: torch.Tensor, weight_scale: torch.Tensor,
                       input_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reinterpret e4m3fn bits as e4m3fnuz (-0.0 -> 0) and double the scales, so every product is unchanged."""
    bits = weight.view(torch.int8).clone()
    bits[bits == -128] = 0
    return (bits.view(torch.float8_e4m3fnuz), weight_scale * 2.0,
            input_scale * 2.0 if input_scale is not None else None)


FP8_LINEAR = Op("fp8_linear", _fp8_linear)
BLOCK_FP8_LINEAR = Op("block_fp8_linear", _block_fp8_linear)
