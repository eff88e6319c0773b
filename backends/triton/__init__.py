"""Triton kernels shared by the cuda and rocm backends (one source; vendor tuning lives in each backend's
tuning.py). Importing this package does not import triton: `providers.register()` does, once a GPU backend asks.

Every kernel here is tested against the HAL op's native implementation under TRITON_INTERPRET=1 on the CPU at
small shapes (tests/test_triton_kernels.py) and at real sizes on a GPU (tests/gpu/).
"""
