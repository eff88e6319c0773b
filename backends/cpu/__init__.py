"""The reference backend: every op has the HAL's native, vectorised PyTorch implementation as its oracle.

Faster CPU providers join the priority lists only after they are measured to beat native (bench/) and tested
against it (tests/test_cpu_providers.py): paged attention split into decode and prefill paths.
"""
from resin.backends.cpu.attention import CpuAttention
from resin.hal.attention import ATTENTION
from resin.hal.selection import BackendSpec

ATTENTION.register("cpu", supports_args=CpuAttention.unsupported_reason)(CpuAttention)

BACKEND = BackendSpec("cpu", priorities={"attention": ["cpu"]},
                      note="PyTorch on the CPU: native ops; attention split into matmul decode and SDPA prefill")
