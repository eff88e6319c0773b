"""Registers the shared Triton kernels as "triton" providers on the HAL ops (imported by the cuda and rocm
backends). Kernel modules import triton, so they load on first call: selection can explain "triton is not
importable" on a machine without it, and `resin backends` never compiles anything."""
from __future__ import annotations

import importlib
from typing import Any, Callable

from resin.hal.attention import ATTENTION
from resin.hal.fp8 import BLOCK_FP8_LINEAR, FP8_LINEAR
from resin.hal.mla import MLA_ATTENTION
from resin.hal.moe import FUSED_MOE, MOE_ROUTE
from resin.hal.ops import FUSED_ADD_RMS_NORM, GELU_AND_MUL, RMS_NORM, ROTARY, SILU_AND_MUL
from resin.hal.platform import Platform
from resin.hal.recurrent import CAUSAL_CONV1D, CAUSAL_CONV1D_UPDATE, GATED_DELTA_RULE
from resin.hal.registry import needs_fp8

_MIN_SM = 80  # bf16 tensor cores
_ROCM_ARCHS = ("gfx90a", "gfx942", "gfx950")


def supported(platform: Platform) -> tuple[bool, str]:
    if platform.kind not in ("cuda", "rocm"):
        return False, "triton kernels need a GPU (on the cpu they run only interpreted, in tests)"
    if "triton" not in platform.libraries:
        return False, "triton is not importable (pip install 'resin[triton]')"
    if platform.kind == "cuda" and int(platform.arch.removeprefix("sm_") or 0) < _MIN_SM:
        return False, f"{platform.arch}: the kernels need sm_80 or newer"
    if platform.kind == "rocm" and platform.arch not in _ROCM_ARCHS:
        return False, f"{platform.arch}: the kernels are tuned for {', '.join(_ROCM_ARCHS)}"
    return True, ""


fp8_supported = needs_fp8(supported)


def _lazy(module: str, attr: str) -> Callable[..., Any]:
    """A function that imports resin.backends.triton.<module>.<attr> on its first call, then forwards."""
    target: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not target:
            target.append(getattr(importlib.import_module(f"resin.backends.triton.{module}"), attr))
        return target[0](*args, **kwargs)
    call.__name__ = f"triton.{module}.{attr}"
    return call


def _lazy_reason(module: str, cls: str) -> Callable[..., str | None]:
    """The attention class's unsupported_reason, imported on first call like _lazy."""
    def reason(*args: Any, **kwargs: Any) -> str | None:
        klass = getattr(importlib.import_module(f"resin.backends.triton.{module}"), cls)
        return klass.unsupported_reason(*args, **kwargs)
    return reason


T = "triton"  # the provider's name and its kernels' distribution
RMS_NORM.register(T, supported, _lazy("norm", "supports_args"), library=T)(_lazy("norm", "rms_norm"))
FUSED_ADD_RMS_NORM.register(T, supported, _lazy("norm", "supports_args"), library=T)(
    _lazy("norm", "fused_add_rms_norm"))
ROTARY.register(T, supported, library=T)(_lazy("rotary", "rotary"))
SILU_AND_MUL.register(T, supported, library=T)(_lazy("activation", "silu_and_mul"))
GELU_AND_MUL.register(T, supported, library=T)(_lazy("activation", "gelu_and_mul"))
# the attention class is imported lazily too, so its supports_graphs cannot be read here: it is graph-safe
ATTENTION.register(T, supported, _lazy_reason("attention", "TritonAttention"), graph_safe=True, library=T)(
    _lazy("attention", "TritonAttention"))
MLA_ATTENTION.register(T, supported, _lazy_reason("mla", "TritonMla"), graph_safe=True, library=T)(
    _lazy("mla", "TritonMla"))
MOE_ROUTE.register(T, supported, _lazy("moe", "route_supports_args"), library=T)(_lazy("moe", "moe_route"))
FUSED_MOE.register(T, supported, _lazy("moe", "fused_moe_supports_args"), library=T)(_lazy("moe", "fused_moe"))
FP8_LINEAR.register(T, fp8_supported, _lazy("fp8", "fp8_linear_supports_args"), library=T)(
    _lazy("fp8", "fp8_linear"))
BLOCK_FP8_LINEAR.register(T, fp8_supported, _lazy("block_fp8", "block_fp8_linear_supports_args"), library=T)(
    _lazy("block_fp8", "block_fp8_linear"))
CAUSAL_CONV1D.register(T, supported, _lazy("recurrent", "conv1d_supports_args"), library=T)(
    _lazy("recurrent", "causal_conv1d"))
CAUSAL_CONV1D_UPDATE.register(T, supported, _lazy("recurrent", "conv1d_supports_args"), library=T)(
    _lazy("recurrent", "causal_conv1d_update"))
GATED_DELTA_RULE.register(T, supported, _lazy("recurrent", "gdn_supports_args"), library=T)(
    _lazy("recurrent", "gated_delta_rule"))
