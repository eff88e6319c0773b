"""Linear through oneDNN: bf16 with the weight reordered once into oneDNN's blocked layout, fp32 as it lies.

bf16 (where the CPU multiplies it natively): torch's plain F.linear reaches oneDNN too, but reorders the weight on
every call; for the one-row GEMVs of batch-1 decode that reorder dominates (measured 8x slower for a 576x3072
projection). The reordered weight is made on first use and kept on the weight tensor itself (weight memory
doubles; the original stays for any other provider and for native). It matched F.linear bit for bit.

fp32 (beyond the rows the few-row GEMM of backends/cpu/cpp_linear.py takes): F.linear is MKL's sgemm, which on a
2-core Zen 3 ran the built-in model's projections at 9-64 rows at 0.4-0.9x oneDNN's speed (its 49152-row lm_head
at 32 rows 27 ms against 18). There oneDNN takes the plain weight: packing it too gained 2% of a 32-row step (110
against 113 ms) for twice the weight memory. oneDNN sums in its own order, so fp32 results differ from MKL's
within fp32 reassociation (the few-row kernels' bound too; tests/test_cpu_providers). From MKL_FP32_MIN_ROWS rows
(a prefill chunk) the order turns: MKL's sgemm reaches ~95% of the FMA units' peak there and oneDNN does not, so
this provider declines fp32 with that many rows where torch has MKL and native's F.linear (MKL) serves.
"""
from __future__ import annotations

from functools import cache

import torch

from resin.hal.platform import Platform
from resin.hal.registry import derived

_LINEAR_POINTWISE = (torch.ops.mkldnn._linear_pointwise.default
                     if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None)


def supported(platform: Platform) -> tuple[bool, str]:
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False, "this torch build has no oneDNN linear"
    return True, ""


# fp32 rows from which MKL's GEMM beats oneDNN's: 2-core Zen 3, every projection of the built-in model's 30 layers in
# turn (fp32 weights from memory), medians of 5: oneDNN / MKL / GFLOP/s at 64 rows 112 / 115, 128: 139 / 138,
# 256: 151 / 160, 1024: 161 / 176 (the two cores' fma peak, measured: 186). Not measured on other CPUs.
MKL_FP32_MIN_ROWS = 256


@cache
def _dtypes() -> frozenset[torch.dtype]:
    from resin.hal.platform import cpu_platform

    return frozenset({torch.float32} | ({torch.bfloat16} if cpu_platform().has_native_bf16_matmul() else set()))


def supports_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    if x.dtype != weight.dtype or x.dtype not in _dtypes() or (bias is not None and bias.dtype != x.dtype):
        return "onednn linear: fp32, or bf16 where the CPU multiplies it natively (AVX512-BF16 or AMX)"
    if x.device.type != "cpu" or weight.dim() != 2:
        return "onednn linear needs a 2-D weight on the CPU"
    if x.dtype == torch.float32 and x.numel() >= MKL_FP32_MIN_ROWS * x.shape[-1] and torch.backends.mkl.is_available():
        return f"fp32 with {MKL_FP32_MIN_ROWS} rows or more: MKL's GEMM (native) is faster there"
    return None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # Kept lean: at batch-1 decode this runs ~120 times a step on GEMVs of tens of microseconds, so each
    # microsecond of Python here is ~0.1 ms a step (the overload is resolved once, at import).
    packed = weight if x.dtype == torch.float32 else \
        derived(weight, "onednn_packed", lambda: torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))
    if x.dim() == 2:
        return _LINEAR_POINTWISE(x, packed, bias, "none", [], "")
    out = _LINEAR_POINTWISE(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])
