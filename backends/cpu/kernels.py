"""Resin's C++ CPU kernels (csrc/*.cpp): built once per machine, then providers of the per-layer ops and of
linear layers over quantised weights (the plain linear's provider is cpp_linear.py).

The sources are compiled with the machine's C++ compiler through torch.utils.cpp_extension (ninja) on first use
and cached under the Resin cache folder, keyed by the source, the torch version, the Python ABI, the compiler and
the CPU's instruction set (it is built with -march=native). Without a compiler, or if the build fails, the `cpp`
providers report why and the ops fall through to the plain-torch providers: the engine never depends on the build.

Each provider computes what the native op computes (tests/test_cpu_kernels.py compares them on fresh random
inputs): rotary bit for bit, norms and activations to within fp32 summation order / the last bit of exp before
rounding. Rotary rotates q and k in place, which the HAL op allows.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from resin.hal.platform import Platform
from resin.hal.registry import derived

log = logging.getLogger("resin")

_CSRC = Path(__file__).with_name("csrc")
SOURCES = [_CSRC / name for name in ("cpu_kernels.cpp", "fp32_linear.cpp", "bf16_linear.cpp", "quant_kernels.cpp",
                                     "quant_fma_rows.cpp", "prefill_attention.cpp", "prefill_attention_f32.cpp")]
# part of the build key: a header's change rebuilds too
HEADERS = [_CSRC / name for name in ("quant_blocks.h", "simd.h", "bf16_panels.h", "prefill_bf16_tiles.h")]
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FAILED = "build-failed.txt"  # in the build folder: the first error of a failed build, so later starts skip it
# -fno-trapping-math lets GCC vectorise floor and float selects (it changes no value, only FP exception flags);
# OpenMP because at::parallel_for's header is inline OpenMP.
_FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-fopenmp"]


def _cpu_signature() -> str:
    """The instruction-set flags of this CPU: a binary built with -march=native is only valid where they match."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86 / aarch64
                return line
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _compiler() -> str:
    """The compiler torch's builder will use: $CXX, else c++."""
    return os.environ.get("CXX", "c++")


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build_dir() -> Path:
    from resin.builtin import cache_root

    parts = [*(source.read_bytes() for source in SOURCES + HEADERS), torch.__version__,
             sysconfig.get_config_var("EXT_SUFFIX") or "", " ".join(_FLAGS), _compiler_version(_compiler()),
             _cpu_signature()]
    key = hashlib.sha256(b"\0".join(x if isinstance(x, bytes) else x.encode() for x in parts)).hexdigest()[:16]
    return cache_root() / "cpu_kernels" / key


def missing_toolchain() -> str | None:
    """Why the kernels cannot be built here (no compiler, no ninja), or None when they can."""
    compiler = _compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH: install g++ to build Resin's CPU kernels"
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        # The pip package (a dependency) puts ninja in the venv's bin, which is on PATH only in an activated venv;
        # torch's builder looks it up on PATH.
        try:
            import ninja
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
        except (ImportError, AttributeError):
            pass
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed: pip install ninja to build Resin's CPU kernels"
    return None


