"""The reference backend: every op has the HAL's native, vectorised PyTorch implementation as its oracle.

Faster CPU providers join the priority lists only after they are measured to beat native (bench/) and tested
against it (tests/test_cpu_providers.py, tests/test_cpu_kernels.py): first Resin's C++ kernels (`cpp`: fused norms,
rotary, silu-and-mul, paged decode attention, prefill attention (bf16 on torch's AMX brgemm ukernels; fp32,
and bf16 without AMX, computed in fp32 on AVX2), the sampler's argmax and random draw, linear (bf16 on AVX512-BF16
over weights packed once into panels, at every row count where there is no AMX; fp32 for the few rows of decode
on AVX2), linear layers and embedding rows over packed GGUF / int8 weights; built once per machine),
tensor-parallel collectives through shared memory when the ranks share a machine, then plain-torch providers that
serve when no compiler is present (paged attention split into decode and prefill paths, rotary in whole-tensor
ops), and linear through oneDNN (bf16 with weights reordered once, for batches where oneDNN has AMX tiles; fp32
beyond the few rows). Latent attention (MLA) has a plain-torch provider of the same split (backends/cpu/mla.py).
"""
from resin.backends.cpu import cpp_linear, delta_rule, kernels, linear, quant, rotary, shm_collectives
from resin.backends.cpu.attention import CppAttention, CpuAttention
from resin.backends.cpu.mla import CpuMla
from resin.hal.attention import ATTENTION
from resin.hal.distributed import ALL_GATHER, ALL_REDUCE
from resin.hal.mla import MLA_ATTENTION
from resin.hal.ops import ARGMAX, FUSED_ADD_RMS_NORM, LINEAR, RANDOM_SAMPLE, RMS_NORM, ROTARY, SILU_AND_MUL
from resin.hal.quant import QUANT_EMBEDDING, QUANT_LINEAR
from resin.hal.recurrent import GATED_DELTA_RULE
from resin.hal.selection import BackendSpec

ATTENTION.register("cpp", supported=kernels.supported, supports_args=CppAttention.unsupported_reason)(CppAttention)
ATTENTION.register("cpu", supports_args=CpuAttention.unsupported_reason)(CpuAttention)
MLA_ATTENTION.register("cpu", supports_args=CpuMla.unsupported_reason)(CpuMla)
LINEAR.register("cpp", supported=cpp_linear.supported, supports_args=cpp_linear.supports_args)(cpp_linear.cpp_linear)
LINEAR.register("onednn", supported=linear.supported, supports_args=linear.supports_args)(linear.onednn_linear)
RMS_NORM.register("cpp", supported=kernels.supported, supports_args=kernels.norm_args)(kernels.rms_norm)
FUSED_ADD_RMS_NORM.register("cpp", supported=kernels.supported,
                            supports_args=kernels.add_norm_args)(kernels.fused_add_rms_norm)
ROTARY.register("cpp", supported=kernels.supported, supports_args=kernels.rotary_args)(kernels.rotary)
ROTARY.register("cpu", supports_args=rotary.supports_args)(rotary.rotary)
ARGMAX.register("cpp", supported=kernels.supported, supports_args=kernels.argmax_args)(kernels.argmax)
RANDOM_SAMPLE.register("cpp", supported=kernels.supported, supports_args=kernels.random_sample_args)(
    kernels.random_sample)
SILU_AND_MUL.register("cpp", supported=kernels.supported, supports_args=kernels.act_args)(kernels.silu_and_mul)
QUANT_LINEAR.register("cpp", supported=kernels.supported, supports_args=quant.supports_args)(quant.quant_linear)
QUANT_EMBEDDING.register("cpp", supported=kernels.supported,
                         supports_args=quant.embedding_args)(quant.quant_embedding)
# tensor-parallel ranks on one machine: collectives through shared memory (gloo's loopback TCP is ~1.4 ms each)
ALL_REDUCE.register("shm", supported=shm_collectives.supported,
                    supports_args=shm_collectives.all_reduce_args)(shm_collectives.all_reduce)
ALL_GATHER.register("shm", supported=shm_collectives.supported,
                    supports_args=shm_collectives.gather_args)(shm_collectives.all_gather)
GATED_DELTA_RULE.register("chunked", supports_args=delta_rule.supports_args)(delta_rule.chunked_gated_delta_rule)

BACKEND = BackendSpec("cpu", priorities={"attention": ["cpp", "cpu"], "mla_attention": ["cpu"],
                                         "linear": ["cpp", "onednn"],
                                         "rms_norm": ["cpp"], "fused_add_rms_norm": ["cpp"],
                                         "rotary": ["cpp", "cpu"], "silu_and_mul": ["cpp"],
                                         "gated_delta_rule": ["chunked"], "quant_linear": ["cpp"],
                                         "quant_embedding": ["cpp"],
                                         "argmax": ["cpp"], "random_sample": ["cpp"],
                                         "all_reduce": ["shm"], "all_gather": ["shm"]},
                      note="PyTorch on the CPU with Resin's C++ kernels for the per-layer ops (built once per "
                           "machine; plain-torch providers where no compiler is found); bf16 linear over weights "
                           "packed once (C++ panels; oneDNN's GEMM where it has AMX tiles); GGUF / int8 weights kept "
                           "packed (C++ kernels); the gated delta rule in chunked form for prefill; latent attention "
                           "(MLA) in batched torch ops")
