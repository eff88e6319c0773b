"""MXFP4 (OCP microscaling) weights, as GPT-OSS checkpoints ship their experts: `<name>_blocks` (..., G, 16) uint8
holds 32 fp4 (e2m1) values per group, two to a byte (low nibble first), and `<name>_scales` (..., G) uint8 the
group's power-of-two scale as a biased exponent (e8m0: 2^(s - 127)). Resin dequantises them on load."""
from __future__ import annotations

import torch

# e2m1 codes 0..15: sign bit, then the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., G, B) packed bytes and (..., G) exponents -> (..., G * 2B) values in `dtype` (exact: every e2m1 value
    times a power of two is representable in bf16 and fp32 for the exponents checkpoints use)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} do not pair up: expected uint8 (..., G, B) and uint8 (..., G)")
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)
