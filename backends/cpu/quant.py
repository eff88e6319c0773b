"""The cpu provider of quant_linear: Resin's C++ kernels over weights kept quantised (csrc/quant_kernels.cpp).

Few activation rows (decode): the products are native's exactly (bf16 activations times each block's quants, or
fp32 activations times the unpacked fp32 weights), summed in fp32 in another order; a step reads the packed bytes,
not bf16 weights. Q4_0, Q4_1, Q8_0 and Q4_K have fused row kernels that never unpack a row: vdpbf16ps for bf16
on AVX512-BF16, fma on quants as fp32 for fp32 anywhere with AVX2, and for bf16 where AVX512-BF16 is missing
(csrc/quant_fma_rows.cpp). More bf16 rows (batched decode and prefill): on a CPU with AMX, the panels below
multiplied by torch's brgemm ukernel on AMX tiles for batched decode, and tiles of weights unpacked into bf16 and
torch's GEMM for prefill-sized batches (oneDNN's tile kernels: 11x the vdpbf16ps panels at 2048 rows); with
AVX512-BF16 alone, panels of 32 weight rows unpacked into bf16 and multiplied by a register-blocked GEMM
(vdpbf16ps), which beats unpacked tiles there at every batch size measured (8 to 2048 rows). Without AVX512-BF16,
and in fp32, the row kernels serve up to GEMM_MIN_ROWS and tiles unpacked into torch's fp32 GEMM beyond (bf16 rows
are multiplied in fp32 there and rounded once: torch's bf16 GEMM is a scalar loop on such CPUs). Unpacking into
bf16 rounds each weight to bf16 once (as a bf16 checkpoint is), which the bf16 tolerance covers; in fp32 the paths
are exact up to summation order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from resin.backends.cpu import kernels
from resin.hal.quant import QTYPES

# Thresholds measured with `python bench/quant_linear.py`, bf16 activations, on a 2-core AVX512-BF16 machine (AMD
# EPYC) and a 2-core Xeon with AMX. With AMX, from 8 rows the panels go through torch's brgemm ukernel on AMX tiles
# up to AMX_PANEL_MAX_ROWS (Q4_1 1536x576 at 32 rows: 0.11 ms, against 0.30 for the vdpbf16ps panels and 0.15 for
# unpacked tiles; the Q8_0 49152-row lm_head at 32 rows: 3.3 against 5.4 tiled), and past it tiles unpacked into
# torch's GEMM (oneDNN's blocking for large M: 2048 rows 1.5 ms against 7.9 for the brgemm panels).
# Types with a fused bf16 kernel multiply each block's quants exactly: fastest below FUSED_MAX_ROWS (Q4_1
# 1536x576 at 1 row: 0.034 ms against 0.075 for the panel GEMM; Q4_K 1536x512: 0.037 against 0.106; at 8 rows
# the two are even for Q4_1 and the GEMM wins for Q4_K, 0.124 against 0.177); other types take the GEMM.
FUSED_BF16 = ("q4_0", "q4_1", "q8_0", "q4_k")
FUSED_MAX_ROWS = 8
AMX_PANEL_MAX_ROWS = 128
# fp32 (and bf16 without AVX512-BF16): the row kernel below this many rows, the tiled GEMM from here. With the
# fma row kernels on a 2-core Zen 3 (AVX2, fp32): Q4_1 1536x576 at 48 rows 1.17 ms against 1.38 tiled, at 64 rows
# 1.57 against 1.49; the Q8_0 lm_head at 48 rows 23.1 against 28.0, at 96 even.
GEMM_MIN_ROWS = 64
# Weights unpacked per GEMM call: a tile near L2's size (2 MiB a core here) while the GEMM reads it (unpacking a
# whole 49152-row lm_head at once went through memory: 3.6x slower at 32 rows).
TILE_BYTES = 1 << 21


def supports_args(x: torch.Tensor, qweight: torch.Tensor, qtype: str, scales: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> str | None:
    if not x.is_cpu or x.dtype not in (torch.float32, torch.bfloat16):
        return "cpu float32 or bfloat16 activations only"
    if qtype not in QTYPES or not qweight.is_contiguous() or qweight.dim() != 2:
        return f"a contiguous 2-D weight of {', '.join(QTYPES)}"
    for name, t in (("scales", scales), ("bias", bias)):
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous()):
            return f"{name} must be contiguous float32"
    return None


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: str, scales: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    flat = x.dim() == 2  # a decode step's rows: no reshapes (1.4 us each, twice per call, 121 calls a step)
    rows = x if flat else x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    ext = kernels.extension()
    out = None
    if x.dtype == torch.bfloat16:
        if m < FUSED_MAX_ROWS and qtype in FUSED_BF16:
            out = ext.quant_matmul(rows, qweight, qtype, scales, bias)
        elif kernels.amx_gemm():
            if m <= AMX_PANEL_MAX_ROWS:  # panels on AMX tiles, None where cpublas cannot pack bf16 (or K % 32)
                out = ext.quant_matmul_bf16(rows, qweight, qtype, scales, bias, amx=True)
            if out is None:
                out = _tiled_gemm(rows, qweight, qtype, scales, bias)
        elif kernels.native_bf16():  # AVX512-BF16 alone: Q4_1 1536x576 at 32 rows 0.19 ms against 0.26 tiled
            out = ext.quant_matmul_bf16(rows, qweight, qtype, scales, bias)  # None where K % 32
    if out is None:
        out = ext.quant_matmul(rows, qweight, qtype, scales, bias) if m < GEMM_MIN_ROWS else \
            _tiled_gemm(rows, qweight, qtype, scales, bias)
    return out if flat else out.reshape(*x.shape[:-1], qweight.shape[0])


def _tiled_gemm(rows: torch.Tensor, qweight: torch.Tensor, qtype: str, scales: torch.Tensor | None,
                bias: torch.Tensor | None) -> torch.Tensor:
    n, k = qweight.shape[0], rows.shape[1]
    # bf16 where the CPU multiplies it natively; elsewhere fp32, rounded once to bf16 at the end (exact products)
    compute = rows.dtype if rows.dtype == torch.float32 or kernels.native_bf16() else torch.float32
    xs = rows.to(compute)
    step = max(1, TILE_BYTES // (k * xs.element_size()))
    tiles = []
    for start in range(0, n, step):
        part = slice(start, start + step)
        weight = kernels.extension().quant_dequantize(qweight[part], qtype, None if scales is None else scales[part],
                                                      compute)
        tiles.append(F.linear(xs, weight, None if bias is None else bias[part].to(compute)))
    out = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)
    return out.to(rows.dtype)


def embedding_args(ids: torch.Tensor, qweight: torch.Tensor, qtype: str, scales: torch.Tensor | None,
                   dtype: torch.dtype) -> str | None:
    if not ids.is_cpu or dtype not in (torch.float32, torch.bfloat16):
        return "cpu float32 or bfloat16 rows only"
    return supports_args(torch.empty(0, dtype=dtype), qweight, qtype, scales)


def quant_embedding(ids: torch.Tensor, qweight: torch.Tensor, qtype: str, scales: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor:
    """The selected rows unpacked by one kernel call (native's torch decoders are ~10 ops: 60 us a decode step)."""
    flat = ids.reshape(-1)
    rows = kernels.extension().quant_dequantize(qweight.index_select(0, flat), qtype,
                                                None if scales is None else scales.index_select(0, flat), dtype)
    return rows.view(*ids.shape, rows.shape[-1])
