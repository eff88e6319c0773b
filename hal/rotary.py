"""Rotary position tables: inverse frequencies per scaling type and the cos|sin cache the `rotary` op reads."""
from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_type(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"


def inverse_frequencies(rot_dim: int, base: float, scaling: dict[str, Any] | None,
                        max_positions: int | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    rope_type = _rope_type(scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn(inv_freq, rot_dim, base, scaling, max_positions)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported yet; supported: {SUPPORTED_ROPE_TYPES}")


def _yarn_factor(s: dict[str, Any], max_positions: int | None) -> float:
    """DeepSeek-V3-style configs may leave `factor` out: it is then the context extension itself."""
    if s.get("factor") is not None:
        return float(s["factor"])
    if max_positions is None:
        raise ValueError("yarn rope scaling without `factor` needs the model's max_position_embeddings")
    return max_positions / float(s["original_max_position_embeddings"])


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(s: dict[str, Any], max_positions: int | None = None) -> float:
    """YaRN scales cos and sin (so both q and k) by this: sqrt of the paper's softmax temperature correction."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = _yarn_factor(s, max_positions)
    if s.get("mscale") and s.get("mscale_all_dim"):
        return _yarn_mscale(factor, float(s["mscale"])) / _yarn_mscale(factor, float(s["mscale_all_dim"]))
    return _yarn_mscale(factor)


def yarn_softmax_scale(s: dict[str, Any] | None, max_positions: int | None = None) -> float:
    """DeepSeek's YaRN correction of the softmax scale, applied to every dim of q.k (not only the rotated ones):
    mscale(factor, mscale_all_dim) squared; 1 without YaRN or without mscale_all_dim."""
    if _rope_type(s) != "yarn" or not s.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(_yarn_factor(s, max_positions), float(s["mscale_all_dim"])) ** 2


def _yarn(inv_freq: torch.Tensor, rot_dim: int, base: float, s: dict[str, Any],
          max_positions: int | None) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated (divided
    by `factor`), those that turn more than beta_fast times are kept, with a linear ramp over the dims between."""
    factor = _yarn_factor(s, max_positions)
    old_len = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns `rotations` times over old_len
        return rot_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_cos_sin_cache(rot_dim: int, max_positions: int, base: float,
                       scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """(max_positions, rot_dim) fp32 table: cos of each frequency, then sin."""
    inv_freq = inverse_frequencies(rot_dim, base, scaling, max_positions)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return table * yarn_attention_factor(scaling, max_positions) if _rope_type(scaling) == "yarn" else table
