"""Weight-quantised linear layers: GGUF block formats kept packed in memory, and per-channel int8.

A quantised weight is a uint8 tensor of shape (out_features, row_bytes): each row is its in_features weights as
consecutive GGUF blocks, exactly as llama.cpp stores them, so rows can be sliced, permuted and concatenated
without unpacking. int8 weights are (out_features, in_features) int8 with one fp32 scale per row.

The native ops dequantise to fp32 and multiply in fp32 (rounding once, to x's dtype): the reference every
provider is compared with. Block layouts follow ggml (ggml-common.h / ggml-quants.c): an fp16 scale `d` (and a
min `m` for the _1 and K types), then the quants; K-quants group 256 weights into 8 or 16 sub-blocks with their
own 6- or 8-bit scales.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from resin.hal.registry import Op


@dataclass(frozen=True)
class QuantFormat:
    name: str
    block: int  # weights per block
    block_bytes: int
    dequantize: Callable[[torch.Tensor], torch.Tensor]  # (..., block_bytes) uint8 -> (..., block) float32

    def row_bytes(self, in_features: int) -> int:
        if in_features % self.block:
            raise ValueError(f"{self.name} packs weights in blocks of {self.block}: in_features={in_features} is "
                             f"not a multiple")
        return in_features // self.block * self.block_bytes


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes (little-endian fp16) -> float32 of shape (..., 1)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """ggml's 4-bit packing: byte j holds weight j (low nibble) and weight j + len (high nibble)."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[..., 0:2]) * b[..., 2:34].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[..., 0:2]) * (_nibbles(b[..., 2:18]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[..., 0:2]) * _nibbles(b[..., 4:20]).float() + _f16(b[..., 2:4])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit (scale, min) pairs packed into 12 bytes of a Q4_K / Q5_K super-block."""
    s = s.int()
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scale = torch.cat((lo & 63, (hi & 0xF) | ((lo >> 6) << 4)), dim=-1)
    mins = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=-1)
    return scale.float(), mins.float()


def _k4_quants(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> 8 sub-blocks of 32 four-bit quants: 32-byte chunk i holds sub-blocks 2i (low) and 2i+1 (high)."""
    qs = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack((qs & 0xF, qs >> 4), dim=-2).reshape(*qs.shape[:-2], 8, 32).int()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    scale, mins = _k_scales(b[..., 4:16])
    q = _k4_quants(b[..., 16:144]).float()
    w = (_f16(b[..., 0:2]) * scale)[..., None] * q - (_f16(b[..., 2:4]) * mins)[..., None]
    return w.flatten(-2)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    scale, mins = _k_scales(b[..., 4:16])
    qh = b[..., 16:48].int()  # bit j of byte l is the fifth bit of weight l in sub-block j
    high = (qh[..., None, :] >> torch.arange(8, dtype=torch.int32, device=qh.device)[:, None]) & 1
    q = (_k4_quants(b[..., 48:176]) | (high << 4)).float()
    w = (_f16(b[..., 0:2]) * scale)[..., None] * q - (_f16(b[..., 2:4]) * mins)[..., None]
    return w.flatten(-2)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 64).int()  # two halves of 128 weights
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 32).int()
    low = torch.cat((ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4), dim=-1)
    high = torch.cat((qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3), dim=-1)
    q = ((low | (high << 4)) - 32).flatten(-2).float()
    scale = b[..., 192:208].contiguous().view(torch.int8).float().repeat_interleave(16, dim=-1)  # per 16 weights
    return _f16(b[..., 208:210]) * scale * q


FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    QuantFormat("q8_0", 32, 34, _q8_0), QuantFormat("q4_0", 32, 18, _q4_0), QuantFormat("q4_1", 32, 20, _q4_1),
    QuantFormat("q4_k", 256, 144, _q4_k), QuantFormat("q5_k", 256, 176, _q5_k),
    QuantFormat("q6_k", 256, 210, _q6_k))}
INT8 = "int8"  # per-channel weight-only int8: qweight (N, K) int8, scales (N,) float32
QTYPES = (*FORMATS, INT8)


def quant_format(qtype: str) -> QuantFormat:
    fmt = FORMATS.get(qtype)
    if fmt is None:
        raise ValueError(f"quantisation type {qtype!r} is not kept packed; supported: {', '.join(QTYPES)}")
    return fmt


def dequantize(qweight: torch.Tensor, qtype: str, scales: torch.Tensor | None = None) -> torch.Tensor:
    """(N, row_bytes) uint8 GGUF rows, or (N, K) int8 with scales -> (N, K) float32."""
    if qtype == INT8:
        return qweight.float() * scales.float().reshape(-1, 1)
    fmt = quant_format(qtype)
    rows = qweight.shape[0]
    return fmt.dequantize(qweight.reshape(rows, -1, fmt.block_bytes)).reshape(rows, -1)


def _quant_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: str, scales: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize(qweight).T + bias, in fp32, rounded once to x's dtype."""
    out = x.float() @ dequantize(qweight, qtype, scales).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _quant_embedding(ids: torch.Tensor, qweight: torch.Tensor, qtype: str, scales: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor:
    """The rows of a quantised (vocab, hidden) table selected by token id, dequantised to dtype: (*ids.shape, hidden)."""
    flat = ids.reshape(-1)
    rows = dequantize(qweight[flat], qtype, None if scales is None else scales[flat]).to(dtype)
    return rows.view(*ids.shape, rows.shape[-1])


QUANT_LINEAR = Op("quant_linear", _quant_linear)
QUANT_EMBEDDING = Op("quant_embedding", _quant_embedding)
