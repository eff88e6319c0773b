"""NVIDIA backend. Today it has no kernels of its own: every op runs the HAL's native PyTorch implementation on
the GPU. Triton kernels, flash-attn/flashinfer providers and CUDA graphs join the priority lists here."""
from resin.hal.selection import BackendSpec

BACKEND = BackendSpec("cuda", priorities={},
                      note="no GPU kernels registered yet: every op runs its native PyTorch implementation on the GPU")
