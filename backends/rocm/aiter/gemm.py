"""aiter fp8 w8a8 GEMMs.

- `gemm_a8w8_CK(XQ (M, K), WQ (N, K), x_scale (M, 1), w_scale (N, 1), bias (1, N), dtype)` -> (M, N), per-token
  activation and per-channel weight scales (a per-tensor scale is broadcast to those shapes).
- `gemm_a8w8_blockscale(XQ (M, K), WQ (N, K), x_scale (M, ceil(K / 128)), w_scale (ceil(N / 128), ceil(K / 128)),
  dtype)` -> (M, N): DeepSeek-V3's block-scale format; its CK kernels are built for 128 x 128 blocks only.
Activations are quantised by the shared Triton kernels (per token, or per token per 128 columns)."""
from __future__ import annotations

import torch

from resin.backends.rocm.aiter import aiter_module


def supports_args(x: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> str | None:
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"{x.dtype}: gemm_a8w8 writes fp16/bf16"
    n, k = weight.shape
    if n % 16 or k % 16:
        return f"(N, K)=({n}, {k}) not multiples of 16"
    return None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    from resin.backends.triton.fp8 import quantize_fp8

    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8(x2, weight.dtype, input_scale)
    n = weight.shape[0]
    x_scale = xs.reshape(-1, 1).expand(x2.shape[0], 1).contiguous()
    w_scale = weight_scale.float().reshape(-1, 1).expand(n, 1).contiguous()
    out = aiter_module().gemm_a8w8_CK(xq, weight, x_scale, w_scale, bias.reshape(1, n) if bias is not None else None,
                                      x.dtype)
    return out.reshape(*x.shape[:-1], n)


def block_supports_args(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                        bias: torch.Tensor | None = None) -> str | None:
    if tuple(block) != (128, 128):
        return f"{block[0]}x{block[1]} scale blocks: aiter's blockscale GEMM takes 128x128"
    if bias is not None:
        return "a bias: gemm_a8w8_blockscale has none"
    return supports_args(x, weight)


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    from resin.backends.triton.block_fp8 import quantize_fp8_groups

    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8_groups(x2, weight.dtype, block[1])
    out = aiter_module().gemm_a8w8_blockscale(xq, weight, xs, weight_scale.float().contiguous(), dtype=x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])
