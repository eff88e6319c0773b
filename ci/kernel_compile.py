"""Compile recorded Triton launches ahead of time for a GPU that is not here, and read what the compiler made.

Triton's compiler needs no GPU: `triton.compile(ASTSource(...), target=GPUTarget(...))` lowers a kernel to AMDGCN
+ hsaco for gfx942/gfx950 and to PTX + cubin for sm_90/sm_100. A launch is bound exactly as Triton's runtime binds
it (its own binder: argument types, alignment and the equal-to-1 specialisations), so each compile is the one the
engine would trigger on that GPU. From the result: registers and spills (the AMDGCN kernel metadata; ptxas's own
`-v` log on NVIDIA), shared memory / LDS bytes, and an occupancy estimate from both.
"""
from __future__ import annotations

import contextlib
import io
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from resin.ci.kernel_launches import Launch


@dataclass(frozen=True)
class Target:
    name: str
    backend: str  # triton backend: "hip" or "cuda"
    arch: str | int
    warp_size: int
    vendor: str  # whose Tuning applies: "rocm" or "cuda"
    smem_limit: int  # bytes of shared memory / LDS one workgroup may use
    smem_per_unit: int  # per CU (AMD) or SM (NVIDIA), for occupancy
    fp8_dtype: torch.dtype

    def gpu_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


TARGETS: dict[str, Target] = {
    "gfx942": Target("gfx942", "hip", "gfx942", 64, "rocm", 64 << 10, 64 << 10, torch.float8_e4m3fnuz),
    "gfx950": Target("gfx950", "hip", "gfx950", 64, "rocm", 160 << 10, 160 << 10, torch.float8_e4m3fn),
    "sm_90": Target("sm_90", "cuda", 90, 32, "cuda", 227 << 10, 228 << 10, torch.float8_e4m3fn),
    "sm_100": Target("sm_100", "cuda", 100, 32, "cuda", 227 << 10, 228 << 10, torch.float8_e4m3fn),
}


@dataclass(frozen=True)
class Spec:
    """One kernel specialisation for one target: what triton.compile takes (all plain data, so a worker process
    can compile it), plus where the engine launches it."""
    target: str
    module: str
    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[Any, Any], ...]
    attrs: tuple[tuple[Any, Any], ...]
    options: tuple[tuple[str, Any], ...]

    def short(self) -> str:
        """The constexprs and dtypes that tell this specialisation from its siblings."""
        names = {(i,): name for i, (name, _) in enumerate(self.signature)}
        consts = ",".join(f"{names.get(k, k)}={v}" for k, v in self.constexprs if v is not None)
        dtypes = sorted({t.lstrip("*") for _, t in self.signature if t.startswith("*")})
        return f"{'/'.join(dtypes)} {consts} w{dict(self.options)['num_warps']}"


def bind(launch: Launch, target: Target) -> Spec:
    """Bind a recorded launch with Triton's own binder for `target`, as JITFunction.run would."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    backend = make_backend(target.gpu_target())
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    # the launch options this Triton release knows (fpsan_homomorphic_casts is newer than 3.6)
    options = {name: getattr(knobs.compilation, name) for name in ("instrumentation_mode", "fpsan_homomorphic_casts")
               if hasattr(knobs.compilation, name)}
    kwargs = {**launch.kwargs, "debug": False, **options}
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return Spec(target.name, fn.fn.__module__, fn.__name__, tuple(signature.items()),
                _frozen(constexprs), _frozen(attrs),
                tuple(sorted((k, _frozen(v)) for k, v in options.__dict__.items())))


def _frozen(value: Any) -> Any:
    """Options hold lists and dicts; a Spec is a dictionary key, so they become tuples."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


