"""Block-scale fp8 w8a8 on Triton (DeepSeek-V3's format): per-token-group activation quantisation, then fp8.py's
scaled GEMM with one activation scale per (row, k-block) and one weight scale per (n-block, k-block).

The GEMM walks K in tiles no wider than the weight's scale block (and dividing it), so each tile lies in one scale
block: acc += dot(A_q, B_q^T) * a_scale[row, kb] * b_scale[col // bn, kb], fp32 throughout.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resin.backends.triton.fp8 import _scaled_mm_kernel, _to_fp8_grid
from resin.backends.triton.tuning import Tuning, current
from resin.hal.fp8 import _MIN_SCALE


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, k, groups, x_stride, fmax, min_scale, min_normal, sub_step,
                         GROUP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = g * GROUP + offs
    ok = (offs < GROUP) & (cols < k)
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), fmax), min_scale)
    tl.store(s_ptr + row * groups + g, scale)
    q = _to_fp8_grid(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fmax), fmax), min_normal, sub_step)
    tl.store(q_ptr + row * k + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


def quantize_fp8_groups(x: torch.Tensor, dtype: torch.dtype, group: int,
                        tuning: Tuning | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    tuning = tuning or current()
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x2.shape
    groups = -(-k // group)
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        info = torch.finfo(dtype)
        _quant_groups_kernel[(m, groups)](x2, q, s, k, groups, x2.stride(0), info.max, _MIN_SCALE,
                                          info.smallest_normal, info.smallest_normal / 8, GROUP=group,
                                          BLOCK=triton.next_power_of_2(group),
                                          **tuning.launch(tuning.elementwise_warps))
    return q, s


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None, tuning: Tuning | None = None) -> torch.Tensor:
    tuning = tuning or current()
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8_groups(x2, weight.dtype, block[1], tuning)
    m, k = xq.shape
    n = weight.shape[0]
    ws = weight_scale.float().contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk = tuning.gemm_block
    bk = min(bk, block[1])  # a K tile inside one scale block (block[1] is a power of two: supports_args)
    if m:
        _scaled_mm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            xq, weight, out, xs, ws, bias if bias is not None else ws, m, n, k, xq.stride(0), weight.stride(0),
            out.stride(0), xs.stride(0), ws.stride(0), A_SCALE_STRIDE=0, B_SCALE_STRIDE=0, HAS_BIAS=bias is not None,
            BLOCK_SCALED=True, SCALE_N=block[0], SCALE_K=block[1], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            **tuning.launch(tuning.gemm_warps, tuning.gemm_stages))
    return out.reshape(*x.shape[:-1], n)


def block_fp8_linear_supports_args(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                                   block: tuple[int, int], *args, **kwargs) -> str | None:
    if weight.stride(-1) != 1:
        return "weight is not row-major"
    if block[1] < 16 or block[1] & (block[1] - 1):
        return f"scale block width {block[1]}: the kernel takes a power of two >= 16"
    if x.shape[-1] % 16:
        return f"K={x.shape[-1]} is not a multiple of 16 (fp8 tensor-core tiles)"
    return None
