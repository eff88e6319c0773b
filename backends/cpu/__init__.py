"""The reference backend: every op has the HAL's native, vectorised PyTorch implementation as its oracle.

Faster CPU providers join the priority lists only after they are measured to beat native (bench/) and tested
against it (tests/test_cpu_providers.py): paged attention split into decode and prefill paths, and bf16 linear
through oneDNN with weights reordered once.
"""
from resin.backends.cpu import linear, rotary
from resin.backends.cpu.attention import CpuAttention
from resin.hal.attention import ATTENTION
from resin.hal.ops import LINEAR, ROTARY
from resin.hal.selection import BackendSpec

ATTENTION.register("cpu", supports_args=CpuAttention.unsupported_reason)(CpuAttention)
LINEAR.register("onednn", supported=linear.supported, supports_args=linear.supports_args)(linear.onednn_linear)
ROTARY.register("cpu", supports_args=rotary.supports_args)(rotary.rotary)

BACKEND = BackendSpec("cpu", priorities={"attention": ["cpu"], "linear": ["onednn"], "rotary": ["cpu"]},
                      note="PyTorch on the CPU: attention split into matmul decode and SDPA prefill; bf16 linear "
                           "through oneDNN with prepacked weights")
