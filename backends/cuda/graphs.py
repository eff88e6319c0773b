"""CUDA graphs through torch (HIP graphs on ROCm use the very same torch.cuda API, so rocm registers this too).

Untested here: this machine has no GPU; tests/gpu/test_graphs.py checks replay == eager on one.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from resin.hal.platform import Platform


def supported(platform: Platform) -> tuple[bool, str]:
    if platform.kind not in ("cuda", "rocm"):
        return False, "graphs need a GPU"
    if not platform.supports_graphs:
        return False, f"{platform.device_name}: no graph support"
    return True, ""


def capture(step: Callable[[], None], pool: Any = None) -> torch.cuda.CUDAGraph:
    # Warm up on a side stream first (lazy allocations, autotuning, Triton compiles must not be captured).
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph
