"""aiter RMSNorm: `rms_norm(input, weight, epsilon)` (out of place) and `rmsnorm2d_fwd_with_add(out, input,
residual_in, residual_out, weight, epsilon)` (writes out and residual_out; a gemma_norm argument was inserted
after epsilon in v0.1.17, so only the first six are passed). 2-D, last dim contiguous, fp16/bf16 (CK)."""
from __future__ import annotations

import torch

from resin.backends.rocm.aiter import aiter_module


def supports_args(x: torch.Tensor, *args, **kwargs) -> str | None:
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"{x.dtype}: aiter rmsnorm takes fp16/bf16"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    return aiter_module().rms_norm(x2, weight, eps).view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    r2 = residual.reshape(-1, x.shape[-1]).contiguous()
    out, res_out = torch.empty_like(x2), torch.empty_like(x2)
    aiter_module().rmsnorm2d_fwd_with_add(out, x2, r2, res_out, weight, eps)
    return out.view(x.shape), res_out.view(x.shape)
