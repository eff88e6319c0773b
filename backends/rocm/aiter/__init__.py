"""Thin adapters from HAL ops to aiter (PyPI `amd-aiter`, import name `aiter`), one module per op family.

Targets aiter v0.1.7.post2 (the PyPI wheel) through v0.1.20 (what ROCm vLLM images build): arguments that moved
between those versions are passed by keyword. aiter is imported on first call, never at selection: its first
import JIT-compiles C++ modules with hipcc (minutes; cached under aiter's jit/ build folder, set AITER_JIT_DIR to
keep it across containers).

UNTESTED ON HARDWARE: this project has had no AMD GPU. Everything around these calls (selection, shapes, the
Triton fallbacks they share a contract with) is tested on the cpu; the calls themselves follow aiter's sources and
vLLM's ROCm code, and tests/gpu/ runs them against native where aiter is installed.
"""
from __future__ import annotations

import importlib
from typing import Any

from resin.hal.platform import Platform
from resin.hal.registry import needs_fp8

ARCHS = ("gfx942", "gfx950")  # CDNA3 / CDNA4, as vLLM gates aiter
DISTRIBUTION = "amd-aiter"  # PyPI name (imports as aiter; PyPI's `aiter` is an unrelated package)


def supported(platform: Platform) -> tuple[bool, str]:
    if platform.kind != "rocm":
        return False, "aiter runs on AMD GPUs only"
    if "aiter" not in platform.libraries:
        return False, "aiter is not importable (pip install 'resin[rocm]', PyPI amd-aiter)"
    if platform.arch not in ARCHS:
        return False, f"{platform.arch}: aiter kernels target {', '.join(ARCHS)}"
    return True, ""


def _with_triton(platform: Platform) -> tuple[bool, str]:
    ok, why = supported(platform)
    if ok and "triton" not in platform.libraries:
        return False, ("activation quantisation uses the Triton kernel: triton is not importable "
                       "(pip install 'resin[triton]')")
    return ok, why


fp8_supported = needs_fp8(_with_triton)


def aiter_module(name: str = "aiter") -> Any:
    """import aiter (or one of its submodules) on first use."""
    return importlib.import_module(name)


def first_module(*names: str) -> Any:
    """The first importable of several module paths (aiter moved some between versions)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {names} is importable in this aiter version")