@dataclass
class Result:
    spec: Spec
    origin: str  # the first shape/phase that launches it
    launches: int  # how many recorded launches share this specialisation
    seconds: float = 0.0
    registers: int = 0  # VGPRs per lane on AMD, registers per thread on NVIDIA
    spills: int = 0  # spilled VGPRs+SGPRs on AMD; spill store+load bytes on NVIDIA
    shared: int = 0  # shared memory / LDS bytes per workgroup
    occupancy: int = 0  # waves per SIMD on CDNA, warps per SM on NVIDIA
    error: str | None = None

    def problems(self, target: Target) -> list[str]:
        out = []
        if self.error:
            out.append(f"compile error: {self.error}")
        if self.spills:
            out.append(f"spills ({self.spills} {'registers' if target.backend == 'hip' else 'bytes stored+loaded'})")
        if self.shared > target.smem_limit:
            out.append(f"shared memory {self.shared} B > {target.smem_limit} B")
        if not self.error and self.occupancy < 1:
            out.append("does not fit one workgroup on a compute unit")
        return out


def _amd_field(asm: str, name: str) -> int:
    m = re.search(rf"^\s*\.{name}:\s+(\d+)", asm, re.M)
    return int(m.group(1)) if m else 0


def _amd_metrics(kernel: Any, target: Target, num_warps: int) -> dict[str, int]:
    asm = kernel.asm["amdgcn"]
    total = re.search(r"TotalNumVgprs:\s+(\d+)", asm)
    vgprs = int(total.group(1)) if total else _amd_field(asm, "vgpr_count")
    lds = max(kernel.metadata.shared, _amd_field(asm, "group_segment_fixed_size"))
    by_vgpr = 512 // max(8, -(-vgprs // 8) * 8)  # 512 VGPRs per SIMD lane (arch + acc), granule 8
    groups = target.smem_per_unit // lds if lds else 8  # workgroups one CU's LDS holds
    by_lds = max(1, groups * num_warps // 4) if groups else 0  # waves per SIMD, 4 SIMDs per CU
    return dict(registers=vgprs, spills=_amd_field(asm, "vgpr_spill_count") + _amd_field(asm, "sgpr_spill_count"),
                shared=lds, occupancy=min(8, by_vgpr, by_lds))


def _nvidia_metrics(kernel: Any, target: Target, num_warps: int, ptxas_log: str) -> dict[str, int]:
    used = re.search(r"Used (\d+) registers", ptxas_log)
    if used is None:
        raise RuntimeError(f"no register count in ptxas's log (was the kernel read from a cache?): {ptxas_log!r}")
    regs = int(used.group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas_log))
    static_smem = re.search(r"(\d+) bytes smem", ptxas_log)
    smem = kernel.metadata.shared + (int(static_smem.group(1)) if static_smem else 0)
    per_warp = -(-regs * 32 // 256) * 256  # allocated per warp in units of 256
    blocks = min(32, (65536 // per_warp) // num_warps, target.smem_per_unit // (smem + 1024))  # 1 KiB reserved
    return dict(registers=regs, spills=spills, shared=smem, occupancy=min(64, blocks * num_warps))


def compile_spec(spec: Spec) -> dict[str, Any]:
    """Compile one specialisation (in a worker process); returns the Result fields it measured."""
    import importlib

    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    target = TARGETS[spec.target]
    fn = getattr(importlib.import_module(spec.module), spec.kernel)
    options = dict(spec.options)
    knobs.nvidia.dump_ptxas_log = True  # ptxas runs with -v anyway: its log has registers and spill bytes
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, dict(spec.signature), dict(spec.constexprs), dict(spec.attrs)),
                                    target=target.gpu_target(), options=options)
    except Exception as e:  # a compile error is the gate's finding, reported with the kernel that caused it
        return dict(seconds=time.perf_counter() - start, error=f"{type(e).__name__}: {str(e).strip()[:400]}")
    seconds = time.perf_counter() - start
    if target.backend == "hip":
        return dict(seconds=seconds, **_amd_metrics(kernel, target, options["num_warps"]))
    return dict(seconds=seconds, **_nvidia_metrics(kernel, target, options["num_warps"], log.getvalue()))