@cache
def load() -> tuple[ModuleType | None, str]:
    """(module, "") once built, else (None, why not). Built at most once per process, cached across processes."""
    missing = missing_toolchain()
    if missing:
        return None, missing
    from torch.utils import cpp_extension

    folder = None
    try:
        folder = build_dir()
        name = f"resin_cpu_kernels_{folder.name}"
        failed = folder / _FAILED
        if failed.exists():  # this source failed with this compiler before: don't spend a minute failing again
            return None, f"{failed.read_text().strip()} (delete {folder} to retry)"
        if not (folder / f"{name}.so").exists():
            log.warning("building Resin's C++ CPU kernels into %s (once per machine; about a minute)", folder)
        folder.mkdir(parents=True, exist_ok=True)
        # torch's builder waits, without a timeout, while a `lock` file exists in the folder; a build killed
        # midway leaves one behind. An flock (released by the OS when its holder dies) serialises builds here,
        # so a `lock` found while holding it is stale and goes.
        with open(folder / "resin.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)
            module = cpp_extension.load(name=name, sources=[str(source) for source in SOURCES],
                                        build_directory=str(folder),
                                        extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # a broken toolchain must not take the engine down: the torch providers serve
        errors = [line for line in str(e).splitlines() if "error" in line] or [type(e).__name__]
        reason = f"building Resin's CPU kernels failed: {errors[0].strip()}"
        if folder is not None and folder.is_dir():
            try:
                (folder / _FAILED).write_text(reason)
            except OSError:
                pass
        return None, reason
    return module, ""


def supported(platform: Platform) -> tuple[bool, str]:
    if platform.kind != "cpu":
        return False, "Resin's C++ kernels run on the cpu"
    module, reason = load()
    return module is not None, reason


def extension() -> ModuleType:
    return load()[0]


def _rows_reason(x: torch.Tensor, name: str) -> str | None:
    if not x.is_cpu or x.dtype not in _DTYPES:  # is_cpu: 70 ns, device.type: 310 (checked ~250 times a step)
        return f"{name}: cpu float32/bfloat16/float16 only"
    if x.dim() < 1 or x.stride(-1) != 1:
        return f"{name}: last dim must be contiguous"
    return None


def norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> str | None:
    if weight.dtype != x.dtype or not weight.is_contiguous() or weight.shape != x.shape[-1:]:
        return "weight must be contiguous, of x's dtype and hidden size"
    return _rows_reason(x, "x")


# The wrappers stay lean: at batch-1 decode each runs 30-60 times a step around a ~1-2 us kernel.
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2:
        return extension().rms_norm(x, weight, eps)
    return extension().rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def add_norm_args(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> str | None:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        return "residual must match x in shape and dtype"
    return norm_args(x, weight, eps) or _rows_reason(residual, "residual")


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 2:
        return extension().fused_add_rms_norm(x, residual, weight, eps)
    out, res = extension().fused_add_rms_norm(x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1]),
                                              weight, eps)
    return out.view(x.shape), res.view(x.shape)


def rotary_args(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                head_size: int, is_neox: bool = True) -> str | None:
    if positions.dtype != torch.int64 or positions.dim() != 1 or not positions.is_contiguous():
        return "positions must be contiguous int64"
    if q.dim() != 2 or k.dim() != 2 or q.dtype != k.dtype:
        return "q and k must be (tokens, heads * head_size) of one dtype"
    if cos_sin_cache.shape[-1] > head_size or cos_sin_cache.shape[-1] % 2:
        return "rotary dims must be even and at most head_size"
    return _rows_reason(q, "q") or _rows_reason(k, "k")


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
           head_size: int, is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    table = cos_sin_cache if cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous() else derived(
        cos_sin_cache, "fp32", lambda: cos_sin_cache.float().contiguous())
    extension().rotary(positions, q, k, table, head_size, is_neox)
    return q, k


def act_args(x: torch.Tensor) -> str | None:
    if x.shape[-1] % 2:
        return "last dim must be even (gate | up)"
    return _rows_reason(x, "x")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2:
        return extension().silu_and_mul(x)
    out = extension().silu_and_mul(x.reshape(-1, x.shape[-1]))
    return out.view(*x.shape[:-1], out.shape[-1])


def argmax_args(scores: torch.Tensor) -> str | None:
    if not scores.is_cpu or scores.dtype != torch.float32 or scores.dim() != 2 or scores.shape[-1] == 0:
        return "cpu float32 (rows, n) scores only"
    if scores.stride(-1) != 1:
        return "rows must be contiguous"
    return None


def argmax(scores: torch.Tensor) -> torch.Tensor:
    return extension().argmax_rows(scores)


def random_sample_args(logits: torch.Tensor, uniforms: torch.Tensor) -> str | None:
    if not logits.is_cpu or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(-1) != 1:
        return "float32 (rows, vocab) cpu logits with contiguous rows only"
    if uniforms.dtype != torch.float64:
        return "float64 uniforms only"
    return None


def random_sample(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    return extension().random_sample(logits, uniforms)


@cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX). Elsewhere torch's bf16 GEMM is a scalar
    loop (a Zen 3 core pair: 1536x576 at 32 rows 3.2 ms in bf16, 0.5 in fp32), so bf16 products go through fp32."""
    from resin.hal.platform import cpu_platform

    return cpu_platform().has_native_bf16_matmul()


@cache
def amx_gemm() -> bool:
    """Whether torch's bf16 GEMM reaches AMX tiles here (oneDNN usable on a CPU with amx_bf16): it then beats
    Resin's hand-written bf16 loops from a few rows on (the panel GEMM of cpp_linear.py, the quantised one of
    quant.py)."""
    from resin.backends.cpu import linear
    from resin.hal.platform import cpu_platform

    platform = cpu_platform()
    return "amx_bf16" in platform.cpu_flags and linear.supported(platform)[0]


@cache
def brgemm_bf16() -> bool:
    """Whether torch's brgemm ukernel multiplies bf16 on AMX tiles here (cpublas packs bf16 only where oneDNN has
    them): the prefill attention kernel and the quantised AMX panels need it; elsewhere SDPA and the other GEMM
    paths serve."""
    return extension().flash_prefill_available()


@cache
def flash_prefill_f32() -> bool:
    """Whether the AVX2 prefill attention kernel is built here (AVX2 + FMA): fp32 prefill, and bf16 prefill where
    brgemm_bf16() is not (its products in bf16 where the build has AVX512-BF16); elsewhere they stay on SDPA."""
    return extension().flash_prefill_f32_available()
