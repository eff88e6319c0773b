"""Fused gate activations over a [gate | up] row: silu(gate) * up, gelu(gate) * up (erf or tanh), and GPT-OSS's
clamped SwiGLU (up + 1) * gate * sigmoid(alpha * gate)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resin.backends.triton.tuning import Tuning, current

_BLOCK = 1024


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, d, alpha, limit, ACT: tl.constexpr,
                        BLOCK: tl.constexpr):
    # ACT: 0 silu, 1 gelu (erf), 2 gelu (tanh), 3 swigluoai
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0)
    if ACT == 3:
        # rounded to the output dtype after each step, as the unfused native op is (clamps are exact)
        dt = out_ptr.dtype.element_ty
        gate = tl.minimum(gate, limit)
        sig = (1.0 / (1.0 + tl.exp(-(gate * alpha).to(dt).to(tl.float32)))).to(dt).to(tl.float32)
        glu = (gate * sig).to(dt).to(tl.float32)
        upc = (tl.minimum(tl.maximum(up.to(tl.float32), -limit), limit) + 1.0).to(dt).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (upc * glu).to(dt), mask=mask)
        return
    if ACT == 0:
        a = gate / (1.0 + tl.exp(-gate))
    elif ACT == 1:
        a = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        a = 0.5 * gate * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))  # tanh via exp
    # Round the activation to the output dtype before the product, as the unfused native op does.
    a = a.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (a * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, act: int, tuning: Tuning | None, alpha: float = 0.0,
                 limit: float = 0.0) -> torch.Tensor:
    tuning = tuning or current()
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(d, _BLOCK))](
            x2, out, x2.stride(0), out.stride(0), d, alpha, limit, ACT=act, BLOCK=_BLOCK,
            **tuning.launch(tuning.elementwise_warps))
    return out.view(*x.shape[:-1], d)


def silu_and_mul(x: torch.Tensor, tuning: Tuning | None = None) -> torch.Tensor:
    return _act_and_mul(x, 0, tuning)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", tuning: Tuning | None = None) -> torch.Tensor:
    return _act_and_mul(x, 1 if approximate == "none" else 2, tuning)


def swigluoai_and_mul(x: torch.Tensor, alpha: float, limit: float, tuning: Tuning | None = None) -> torch.Tensor:
    return _act_and_mul(x, 3, tuning, alpha, limit)
