"""The cpu provider of quant_linear: Resin's C++ kernels over weights kept quantised (csrc/quant_kernels.cpp).

Few activation rows (decode): each weight row is unpacked once into fp32 and dotted with every activation row in
fp32, so the result differs from native only in summation order; a step reads the packed bytes, not bf16 weights.
Many rows (prefill): the weights are unpacked into the activation dtype and multiplied by torch's GEMM, whose
cost per weight is then shared by enough rows that unpacking is noise. In bf16 that rounds each weight to bf16
once (as a bf16 checkpoint is), which the bf16 tolerance covers; in fp32 it is exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from resin.backends.cpu import kernels
from resin.hal.quant import QTYPES

# Rows from which unpacking the weight and calling the GEMM beats the row-by-row kernel (measured on a 2-core
# AVX512-BF16 machine: Q4_1 1536x576 breaks even at 16 rows, 1.5x faster at 32; bf16 activations).
GEMM_MIN_ROWS = 16
# Weights unpacked per GEMM call: a tile near L2's size (2 MiB a core here) while the GEMM reads it (unpacking a
# whole 49152-row lm_head at once went through memory: 3.6x slower at 32 rows).
TILE_BYTES = 1 << 21


def supports_args(x: torch.Tensor, qweight: torch.Tensor, qtype: str, scales: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> str | None:
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return "cpu float32 or bfloat16 activations only"
    if qtype not in QTYPES or not qweight.is_contiguous() or qweight.dim() != 2:
        return f"a contiguous 2-D weight of {', '.join(QTYPES)}"
    for name, t in (("scales", scales), ("bias", bias)):
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous()):
            return f"{name} must be contiguous float32"
    return None


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: str, scales: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] < GEMM_MIN_ROWS:
        out = kernels.extension().quant_matmul(rows, qweight, qtype, scales, bias)
    else:
        n, k = qweight.shape[0], rows.shape[1]
        step = max(1, TILE_BYTES // (k * x.element_size()))
        tiles = []
        for start in range(0, n, step):
            part = qweight[start:start + step]
            weight = kernels.extension().quant_dequantize(part, qtype, None if scales is None else
                                                          scales[start:start + step], x.dtype)
            tiles.append(F.linear(rows, weight, None if bias is None else bias[start:start + step].to(x.dtype)))
        out = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)
    return out.reshape(*x.shape[:-1], qweight.shape[0])
