"""fp8 w8a8 on Triton: per-token activation quantisation and a scaled GEMM.

C = (A_q @ B_q^T) * a_scale * b_scale (+ bias), A_q (M, K) and B_q (N, K) in the platform's fp8 flavour (e4m3fn
on NVIDIA and gfx950, e4m3fnuz on gfx942), fp32 accumulation. Scales broadcast by stride: a per-tensor scale is
read with stride 0, a per-token / per-channel one with stride 1, so one kernel serves all four combinations.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resin.backends.triton.tuning import Tuning, current
from resin.hal.fp8 import _MIN_SCALE


@triton.jit
def _to_fp8_grid(q, min_normal, sub_step):
    """Round fp32 values to the fp8 grid (nearest even) in fp32 first, so the cast after is exact. Triton's CPU
    interpreter (3.9) rounds fp8 casts wrongly (it drops the carry into the next binade, 124.3 -> 64, and truncates
    subnormals), and an explicit rounding costs nothing in a memory-bound kernel. Normal range: keep 3 mantissa
    bits of the fp32 pattern. Subnormal range: a uniform grid of step min_normal / 8, rounded via floor."""
    bits = q.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # ~0xFFFFF
    n = q / sub_step
    fl = tl.floor(n)
    frac = n - fl
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) == 1.0
    sub = (fl + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)) * sub_step
    return tl.where(tl.abs(q) >= min_normal, normal, sub)


@triton.jit
def _quant_per_token_kernel(x_ptr, q_ptr, s_ptr, k, x_stride, fmax, min_scale, min_normal, sub_step,
                            STATIC: tl.constexpr, BLOCK: tl.constexpr):
    # The row is walked in BLOCK-wide chunks (a max pass, then a quantise pass) rather than held whole: a whole
    # 14k-28k row in one program's registers spills on every target (the cross-compile gate found it).
    row = tl.program_id(0).to(tl.int64)
    if STATIC:
        scale = tl.load(s_ptr)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, k, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * x_stride + cols, mask=cols < k, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), fmax), min_scale)
        tl.store(s_ptr + row, scale)
    for k0 in range(0, k, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        ok = cols < k
        x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
        # div_rn: correctly rounded like torch's division (plain `/` lowers to an approximate divide on NVIDIA)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fmax), fmax)
        q = _to_fp8_grid(q, min_normal, sub_step)
        tl.store(q_ptr + row * k + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


_QUANT_BLOCK = 2048  # elements of a row per chunk: 8-16 per lane at 2-4 warps, no spills on any target


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None,
                 tuning: Tuning | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    tuning = tuning or current()
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x2.shape
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    s = scale.float().reshape(1) if scale is not None else torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        info = torch.finfo(dtype)
        _quant_per_token_kernel[(m,)](x2, q, s, k, x2.stride(0), info.max, _MIN_SCALE, info.smallest_normal,
                                      info.smallest_normal / 8, STATIC=scale is not None,
                                      BLOCK=min(triton.next_power_of_2(k), _QUANT_BLOCK),
                                      **tuning.launch(tuning.elementwise_warps))
    return q, s


@triton.jit
def _scaled_mm_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, m, n, k, a_stride, b_stride,
                      c_stride, a_scale_stride, b_scale_stride, A_SCALE_STRIDE: tl.constexpr,
                      B_SCALE_STRIDE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_SCALED: tl.constexpr,
                      SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """Per-tensor / per-row / per-column scales (A_SCALE_STRIDE, B_SCALE_STRIDE: 0 or 1) applied once at the end;
    BLOCK_SCALED: a scale per (row, k-block) of A and per (n-block, k-block) of B, applied per K tile (a tile lies
    inside one SCALE_K-wide block)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < m, cols < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * a_stride + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(b_ptr + cols[None, :].to(tl.int64) * b_stride + kk[:, None], mask=col_ok[None, :] & k_ok[:, None],
                    other=0.0)
        if BLOCK_SCALED:
            kb = k0 // SCALE_K
            a_s = tl.load(a_scale_ptr + rows.to(tl.int64) * a_scale_stride + kb, mask=row_ok, other=0.0)
            b_s = tl.load(b_scale_ptr + (cols // SCALE_N).to(tl.int64) * b_scale_stride + kb, mask=col_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc += tl.dot(a, b)
    if not BLOCK_SCALED:
        a_s = tl.load(a_scale_ptr + rows * A_SCALE_STRIDE, mask=row_ok, other=0.0)
        b_s = tl.load(b_scale_ptr + cols * B_SCALE_STRIDE, mask=col_ok, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows[:, None].to(tl.int64) * c_stride + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               tuning: Tuning | None = None) -> torch.Tensor:
    tuning = tuning or current()
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8(x2, weight.dtype, input_scale, tuning)
    m, k = xq.shape
    n = weight.shape[0]
    ws = weight_scale.float().reshape(-1).contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk = tuning.gemm_block
    if m:
        _scaled_mm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            xq, weight, out, xs, ws, bias if bias is not None else ws, m, n, k, xq.stride(0), weight.stride(0),
            out.stride(0), 0, 0, A_SCALE_STRIDE=0 if xs.numel() == 1 else 1, B_SCALE_STRIDE=0 if ws.numel() == 1 else 1,
            HAS_BIAS=bias is not None, BLOCK_SCALED=False, SCALE_N=1, SCALE_K=1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            **tuning.launch(tuning.gemm_warps, tuning.gemm_stages))
    return out.reshape(*x.shape[:-1], n)


def fp8_linear_supports_args(x: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> str | None:
    if weight.stride(-1) != 1:
        return "weight is not row-major"
    if x.shape[-1] % 16:
        return f"K={x.shape[-1]} is not a multiple of 16 (fp8 tensor-core tiles)"
    return None
