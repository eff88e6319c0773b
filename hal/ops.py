"""HAL op declarations. Each function here is the op's native implementation: the definition of correct."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from resin.hal.registry import Op


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, accumulated in fp32 (as Hugging Face does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual')."""
    residual = x + residual
    return _rms_norm(residual, weight, eps), residual


def _rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
            head_size: int, is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, Hq*D) and k (T, Hk*D) by position. cos_sin_cache is (max_pos, rot_dim): cos | sin halves.

    Neox style rotates the two halves of the rotary dims; GPT-J style rotates interleaved pairs. Dims past
    rot_dim (partial rotary) pass through. Callers use the returned tensors: a provider may rotate q and k in
    place and return them (aiter does).
    """
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # (T, rot_dim/2) each
    return _rotate(q, cos, sin, head_size, is_neox), _rotate(k, cos, sin, head_size, is_neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, is_neox: bool) -> torch.Tensor:
    shape = x.shape
    x = x.view(shape[0], -1, head_size)
    rot_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if x_pass.shape[-1]:
        rotated = torch.cat((rotated, x_pass), dim=-1)
    return rotated.reshape(shape)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] where d = x.shape[-1] // 2 (fused gate/up projection output)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x[..., :d]) * x[..., d:]; approximate is 'none' or 'tanh'."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


def _embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of weight (vocab, hidden) selected by token id."""
    return F.embedding(ids, weight)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, weight (out, in) in bf16/fp16/fp32."""
    return F.linear(x, weight, bias)


def _argmax(scores: torch.Tensor) -> torch.Tensor:
    """The greedy choice: the first index of each row's largest score (rows, vocab) -> (rows,) int64; a NaN counts
    as largest."""
    return scores.argmax(dim=-1)


def _random_sample(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """A draw from each row's softmax by inverting its CDF at one uniform: logits (rows, vocab) fp32, finite or
    -inf with a finite maximum; uniforms (rows,) fp64 in [0, 1) -> (rows,) int64, the first index whose cumulative
    weight exceeds u x the row's total, never a token of weight 0. Weights exp(l - max) in fp32, summed in fp64.

    One uniform a row instead of an exponential per vocabulary entry (the argmax(p / Exp(1)) race): drawing 49,152
    exponentials per row cost ~1.5 ms a row on a CPU core, more than the model's decode step at batch 16."""
    weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)


ARGMAX = Op("argmax", _argmax)
RANDOM_SAMPLE = Op("random_sample", _random_sample)
RMS_NORM = Op("rms_norm", _rms_norm)
FUSED_ADD_RMS_NORM = Op("fused_add_rms_norm", _fused_add_rms_norm)
ROTARY = Op("rotary", _rotary)
SILU_AND_MUL = Op("silu_and_mul", _silu_and_mul)
GELU_AND_MUL = Op("gelu_and_mul", _gelu_and_mul)
EMBEDDING = Op("embedding", _embedding)
LINEAR = Op("linear", _linear)
