"""Backend selection at startup: platform detection, the per-op table, and errors that say what to do."""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

from resin.hal.platform import (Platform, cpu_platform, detect_kind, gpu_platform, hypothetical_platform,
                                torch_build_summary)
from resin.hal.registry import Provider, activate_chains, all_ops


@dataclass
class OpChoice:
    """How one op was resolved: the chain in call order and why earlier providers were skipped."""
    op: str
    chain: list[Provider]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    overridden: bool = False

    @property
    def chosen(self) -> str:
        return self.chain[0].name

    @property
    def chosen_in_graphs(self) -> str | None:
        """The provider captured decode steps use: the first graph-safe one (None: graphs cannot run this op)."""
        return next((p.name for p in self.chain if p.graph_safe), None)


class SelectionError(ValueError):
    pass


def parse_overrides(text: str | None) -> dict[str, str]:
    """'attention=native,rms_norm=triton' -> {'attention': 'native', 'rms_norm': 'triton'}."""
    out: dict[str, str] = {}
    for item in (text or "").replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise SelectionError(f"op override {item!r} is not OP=PROVIDER (e.g. --ops attention=native)")
        op, provider = (s.strip() for s in item.split("=", 1))
        out[op] = provider
    return out


def resolve(priorities: dict[str, list[str]], platform: Platform,
            overrides: dict[str, str] | None = None) -> dict[str, OpChoice]:
    """Filter each op's priority list by `supported(platform)`; `native` always closes the chain."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(all_ops()))
    if unknown:
        raise SelectionError(f"override names unknown op(s) {unknown}; ops are: {sorted(all_ops())}")
    table: dict[str, OpChoice] = {}
    for name, op in sorted(all_ops().items()):
        order = [p for p in priorities.get(name, []) if p != "native"] + ["native"]
        forced = overrides.get(name)
        if forced is not None:
            if forced not in op.providers:
                raise SelectionError(f"--ops {name}={forced}: no provider {forced!r} for op {name!r}; "
                                     f"registered: {sorted(op.providers)}")
            ok, reason = op.providers[forced].supported(platform)
            if not ok:
                raise SelectionError(f"--ops {name}={forced}: provider {forced!r} is unavailable on "
                                     f"{platform.kind}/{platform.arch}: {reason}")
            order = [forced] + [p for p in order if p != forced]
        choice = OpChoice(name, [], overridden=forced is not None)
        for pname in order:
            provider = op.providers.get(pname)
            if provider is None:
                choice.skipped.append((pname, "not registered (its module is not part of this backend)"))
                continue
            ok, reason = provider.supported(platform)
            if ok:
                choice.chain.append(provider)
            else:
                choice.skipped.append((pname, reason))
        table[name] = choice
    return table


def activate(table: dict[str, OpChoice]) -> None:
    """Install a resolved table as the active one (done once, at startup, by backend selection)."""
    activate_chains({name: tuple(choice.chain) for name, choice in table.items()})


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

    def drop(self, op: str, provider: str, reason: str) -> None:
        """Record that a provider was taken out of an op's chain for this run (the self-check's verdict)."""
        choice = self.table[op]
        choice.chain = [p for p in choice.chain if p.name != provider]
        choice.skipped.append((provider, reason))

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
