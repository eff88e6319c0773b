"""RMSNorm and fused residual-add + RMSNorm: one program per row, the whole row in registers."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resin.backends.triton.tuning import Tuning, current


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, x_stride, res_stride, out_stride, hidden,
                     eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Round the sum to the activation dtype first, exactly as the native op's `x + residual` does.
        x = (x.to(tl.float32) + tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            tuning: Tuning | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    tuning = tuning or current()
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else None
    res2 = residual.reshape(-1, hidden).contiguous() if residual is not None else x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out if res_out is not None else out, x2.stride(0), res2.stride(0),
            out.stride(0), hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
            **tuning.launch(tuning.elementwise_warps))
    shape = x.shape
    return out.view(shape), (res_out.view(shape) if res_out is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, tuning: Tuning | None = None) -> torch.Tensor:
    return _launch(x, None, weight, eps, tuning)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       tuning: Tuning | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps, tuning)  # type: ignore[return-value]


def supports_args(x: torch.Tensor, *args, **kwargs) -> str | None:
    if x.shape[-1] > 65536:
        return f"hidden size {x.shape[-1]} > 65536 does not fit one program's registers"
    return None
