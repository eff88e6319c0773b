"""One provider against native on one call: the comparison, the record of it, and dropping a provider that fails.
core/self_check.py decides which calls (the loaded model's own) and runs attention's two-step check.
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Any

import torch

from resin.hal.registry import Op, Provider, active_chains, drop_provider


@dataclass
class Check:
    op: str
    provider: str
    call: str  # the shapes it was checked on
    max_diff: float = 0.0
    tolerance: str = ""
    error: str | None = None
    version: str = ""

    @property
    def passed(self) -> bool:
        return self.error is None

    def describe(self) -> str:
        where = f"{self.op}: provider {self.provider} ({self.version}) on {self.call}"
        return f"{where}: ok, max |diff| {self.max_diff:.2e}" if self.passed else f"{where}: {self.error}"


@dataclass
class SelfCheckReport:
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def summary(self) -> str:
        providers = sorted({f"{c.op}={c.provider}" for c in self.checks if c.passed})
        head = (f"self-check: {len(self.checks) - len(self.failed)} of {len(self.checks)} provider checks passed "
                f"in {self.seconds * 1e3:.0f} ms ({', '.join(providers) or 'every op runs native'})")
        return "\n".join([head] + [f"  DROPPED {c.describe()}" for c in self.failed])


def version_of(provider: Provider) -> str:
    library = provider.library or "torch"
    try:
        return f"{library} {importlib.metadata.version(library)}"
    except importlib.metadata.PackageNotFoundError:
        return library


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_shape(v) for v in value) + ")"
    return repr(value)


def copy_inputs(value: Any) -> Any:
    if isinstance(value, torch.nn.Parameter):
        return value  # weights are read-only to providers (an op that rewrites them declares check_inputs)
    if isinstance(value, torch.Tensor):
        return value.clone()
    return value


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _leaves(v)]
    return []


def compare(got: Any, ref: Any, tolerance: dict[str, tuple[float, float]]) -> tuple[float, str | None, str]:
    """(max |diff|, why it fails or None, the tolerance applied)."""
    worst, applied = 0.0, ""
    got_t, ref_t = _leaves(got), _leaves(ref)
    if len(got_t) != len(ref_t):
        return float("inf"), f"returned {len(got_t)} tensors, native {len(ref_t)}", ""
    for g, r in zip(got_t, ref_t):
        if g.shape != r.shape:
            return float("inf"), f"shape {list(g.shape)} where native gives {list(r.shape)}", ""
        if not r.is_floating_point():
            if not torch.equal(g, r):
                return float("inf"), f"{int((g != r).sum())} of {r.numel()} integer outputs differ", "exact"
            continue
        rtol, atol = tolerance[str(r.dtype).removeprefix("torch.")]
        applied = f"rtol {rtol:g}, atol {atol:g}"
        g32, r32 = g.float(), r.float()
        diff = (g32 - r32).abs()
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        bad = ~(diff <= atol + rtol * r32.abs())
        if bool(bad.any()):
            return worst, f"max |diff| {worst:.3e} > tolerance ({applied}) at {int(bad.sum())} of {r.numel()}", applied
    return worst, None, applied


def _serving(chain: tuple[Provider, ...], args: tuple, kwargs: dict) -> Provider:
    return next(p for p in chain if p.supports_args is None or p.supports_args(*args, **kwargs) is None)


def check_call(op: Op, args: tuple, kwargs: dict, report: SelfCheckReport) -> None:
    """The provider serving this call against native; a failing one is dropped and the next one checked."""
    while True:
        provider = _serving(active_chains()[op.name], args, kwargs)
        if provider.name == "native":
            return
        inputs = op.check_inputs(*args, **kwargs) if op.check_inputs else (
            tuple(copy_inputs(a) for a in args), {k: copy_inputs(v) for k, v in kwargs.items()})
        check = Check(op.name, provider.name, _shape(inputs[0]), version=version_of(provider))
        reference = op.native(*(copy_inputs(a) for a in inputs[0]), **{k: copy_inputs(v) for k, v in inputs[1].items()})
        try:
            got = provider.fn(*inputs[0], **inputs[1])
            check.max_diff, check.error, check.tolerance = compare(got, reference, op.tolerance)
        except Exception as e:  # a provider that raises on the model's own call is as wrong as one that miscounts
            check.error = f"raised {type(e).__name__}: {str(e)[:200]}"
        report.checks.append(check)
        if check.passed:
            return
        drop_provider(op.name, provider.name)
