"""Per-vendor launch parameters for the shared Triton kernels.

The kernels take a `Tuning`; which one applies is a fact of the torch build (a HIP build runs on AMD), so it is
read, not configured. The tables themselves live with their vendor: backends/cuda/tuning.py, backends/rocm/tuning.py.
The one exception is the cross-compile gate (`python -m resin.ci kernels`), which replays the engine's launches
for the other vendor too: `using(tuning)` scopes that choice to a block.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass(frozen=True)
class Tuning:
    vendor: str
    warp_size: int  # 32 on NVIDIA, 64 (a wavefront) on AMD Instinct
    elementwise_warps: int  # norms, activations, rotary, cache writes: one row per program
    attention_block_m: int  # rows of an attention tile (query tokens x GQA group) when the batch has prefills
    attention_block_m_fp32: int  # the same for fp32 caches (IEEE dots): 64 rows spill on sm_100
    attention_warps: int
    attention_stages: int
    decode_target_programs: int  # split decode attention over the key range until about this many programs run
    gemm_block: tuple[int, int, int]  # (BLOCK_M, BLOCK_N, BLOCK_K) for fp8 and MoE grouped GEMMs
    gemm_warps: int
    gemm_stages: int
    # fp32 operands (the tiny parity models) need smaller tiles: the 16-bit tile spills on gfx950, sm_90, sm_100
    gemm_block_fp32: tuple[int, int, int]
    # AMD-only compiler hints (waves_per_eu, matrix_instr_nonkdim); NVIDIA's Triton rejects unknown options.
    extra_launch: dict[str, int] = field(default_factory=dict)

    def attention_rows(self, dtype: torch.dtype) -> int:
        return self.attention_block_m_fp32 if dtype == torch.float32 else self.attention_block_m

    def gemm_tile(self, dtype: torch.dtype) -> tuple[int, int, int]:
        return self.gemm_block_fp32 if dtype == torch.float32 else self.gemm_block

    def launch(self, num_warps: int, num_stages: int | None = None) -> dict[str, int]:
        opts = {"num_warps": num_warps, **self.extra_launch}
        if num_stages is not None:
            opts["num_stages"] = num_stages
        return opts


_SCOPED: ContextVar["Tuning | None"] = ContextVar("resin_triton_tuning", default=None)


@contextmanager
def using(tuning: Tuning) -> Iterator[None]:
    """Within the block, `current()` is `tuning` (the cross-compile gate's way to plan another vendor's launches)."""
    token = _SCOPED.set(tuning)
    try:
        yield
    finally:
        _SCOPED.reset(token)


def current() -> Tuning:
    return _SCOPED.get() or _of_this_build()


@functools.cache
def _of_this_build() -> Tuning:
    if torch.version.hip:
        from resin.backends.rocm.tuning import TUNING
    else:
        from resin.backends.cuda.tuning import TUNING
    return TUNING
