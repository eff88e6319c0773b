"""The cpu backend's C++ linear, ahead of oneDNN where it measured faster (bench/linear_rows.py).

bf16, on CPUs with AVX512-BF16 (csrc/bf16_linear.cpp): a GEMM over the weight packed once into panels of output
rows, each panel one sequential stream. The panels are made on first use and kept on the weight tensor, as
oneDNN's reordered copy is (weight memory doubles; the original stays for native and any other provider). 2-core
Zen 4 (AVX512-BF16, no AMX), every projection of the built-in model's 30 layers and its lm_head in turn, weights
from memory, against oneDNN over its prepacked weight (`python bench/linear_rows.py`, one run): 1.4-1.6x as fast at
1-16 rows, 1.22x at 32, 1.09-1.15x at 64-256, 1.02-1.04x at 512-1,024, so it takes every row count. Where
oneDNN has AMX tiles its GEMM wins from 2 rows (measured on a Xeon against the row-major GEMV the panels replaced:
batch 4 steps 19.3 ms on oneDNN against 28.2, batch 1 16.5 against 15.0), and panels for batch 1 alone would make
a third copy of every weight beside oneDNN's, so there bf16 stays on oneDNN (the panels are unmeasured on AMX
hardware). A bias is added in fp32 before the one rounding; its fp32 copy is made once and kept on the bias.

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


def dtypes(cpu_flags: frozenset[str] | set[str]) -> frozenset[torch.dtype]:
    """The dtypes Resin's C++ linear covers on a CPU with these flags: bf16 with AVX512-BF16 and no AMX (the panel
    GEMM), fp32 with AVX2 + FMA (a few-row GEMM)."""
    return frozenset(({torch.bfloat16} if "avx512_bf16" in cpu_flags and "amx_bf16" not in cpu_flags else set()) |
                     ({torch.float32} if {"avx2", "fma"} <= cpu_flags else set()))


@cache
def _dtypes() -> frozenset[torch.dtype]:
    """dtypes() of this CPU, less bf16 where the compiler built the kernels without AVX512-BF16 (an old GCC)."""
    from resin.hal.platform import cpu_platform

    found = dtypes(cpu_platform().cpu_flags)
    if torch.bfloat16 in found and not kernels.extension().bf16_panels_available():
        return found - {torch.bfloat16}
    return found


def supported(platform: Platform) -> tuple[bool, str]:
    if not dtypes(platform.cpu_flags):
        return False, "Resin's C++ linear needs AVX512-BF16 (bf16) or AVX2 + FMA (fp32)"
    return kernels.supported(platform)


def supports_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    if x.dtype != weight.dtype or x.dtype not in _dtypes() or not x.is_cpu or weight.dim() != 2:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in _dtypes()))
        return f"x and a 2-D weight of one dtype this CPU's C++ linear covers ({names or 'none'}) on the cpu"
    if x.dim() != 2 or x.shape[0] < 1 or weight.shape[1] < 1:
        return "2-D x of one row or more, and at least one input feature"
    if x.dtype == torch.float32 and x.shape[0] > FP32_LINEAR_MAX_ROWS:
        return f"fp32 with 1 to {FP32_LINEAR_MAX_ROWS} rows (oneDNN's GEMM is faster beyond)"
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
    bias32 = None if bias is None else derived(bias, "fp32", lambda: bias.detach().float())
    return kernels.extension().bf16_panel_linear(x.contiguous(), panels, weight.shape[0], bias32)
