"""The reference backend: every op is the HAL's native, vectorised PyTorch implementation.

It is the oracle other backends are tested against, so it registers no providers of its own yet; faster CPU
providers join its priority lists as they are measured to beat native.
"""
from resin.hal.selection import BackendSpec

BACKEND = BackendSpec("cpu", priorities={}, note="native PyTorch for every op (the reference)")
