"""Engine configuration and the byte-size parser used for the KV cache budget."""
from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


def parse_bytes(value: int | float | str) -> int:
    """'2GiB' -> 2147483648, '500MB' -> 500000000, 1024 -> 1024."""
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"kv_cache_memory={value!r} must be positive")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory={value!r} is not a size; write e.g. '2GiB', '512MiB' or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class EngineConfig:
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    seed: int = 0
    graphs: bool = False  # replay decode steps from graphs captured per batch bucket (GPU backends)
    max_graph_batch: int = 256  # larger decode batches run eagerly
    max_logprobs: int = 20  # most top alternatives a request may ask for per position (vLLM's default too)

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_logprobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


def default_kv_cache_bytes(free_bytes: int, on_gpu: bool) -> int:
    """The budget when none is given, from memory free after the weights are loaded.

    GPU: 85% of free device memory (the rest is for activations and graphs). CPU: a quarter of free RAM, at
    most 1 GiB, since the cache is zero-filled up front and shares RAM with everything else on the machine.
    """
    if on_gpu:
        return int(free_bytes * 0.85)
    return max(min(free_bytes // 4, 1 << 30), 64 << 20)
