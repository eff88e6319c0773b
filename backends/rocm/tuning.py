"""Launch parameters of the shared Triton kernels on AMD Instinct (gfx942 MI300X/MI325X, gfx950 MI350/MI355).

Wave64: a "warp" is 64 lanes, so fewer warps cover the same tile. `waves_per_eu` lets the compiler trade registers
for occupancy, and `matrix_instr_nonkdim=16` picks the 16x16 MFMA/MMA shapes for the dots. Software pipelining
(`num_stages`) beyond 2 does not help on these parts (LDS is the limit), so stages stay low.
"""
from resin.backends.triton.tuning import Tuning

TUNING = Tuning(
    vendor="rocm", warp_size=64, elementwise_warps=2,
    attention_block_m=64, attention_block_m_fp32=32,
    attention_warps=4, attention_stages=1, decode_target_programs=608,
    gemm_block=(64, 128, 64), gemm_warps=4, gemm_stages=2, gemm_block_fp32=(32, 64, 32),
    extra_launch={"waves_per_eu": 2, "matrix_instr_nonkdim": 16},
)
