"""AMD backend (gfx942 MI300X/MI325X, gfx950 MI350/MI355): aiter kernels where aiter is installed, the shared
Triton kernels (wave64 tuning in tuning.py) for everything else and wherever aiter declines a call, fp8 in the
arch's flavour (e4m3fnuz on gfx942, converted on load), and HIP graphs through torch's CUDA-graph API. Tensor parallelism: all_reduce through aiter's custom all-reduce,
RCCL for what it declines and for all_gather.

The aiter adapters (backends/rocm/aiter/) are untested on hardware in this project; see their module docs.
"""
from resin.backends.cuda import graphs, scaled_mm
from resin.backends.rocm import aiter
from resin.backends.rocm.aiter import all_reduce as aiter_all_reduce
from resin.backends.rocm.aiter import attention as aiter_attention
from resin.backends.rocm.aiter import delta_rule as aiter_delta_rule
from resin.backends.rocm.aiter import gemm as aiter_gemm
from resin.backends.rocm.aiter import mla as aiter_mla
from resin.backends.rocm.aiter import moe as aiter_moe
from resin.backends.rocm.aiter import norm as aiter_norm
from resin.backends.rocm.aiter import rotary as aiter_rotary
from resin.backends.triton import providers as _triton  # noqa: F401  (registers the "triton" providers)
from resin.hal.attention import ATTENTION
from resin.hal.distributed import ALL_REDUCE
from resin.hal.fp8 import BLOCK_FP8_LINEAR, FP8_LINEAR
from resin.hal.graphs import CAPTURE_GRAPH
from resin.hal.mla import MLA_ATTENTION
from resin.hal.moe import FUSED_MOE, MOE_ROUTE
from resin.hal.ops import FUSED_ADD_RMS_NORM, RMS_NORM, ROTARY
from resin.hal.recurrent import GATED_DELTA_RULE
from resin.hal.selection import BackendSpec

# aiter's unified attention is not graph-safe (host max lengths): eager steps use it, captured decode steps the
# Triton kernel behind it (hal.registry.graph_phase), so decode graphs stay on with aiter installed.
A = aiter.DISTRIBUTION
ATTENTION.register("aiter", aiter.supported, aiter_attention.AiterUnifiedAttention.unsupported_reason, library=A)(
    aiter_attention.AiterUnifiedAttention)
MLA_ATTENTION.register("aiter", aiter.supported, aiter_mla.AiterMla.unsupported_reason, library=A)(aiter_mla.AiterMla)
RMS_NORM.register("aiter", aiter.supported, aiter_norm.supports_args, library=A)(aiter_norm.rms_norm)
FUSED_ADD_RMS_NORM.register("aiter", aiter.supported, aiter_norm.supports_args, library=A)(
    aiter_norm.fused_add_rms_norm)
ROTARY.register("aiter", aiter.supported, aiter_rotary.supports_args, library=A)(aiter_rotary.rotary)
MOE_ROUTE.register("aiter", aiter.supported, aiter_moe.route_supports_args, library=A)(
    aiter_moe.moe_route)
FUSED_MOE.register("aiter", aiter.supported, aiter_moe.fused_moe_supports_args, library=A)(
    aiter_moe.fused_moe)
# chunked prefill only, planned on the host: decode steps (and graphs) keep the Triton recurrent kernel
GATED_DELTA_RULE.register("aiter", aiter.supported, aiter_delta_rule.supports_args, graph_safe=False, library=A)(
    aiter_delta_rule.gated_delta_rule)
BLOCK_FP8_LINEAR.register("aiter", aiter.fp8_supported, aiter_gemm.block_supports_args, library=A)(
    aiter_gemm.block_fp8_linear)
FP8_LINEAR.register("aiter", aiter.fp8_supported, aiter_gemm.supports_args, library=A)(
    aiter_gemm.fp8_linear)
FP8_LINEAR.register("scaled_mm", scaled_mm.supported, scaled_mm.supports_args)(scaled_mm.fp8_linear)
CAPTURE_GRAPH.register("torch_graphs", graphs.supported)(graphs.capture)
ALL_REDUCE.register("aiter", aiter.supported, aiter_all_reduce.supports_args, library=A)(aiter_all_reduce.all_reduce)

BACKEND = BackendSpec(
    "rocm",
    priorities={
        "attention": ["aiter", "triton"],
        "mla_attention": ["aiter", "triton"],
        "rms_norm": ["aiter", "triton"],
        "fused_add_rms_norm": ["aiter", "triton"],
        "rotary": ["aiter", "triton"],
        "silu_and_mul": ["triton"],
        "gelu_and_mul": ["triton"],
        "causal_conv1d": ["triton"],
        "causal_conv1d_update": ["triton"],
        "gated_delta_rule": ["aiter", "triton"],
        "moe_route": ["aiter", "triton"],
        "fused_moe": ["aiter", "triton"],
        "fp8_linear": ["aiter", "scaled_mm", "triton"],
        "block_fp8_linear": ["aiter", "triton"],
        "capture_graph": ["torch_graphs"],
        "all_reduce": ["aiter"],
    },
    note="aiter where installed (gfx942/gfx950), shared Triton kernels (wave64 tuning) otherwise, fp8 e4m3fnuz "
         "on gfx942 / e4m3fn on gfx950, HIP graphs")
