"""Platform: facts about the machine, read once. It answers questions; it never edits configuration."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, replace

import torch

# fp8 flavour per architecture family: gfx942 (MI300) uses the "fnuz" encoding (max 240, 0x80 is NaN).
_FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")
# Optional kernel libraries whose presence decides providers. Import names (PyPI `amd-aiter` imports as aiter).
OPTIONAL_LIBRARIES = ("triton", "aiter", "flash_attn", "flashinfer", "flash_mla")


@dataclass(frozen=True)
class Platform:
    kind: str  # "cpu" | "cuda" | "rocm"
    device_name: str
    arch: str  # "x86_64-avx512", "sm_90", "gfx942"
    compute_units: int
    memory_total: int  # bytes
    memory_free: int  # bytes
    dtypes: tuple[torch.dtype, ...]
    fp8_dtype: torch.dtype | None
    supports_graphs: bool
    dist_backend: str
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    libraries: frozenset[str] = field(default_factory=frozenset)  # which OPTIONAL_LIBRARIES are importable
    hypothetical: bool = False  # built for "what would be chosen" questions, not detected

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.kind == "cpu" else "cuda")

    def has_native_bf16_matmul(self) -> bool:
        if self.kind != "cpu":
            return torch.bfloat16 in self.dtypes
        return bool({"amx_bf16", "avx512_bf16"} & self.cpu_flags)

    def describe(self) -> list[tuple[str, str]]:
        gib = 1 << 30
        return [
            ("kind", self.kind + (" (hypothetical)" if self.hypothetical else "")),
            ("device", self.device_name),
            ("arch", self.arch),
            ("compute units", str(self.compute_units)),
            ("memory", f"{self.memory_free / gib:.1f} GiB free of {self.memory_total / gib:.1f} GiB"),
            ("dtypes", ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)),
            ("fp8", str(self.fp8_dtype).removeprefix("torch.") if self.fp8_dtype else "none"),
            ("graphs", "yes" if self.supports_graphs else "no (eager)"),
            ("distributed", self.dist_backend),
            ("libraries", ", ".join(sorted(self.libraries)) or "none"),
        ]


def installed_libraries() -> frozenset[str]:
    """Importable without importing: aiter's first import JIT-compiles for minutes, so only its spec is looked up."""
    return frozenset(name for name in OPTIONAL_LIBRARIES if importlib.util.find_spec(name) is not None)


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _meminfo() -> tuple[int, int]:
    total = free = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                if key == "MemTotal":
                    total = int(value.split()[0]) * 1024
                elif key == "MemAvailable":
                    free = int(value.split()[0]) * 1024
    except OSError:
        pass
    return total, free


def cpu_platform() -> Platform:
    flags = _cpu_flags()
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "generic"
    total, free = _meminfo()
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return Platform(
        kind="cpu", device_name=_cpu_name(), arch=f"{os.uname().machine}-{isa}",
        compute_units=os.cpu_count() or 1, memory_total=total, memory_free=free, dtypes=dtypes,
        fp8_dtype=None, supports_graphs=False, dist_backend="gloo", cpu_flags=flags, libraries=installed_libraries(),
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def fp8_dtype_for_arch(arch: str) -> torch.dtype | None:
    if arch.startswith("gfx"):
        if arch in _FNUZ_ARCHS:
            return getattr(torch, "float8_e4m3fnuz", None)
        return torch.float8_e4m3fn if arch >= "gfx950" else None
    if arch.startswith("sm_"):
        return torch.float8_e4m3fn if int(arch[3:]) >= 89 else None
    return None


def gpu_platform() -> Platform:
    """The first visible CUDA/ROCm device (torch exposes both through torch.cuda)."""
    props = torch.cuda.get_device_properties(0)
    kind = "rocm" if torch.version.hip else "cuda"
    arch = props.gcnArchName.split(":")[0] if kind == "rocm" else f"sm_{props.major}{props.minor}"
    free, total = torch.cuda.mem_get_info(0)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return Platform(
        kind=kind, device_name=props.name, arch=arch, compute_units=props.multi_processor_count,
        memory_total=total, memory_free=free, dtypes=dtypes, fp8_dtype=fp8_dtype_for_arch(arch),
        supports_graphs=True, dist_backend="rccl" if kind == "rocm" else "nccl", libraries=installed_libraries(),
    )


def hypothetical_platform(kind: str, arch: str | None = None,
                          libraries: frozenset[str] | None = None) -> Platform:
    """A platform that is not here, to answer 'what would be chosen on an MI300X?' without the hardware.
    `libraries` are the kernel libraries to assume installed (default: those importable here)."""
    libraries = installed_libraries() if libraries is None else frozenset(libraries)
    default_arch = {"cuda": "sm_90", "rocm": "gfx942", "cpu": cpu_platform().arch}[kind]
    arch = arch or default_arch
    if kind == "cpu":
        return replace(cpu_platform(), hypothetical=True, libraries=libraries)
    return Platform(
        kind=kind, device_name=f"(not present) {arch}", arch=arch, compute_units=0, memory_total=0,
        memory_free=0, dtypes=(torch.float32, torch.bfloat16, torch.float16), fp8_dtype=fp8_dtype_for_arch(arch),
        supports_graphs=True, dist_backend="rccl" if kind == "rocm" else "nccl", libraries=libraries,
        hypothetical=True,
    )


def detect_kind() -> str:
    """ROCm if torch is a HIP build with a visible device; CUDA if a CUDA build with one; else cpu."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "rocm" if torch.version.hip else "cuda"
    return "cpu"


def torch_build_summary() -> str:
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return (f"torch {torch.__version__} (torch.version.cuda={torch.version.cuda}, "
            f"torch.version.hip={torch.version.hip}), {devices} GPU device(s) visible")
