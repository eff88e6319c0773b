"""Launch parameters of the shared Triton kernels on NVIDIA (H100 sm_90, B200 sm_100): warp32, 4-8 warps."""
from resin.backends.triton.tuning import Tuning

TUNING = Tuning(
    vendor="cuda", warp_size=32, elementwise_warps=4,
    attention_block_m=64, attention_block_m_fp32=32,
    attention_warps=4, attention_stages=3, decode_target_programs=264,
    gemm_block=(64, 128, 64), gemm_warps=4, gemm_stages=3, gemm_block_fp32=(32, 64, 32),
)
