"""`python -m resin.ci kernels`: compile every Triton kernel specialisation the engine launches for gfx942, gfx950,
sm_90 and sm_100 on this (GPU-less) machine, print what the compiler made, and fail on a compile error, any spill,
or shared memory / LDS over the arch's limit.

The launches come from kernel_plan (the engine's real providers over the shapes in kernel_shapes, under each
vendor's Tuning, in each arch's fp8 flavour); each distinct specialisation is compiled once per target, in a fresh
Triton cache (so every run compiles for real and the times are true), on all cores.
"""
from __future__ import annotations

import json
import os
import tempfile
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from typing import Iterable

from resin.ci.kernel_compile import TARGETS, Result, Spec, Target, bind, compile_spec
from resin.ci.kernel_plan import DecodeLaunches, record


@dataclass
class GateReport:
    results: dict[str, list[Result]]  # target -> one Result per specialisation
    decode_launches: dict[str, list[DecodeLaunches]] = field(default_factory=dict)  # vendor -> per model shape

    def problems(self) -> list[str]:
        return [f"{r.spec.target} {r.spec.kernel} [{r.spec.short()}] (from {r.origin}): {p}"
                for name, rows in self.results.items() for r in rows for p in r.problems(TARGETS[name])]

    def summary_rows(self) -> list[tuple]:
        """One row per (kernel, target): specialisations, worst registers/spills/shared/occupancy, compile time."""
        rows = []
        for name, results in self.results.items():
            by_kernel: dict[str, list[Result]] = {}
            for r in results:
                by_kernel.setdefault(r.spec.kernel, []).append(r)
            for kernel, rs in sorted(by_kernel.items()):
                ok = [r for r in rs if not r.error]
                rows.append((kernel, name, len(rs), max((r.registers for r in ok), default=0),
                             sum(r.spills for r in ok), max((r.shared for r in ok), default=0),
                             min((r.occupancy for r in ok), default=0), sum(r.seconds for r in rs),
                             sum(1 for r in rs if r.error)))
        return rows

    def format(self, every_specialisation: bool = False) -> str:
        lines = []
        head = ("kernel", "target", "specs", "regs", "spills", "shared B", "occupancy", "compile s", "errors")
        rows = [head] + [(k, t, str(n), str(reg), str(sp), str(sh), _occ(t, oc), f"{sec:.1f}", str(err))
                         for k, t, n, reg, sp, sh, oc, sec, err in self.summary_rows()]
        lines += _table(rows)
        if every_specialisation:
            lines.append("")
            rows = [("kernel", "target", "specialisation", "regs", "spills", "shared B", "occupancy", "s", "from")]
            for name, results in self.results.items():
                for r in sorted(results, key=lambda r: (r.spec.kernel, r.spec.short())):
                    rows.append((r.spec.kernel, name, r.spec.short(), str(r.registers), str(r.spills),
                                 str(r.shared), _occ(name, r.occupancy), f"{r.seconds:.2f}",
                                 r.origin + (f" (+{r.launches - 1})" if r.launches > 1 else "")))
            lines += _table(rows)
        for vendor, counts in self.decode_launches.items():
            lines.append(f"\nKernel launches per decode step ({vendor} tuning; graphs replay them as one):")
            rows = [("model", "triton/layer", "torch/layer", "triton+torch outside layers", "layers", "per step")]
            for c in counts:
                triton, torch_ops = c.per_step()
                rows.append((c.shape, str(c.count.triton_per_layer), str(c.count.torch_per_layer),
                             f"{c.count.triton_outside}+{c.count.torch_outside}", str(c.layers),
                             f"{triton + torch_ops} ({triton} triton)"))
            lines += _table(rows)
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"results": {t: [{**asdict(r), "spec": r.spec.short(), "kernel": r.spec.kernel} for r in rs]
                            for t, rs in self.results.items()},
                "decode_launches": {v: [{"shape": c.shape, "layers": c.layers, **asdict(c.count)} for c in cs]
                                    for v, cs in self.decode_launches.items()}}


def _occ(target: str, value: int) -> str:
    return f"{value} waves/SIMD" if TARGETS[target].backend == "hip" else f"{value} warps/SM"


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _quiet_worker() -> None:
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")


def specialisations(targets: Iterable[Target],
                    shapes: list[str] | None = None) -> tuple[dict[str, dict[Spec, Result]], dict[str, list]]:
    """Record the engine's launches once per (vendor, fp8 flavour) and bind them for each target, deduplicated."""
    out: dict[str, dict[Spec, Result]] = {}
    counts: dict[str, list[DecodeLaunches]] = {}
    recorded: dict[tuple, list] = {}
    for target in targets:
        key = (target.vendor, target.fp8_dtype)
        if key not in recorded:
            launches, decode = record(target.vendor, target.fp8_dtype, shapes)
            recorded[key] = launches
            counts.setdefault(target.vendor, decode)
        specs: dict[Spec, Result] = {}
        for launch in recorded[key]:
            spec = bind(launch, target)
            if spec in specs:
                specs[spec].launches += 1
            else:
                specs[spec] = Result(spec, launch.origin, 1)
        out[target.name] = specs
    return out, counts


def run_gate(target_names: list[str], jobs: int | None = None, shapes: list[str] | None = None) -> GateReport:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("the cross-compile gate compiles for real GPU targets: unset TRITON_INTERPRET")
    unknown = sorted(set(target_names) - set(TARGETS))
    if unknown:
        raise ValueError(f"unknown target(s) {unknown}; known: {', '.join(TARGETS)}")
    saved = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="resin-triton-cache-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # inherited by the workers: every run really compiles
        try:
            # Workers fork now, while this process is small: recording builds (unread) real-size weights.
            with ProcessPoolExecutor(jobs or os.cpu_count() or 1, mp_context=get_context("fork"),
                                     initializer=_quiet_worker) as pool:
                list(pool.map(int, range(jobs or os.cpu_count() or 1)))
                specs, counts = specialisations([TARGETS[n] for n in target_names], shapes)
                if not any(specs.values()):
                    raise ValueError(f"no shape matches {shapes}; see resin.ci.kernel_shapes")
                todo = [r for per_target in specs.values() for r in per_target.values()]
                for result, measured in zip(todo, pool.map(compile_spec, [r.spec for r in todo])):
                    for name, value in measured.items():
                        setattr(result, name, value)
        finally:
            if saved is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = saved
    return GateReport({name: list(per_target.values()) for name, per_target in specs.items()}, counts)


def write_json(report: GateReport, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=1)
