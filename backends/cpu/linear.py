"""bf16 linear through oneDNN with the weight reordered once into oneDNN's blocked layout.

torch's plain F.linear reaches oneDNN too, but reorders the weight on every call; for the one-row GEMVs of
batch-1 decode that reorder dominates (measured 8x slower for a 576x3072 projection). The reordered weight is
made on first use and kept on the weight tensor itself (weight memory doubles; the original stays for any
other provider and for native). Only bf16: it matched F.linear bit for bit there, while in fp32 oneDNN's
blocking changes rounding, and fp32 is the reference dtype.
"""
from __future__ import annotations

import torch

from resin.hal.platform import Platform
from resin.hal.registry import derived

_LINEAR_POINTWISE = (torch.ops.mkldnn._linear_pointwise.default
                     if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None)


def supported(platform: Platform) -> tuple[bool, str]:
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False, "this torch build has no oneDNN linear"
    if not platform.has_native_bf16_matmul():
        return False, "no native bf16 matmul on this CPU (needs AVX512-BF16 or AMX)"
    return True, ""


def supports_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    if weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        return "onednn linear is used for bf16 only"
    if x.device.type != "cpu" or weight.dim() != 2:
        return "onednn linear needs a 2-D weight on the CPU"
    return None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # Kept lean: at batch-1 decode this runs ~120 times a step on GEMVs of tens of microseconds, so each
    # microsecond of Python here is ~0.1 ms a step (the overload is resolved once, at import).
    packed = derived(weight, "onednn_packed", lambda: torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))
    if x.dim() == 2:
        return _LINEAR_POINTWISE(x, packed, bias, "none", [], "")
    out = _LINEAR_POINTWISE(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])
