"""NVIDIA backend (H100 sm_90, B200 sm_100): the shared Triton kernels for every op they cover, fp8 e4m3fn w8a8
(torch._scaled_mm first, the Triton GEMM for scale layouts it does not take), and decode steps replayed from CUDA
graphs. Ops without a kernel here (embedding, linear) run torch's own CUDA implementations (cuBLAS), which is
what their native definition calls.

flash-attn and flashinfer are not wired in: upstream flash-attn 2 needs KV pages of 256 tokens (Resin's blocks
are 16), and flashinfer's plan() is not graph-safe; the Triton attention kernel serves every configuration.
"""
from resin.backends.cuda import graphs, scaled_mm
from resin.backends.triton import providers as _triton  # noqa: F401  (registers the "triton" providers)
from resin.hal.fp8 import FP8_LINEAR
from resin.hal.graphs import CAPTURE_GRAPH
from resin.hal.selection import BackendSpec

CAPTURE_GRAPH.register("torch_graphs", graphs.supported)(graphs.capture)
FP8_LINEAR.register("scaled_mm", scaled_mm.supported, scaled_mm.supports_args)(scaled_mm.fp8_linear)

TRITON_OPS = ("attention", "rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "gelu_and_mul",
              "moe_route", "fused_moe")

BACKEND = BackendSpec(
    "cuda", priorities={**{op: ["triton"] for op in TRITON_OPS}, "fp8_linear": ["scaled_mm", "triton"],
                        "capture_graph": ["torch_graphs"]},
    note="Triton kernels (warp32 tuning), cuBLAS linear, fp8 e4m3fn, CUDA graphs per decode bucket")
