"""The cpu backend's C++ linear, ahead of oneDNN where it measured faster (bench/linear_rows.py).

bf16, on CPUs with AVX512-BF16 (csrc/bf16_linear.cpp): a GEMM over the weight packed once into panels of output
rows, each panel one sequential stream. The panels are made on first use and kept on the weight tensor, as
oneDNN's reordered copy is (weight memory doubles; the original stays for native and any other provider). 2-core
Zen 4 (AVX512-BF16, no AMX), every projection of the built-in model's 30 layers and its lm_head in turn, weights
from memory, against oneDNN over its prepacked weight: 1.6-3x faster at 1-8 rows, ~1.3x at 32, ~1.2x at 64-512,
even at 1,024 (the numbers are in the note of the commit that added it and reproduce with the script), so without
AMX it takes every row count. Where oneDNN has AMX tiles its GEMM wins from 2 rows (measured on a Xeon against
the row-major GEMV this replaced: batch 4 steps 19.3 ms on oneDNN against 28.2), so there it takes batch-1 decode
only, at the cost of a third copy of the weights (unmeasured on AMX hardware since the panels replaced the GEMV).

fp32, on AVX2 + FMA (csrc/fp32_linear.cpp): a few-row GEMM over the weight as it lies. 2-core Zen 3, the same
weights (540 MB of fp32), medians of 5: oneDNN / this kernel 1.86x at 8 rows, 1.49x at 16, 1.11x at 32, 1.02x at
40, 0.96x at 64; the step at batch 16 fell from ~85 to ~65 ms. Below 8 rows it replaced a GEMV 1.1-1.8x slower.
"""
from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from resin.backends.cpu import kernels
from resin.hal.platform import Platform
from resin.hal.registry import derived

FP32_LINEAR_MAX_ROWS = 32
BF16_MAX_ROWS_AMX = 1


def dtypes(cpu_flags: frozenset[str] | set[str]) -> frozenset[torch.dtype]:
    """The dtypes Resin's C++ linear covers on a CPU with these flags: bf16 with AVX512-BF16 (the panel GEMM),
    fp32 with AVX2 + FMA (a few-row GEMM)."""
    return frozenset(({torch.bfloat16} if "avx512_bf16" in cpu_flags else set()) |
                     ({torch.float32} if {"avx2", "fma"} <= cpu_flags else set()))


@cache
def _dtypes() -> frozenset[torch.dtype]:
    from resin.hal.platform import cpu_platform

    return dtypes(cpu_platform().cpu_flags)


@cache
def max_rows(dtype: torch.dtype) -> int | None:
    """The most rows the kernel for dtype takes here (None: any number)."""
    if dtype == torch.float32:
        return FP32_LINEAR_MAX_ROWS
    return BF16_MAX_ROWS_AMX if kernels.amx_gemm() else None


def supported(platform: Platform) -> tuple[bool, str]:
    if not dtypes(platform.cpu_flags):
        return False, "Resin's C++ linear needs AVX512-BF16 (bf16) or AVX2 + FMA (fp32)"
    return kernels.supported(platform)


def supports_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    if x.dtype != weight.dtype or x.dtype not in _dtypes() or not x.is_cpu or weight.dim() != 2:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in _dtypes()))
        return f"x and a 2-D weight of one dtype this CPU's C++ linear covers ({names or 'none'}) on the cpu"
    most = max_rows(x.dtype)
    if x.dim() != 2 or x.shape[0] < 1 or (most is not None and x.shape[0] > most):
        return f"2-D x of 1 to {most or 'any number of'} rows (oneDNN's GEMM is faster beyond)"
    if not weight.is_contiguous() or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous())):
        return "contiguous weight, bias of x's dtype"
    if x.dtype == torch.bfloat16 and weight.shape[1] % 2:
        return "an even number of input features (the bf16 kernel multiplies pairs)"
    return None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 -> (ceil(N / W), K / 2, W) int32 panels, W = bf16_panel_width(): panel q's word [p, j] holds
    weights 2p and 2p + 1 of output row q W + j (rows past N are zero), the layout csrc/bf16_panels.h reads."""
    width = kernels.extension().bf16_panel_width()
    n, k = weight.shape
    pairs = F.pad(weight.detach().contiguous().view(torch.int32), (0, 0, 0, -n % width))
    return pairs.view(-1, width, k // 2).transpose(1, 2).contiguous()


def cpp_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dtype == torch.float32:
        return kernels.extension().fp32_linear(x, weight, bias)
    panels = derived(weight, "bf16_panels", lambda: pack_panels(weight))
    return kernels.extension().bf16_panel_linear(x.contiguous(), panels, weight.shape[0], bias)
