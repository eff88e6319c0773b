"""NVIDIA backend (H100 sm_90, B200 sm_100): the shared Triton kernels for every op they cover, fp8 e4m3fn w8a8
(torch._scaled_mm first, the Triton GEMM for scale layouts it does not take), and decode steps replayed from CUDA
graphs. Ops without a kernel here (embedding, linear) run torch's own CUDA implementations (cuBLAS), which is
what their native definition calls.

Attention: the Triton kernel first (graph-safe, every configuration); flashinfer and flash-attn, where installed,
follow it in the chain (they serve what it declines, or everything with --ops attention=flashinfer): neither is
graph-safe here, so with either first eager steps use it and captured decode steps the Triton kernel, and
upstream flash-attn 2 pages KV only in multiples of 256 tokens (Resin's blocks are 16).

Tensor parallelism: all_reduce through torch's symmetric memory on sm_90+ (bf16, up to 16 MiB; NCCL for the
rest), all_gather through NCCL.
"""
from resin.backends.cuda import flashmla, graphs, scaled_mm, symm_mem
from resin.backends.cuda.flash_attn_attention import FlashAttnAttention
from resin.backends.cuda.flashinfer_attention import FlashInferAttention
from resin.backends.triton import providers as _triton  # noqa: F401  (registers the "triton" providers)
from resin.hal.attention import ATTENTION
from resin.hal.distributed import ALL_REDUCE
from resin.hal.fp8 import FP8_LINEAR
from resin.hal.graphs import CAPTURE_GRAPH
from resin.hal.mla import MLA_ATTENTION
from resin.hal.platform import Platform
from resin.hal.selection import BackendSpec


def _library(name: str, pip: str):
    def supported(platform: Platform) -> tuple[bool, str]:
        if platform.kind != "cuda":
            return False, f"{name} runs on NVIDIA GPUs"
        if name not in platform.libraries:
            return False, f"{name} is not importable (pip install {pip})"
        if int(platform.arch.removeprefix("sm_") or 0) < 80:
            return False, f"{platform.arch}: {name} needs sm_80 or newer"
        return True, ""
    return supported


CAPTURE_GRAPH.register("torch_graphs", graphs.supported)(graphs.capture)
MLA_ATTENTION.register("flashmla", flashmla.supported, flashmla.FlashMla.unsupported_reason,
                       library="flash-mla")(flashmla.FlashMla)
FP8_LINEAR.register("scaled_mm", scaled_mm.supported, scaled_mm.supports_args)(scaled_mm.fp8_linear)
ALL_REDUCE.register(symm_mem.NAME, symm_mem.supported, symm_mem.supports_args)(symm_mem.all_reduce)
# graph-safety comes from each class's supports_graphs (neither is)
ATTENTION.register("flashinfer", _library("flashinfer", "flashinfer-python"), FlashInferAttention.unsupported_reason,
                   library="flashinfer-python")(FlashInferAttention)
ATTENTION.register("flash_attn", _library("flash_attn", "flash-attn"), FlashAttnAttention.unsupported_reason,
                   library="flash-attn")(FlashAttnAttention)

TRITON_OPS = ("rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "gelu_and_mul", "moe_route", "fused_moe",
              "causal_conv1d", "causal_conv1d_update", "gated_delta_rule")

BACKEND = BackendSpec(
    "cuda", priorities={**{op: ["triton"] for op in TRITON_OPS}, "attention": ["triton", "flashinfer", "flash_attn"],
                        "mla_attention": ["triton", "flashmla"],
                        "fp8_linear": ["scaled_mm", "triton"], "block_fp8_linear": ["triton"],
                        "capture_graph": ["torch_graphs"], "all_reduce": [symm_mem.NAME]},
    note="Triton kernels (warp32 tuning), cuBLAS linear, fp8 e4m3fn, CUDA graphs per decode bucket")
