"""fp8 w8a8 through torch._scaled_mm (cuBLASLt on NVIDIA sm_89+, hipBLASLt on gfx942/gfx950; rocm registers this
too). Weight (N, K) row-major is passed as its transpose, the column-major (K, N) B operand _scaled_mm wants.
Scales: one per tensor on both sides, or row-wise (per-token (M, 1) x per-channel (1, N)) with bf16 output, the
combination vLLM uses; anything else is left to the Triton GEMM. Activations are quantised per token by the
shared Triton kernel.

UNTESTED ON HARDWARE here (no GPU in this project so far); tests/gpu/test_kernels_gpu.py checks it against native.
"""
from __future__ import annotations

import re

import torch

from resin.hal.platform import Platform


def supported(platform: Platform) -> tuple[bool, str]:
    if platform.kind not in ("cuda", "rocm"):
        return False, "needs a GPU"
    if platform.fp8_dtype is None:
        return False, f"{platform.arch}: no fp8"
    if "triton" not in platform.libraries:
        return False, "activation quantisation needs triton (pip install 'resin[triton]')"
    return True, ""


def supports_args(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> str | None:
    n, k = weight.shape
    if n % 16 or k % 16:
        return f"(N, K)=({n}, {k}) not multiples of 16"
    per_tensor = weight_scale.numel() == 1 and input_scale is not None
    if not per_tensor and x.dtype != torch.bfloat16:
        return "row-wise scales need bf16 output"
    return None


_REFUSED = "_resin_scaled_mm_refused"  # set on a weight whose GEMM torch._scaled_mm rejected at run time


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch._scaled_mm; where this torch/BLAS build rejects the scale layout (row-wise needs torch >= 2.7 on
    ROCm and hipBLASLt), the Triton GEMM serves this weight from then on."""
    from resin.backends.triton.fp8 import fp8_linear as triton_fp8_linear
    from resin.backends.triton.fp8 import quantize_fp8

    if getattr(weight, _REFUSED, False):
        return triton_fp8_linear(x, weight, weight_scale, input_scale, bias)

    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8(x2, weight.dtype, input_scale)
    n = weight.shape[0]
    if weight_scale.numel() == 1 and input_scale is not None:
        scale_a, scale_b = xs.reshape(()), weight_scale.float().reshape(())
    else:
        scale_a = xs.reshape(-1, 1).expand(x2.shape[0], 1).contiguous()
        scale_b = weight_scale.float().reshape(1, -1).expand(1, n).contiguous()
    try:
        out = torch._scaled_mm(xq, weight.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=x.dtype)
    except RuntimeError as e:
        if not is_layout_refusal(e):
            raise  # out of memory, a device fault: not a reason to route this weight elsewhere forever
        setattr(weight, _REFUSED, True)
        return triton_fp8_linear(x, weight, weight_scale, input_scale, bias)
    return out.reshape(*x.shape[:-1], n)


# What torch._scaled_mm says when this torch/BLAS build does not take a scale layout or dtype combination
# ("Invalid scaling configuration", "... RowWise scaling ...", "... only supported on ...",
# CUBLAS_STATUS_NOT_SUPPORTED).
_REFUSAL = re.compile(r"scaling|scale_[ab]|rowwise|not[ _]supported|only supported|not compiled", re.IGNORECASE)


def is_layout_refusal(error: RuntimeError) -> bool:
    return not isinstance(error, torch.OutOfMemoryError) and _REFUSAL.search(str(error)) is not None
