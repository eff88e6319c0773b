"""Per-vendor launch parameters for the shared Triton kernels.

The kernels take a `Tuning`; which one applies is a fact of the torch build (a HIP build runs on AMD), so it is
read, not configured. The tables themselves live with their vendor: backends/cuda/tuning.py, backends/rocm/tuning.py.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Tuning:
    vendor: str
    warp_size: int  # 32 on NVIDIA, 64 (a wavefront) on AMD Instinct
    elementwise_warps: int  # norms, activations, rotary, cache writes: one row per program
    attention_block_m: int  # rows of an attention tile (query tokens x GQA group) when the batch has prefills
    attention_warps: int
    attention_stages: int
    decode_target_programs: int  # split decode attention over the key range until about this many programs run
    gemm_block: tuple[int, int, int]  # (BLOCK_M, BLOCK_N, BLOCK_K) for fp8 and MoE grouped GEMMs
    gemm_warps: int
    gemm_stages: int
    # AMD-only compiler hints (waves_per_eu, matrix_instr_nonkdim); NVIDIA's Triton rejects unknown options.
    extra_launch: dict[str, int] = field(default_factory=dict)

    def launch(self, num_warps: int, num_stages: int | None = None) -> dict[str, int]:
        opts = {"num_warps": num_warps, **self.extra_launch}
        if num_stages is not None:
            opts["num_stages"] = num_stages
        return opts


@functools.cache
def current() -> Tuning:
    if torch.version.hip:
        from resin.backends.rocm.tuning import TUNING
    else:
        from resin.backends.cuda.tuning import TUNING
    return TUNING
