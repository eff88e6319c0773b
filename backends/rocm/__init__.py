"""AMD backend (gfx942 MI300X/MI325X, gfx950 MI350/MI355). Today it has no kernels of its own: every op runs the
HAL's native PyTorch implementation on the GPU. aiter adapters (imported lazily) and Triton kernels join the
priority lists here."""
from resin.hal.selection import BackendSpec

BACKEND = BackendSpec("rocm", priorities={},
                      note="no GPU kernels registered yet: every op runs its native PyTorch implementation on the GPU")
