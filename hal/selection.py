"""Backend selection at startup: platform detection, the per-op table, and errors that say what to do."""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

from resin.hal.platform import (Platform, cpu_platform, detect_kind, gpu_platform, hypothetical_platform,
                                torch_build_summary)
from resin.hal.registry import OpChoice, SelectionError, activate, parse_overrides, resolve

BACKENDS = ("cpu", "cuda", "rocm")

_INSTALL_HINT = {
    "cuda": "install a CUDA build of PyTorch (pip install torch from PyTorch's CUDA wheel index) on a machine "
            "with an NVIDIA GPU and driver",
    "rocm": "install a ROCm build of PyTorch (pip install torch from PyTorch's ROCm wheel index) on a machine "
            "with an AMD Instinct GPU and the ROCm stack; `pip install resin[rocm]` adds aiter",
}


@dataclass(frozen=True)
class BackendSpec:
    """What a backend contributes: an ordered provider list per op (native is appended) and a note."""
    name: str
    priorities: dict[str, list[str]] = field(default_factory=dict)
    note: str = ""


@dataclass
class Selection:
    backend: BackendSpec
    platform: Platform
    table: dict[str, OpChoice]

    def format_table(self) -> str:
        rows = [("op", "provider", "why earlier providers were skipped")]
        for name, choice in self.table.items():
            why = "; ".join(f"{p}: {r}" for p, r in choice.skipped)
            if not why:
                why = "user override" if choice.overridden else (
                    "only provider on this backend" if len(choice.chain) == 1 else "first in priority order")
            if self.platform.supports_graphs and choice.chosen_in_graphs != choice.chosen:
                why += (f"; decode graphs use {choice.chosen_in_graphs} ({choice.chosen} is not graph-safe)"
                        if choice.chosen_in_graphs else "; no graph-safe provider: decode steps run eagerly")
            rows.append((name, choice.chosen, why))
        widths = [max(len(r[i]) for r in rows) for i in range(2)]
        return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows)


def load_backend(name: str) -> BackendSpec:
    """Import resin.backends.<name>: its import registers its providers on the HAL ops."""
    if name not in BACKENDS:
        raise SelectionError(f"unknown backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    return importlib.import_module(f"resin.backends.{name}").BACKEND


def _overrides(ops: str | dict[str, str] | None) -> dict[str, str]:
    merged = parse_overrides(os.environ.get("RESIN_OPS"))
    merged.update(parse_overrides(ops) if isinstance(ops, str) or ops is None else ops)
    return merged


def select_backend(requested: str = "auto", ops: str | dict[str, str] | None = None,
                   install: bool = True) -> Selection:
    """Choose the backend for this machine (or check the requested one is here) and resolve its op table."""
    present = detect_kind()
    name = present if requested in (None, "auto") else requested
    spec = load_backend(name)
    if name != "cpu" and name != present:
        raise SelectionError(
            f"--backend {name} was requested but no {name} device is usable here: found {torch_build_summary()}. "
            f"To fix: {_INSTALL_HINT[name]}; or use --backend cpu (or auto).")
    platform = cpu_platform() if name == "cpu" else gpu_platform()
    selection = Selection(spec, platform, resolve(spec.priorities, platform, _overrides(ops)))
    if install:
        activate(selection.table)
    return selection


def describe_backend(requested: str = "auto", arch: str | None = None,
                     ops: str | dict[str, str] | None = None, libraries: frozenset[str] | None = None) -> Selection:
    """The table a backend would use, also for hardware that is not here (a hypothetical platform of `arch`,
    with `libraries` assumed installed instead of those importable here)."""
    present = detect_kind()
    name = present if requested in (None, "auto") else requested
    spec = load_backend(name)
    if name == present and arch is None and libraries is None:
        platform = cpu_platform() if name == "cpu" else gpu_platform()
    else:
        platform = hypothetical_platform(name, arch, libraries)
    return Selection(spec, platform, resolve(spec.priorities, platform, _overrides(ops)))
