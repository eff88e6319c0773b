"""Providers against native: the comparison, the record of each check, and the loop that drops a provider that
fails and checks the one behind it. core/self_check.py supplies the cases (the loaded model's own calls, and
attention's paged steps per layer kind).
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Any, Callable

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
    seed: int = 0  # of the random inputs: a failure can be reproduced with it

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def summary(self) -> str:
        dropped = {(c.op, c.provider) for c in self.failed}
        providers = sorted({f"{c.op}={c.provider}" for c in self.checks if (c.op, c.provider) not in dropped})
        head = (f"self-check: {len(self.checks) - len(self.failed)} of {len(self.checks)} provider checks passed "
                f"in {self.seconds * 1e3:.0f} ms, inputs seeded {self.seed} "
                f"({', '.join(providers) or 'every op runs native'})")
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


def _copy(value: Any) -> Any:
    if isinstance(value, torch.nn.Parameter):
        return value  # weights are read-only to providers (an op that rewrites them declares check_inputs)
    if isinstance(value, torch.Tensor):
        return value.clone()
    return value


def copy_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments with every non-parameter tensor copied, so no run sees another's in-place writes."""
    return tuple(_copy(a) for a in args), {k: _copy(v) for k, v in kwargs.items()}


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _leaves(v)]
    return []


def compare(got: Any, ref: Any, tolerance: dict[str, tuple[float, float]]) -> tuple[float, str | None, str]:
    """(max |diff| over finite values, why it fails or None, the tolerance applied). NaN matches NaN and an
    infinity the same infinity: a provider is judged on what native computes, overflow included."""
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
        finite = torch.isfinite(g32) & torch.isfinite(r32)
        if bool(finite.any()):
            worst = max(worst, float((g32 - r32).abs()[finite].max()))
        bad = ~torch.isclose(g32, r32, rtol=rtol, atol=atol, equal_nan=True)
        if bool(bad.any()):
            return worst, f"max |diff| {worst:.3e} > tolerance ({applied}) at {int(bad.sum())} of {r.numel()}", applied
    return worst, None, applied


def serving(op: str, accepts: Callable[[Provider], bool], in_graphs: bool) -> Provider | None:
    """The provider that serves a call now: the first that accepts it (graph-safe ones only, in graphs)."""
    return next((p for p in active_chains()[op] if (p.graph_safe or not in_graphs) and accepts(p)), None)


def check_op(op: str, cases: list[Any], accepts: Callable[[Provider, Any], bool],
             run: Callable[[Provider, Any], tuple[float, str | None, str]], describe: Callable[[Any], str],
             report: SelfCheckReport) -> None:
    """Check the provider serving each case, in eager steps and in captured ones, against native. A provider that
    fails is dropped and every case is checked again through the chain as it is then, so the provider behind it
    serves nothing it was not checked on."""
    passed: set[tuple[str, int]] = set()
    for in_graphs in (False, True):
        pending = True
        while pending:
            pending = False
            for i, case in enumerate(cases):
                provider = serving(op, lambda p: accepts(p, case), in_graphs)
                if provider is None or provider.name == "native" or (provider.name, i) in passed:
                    continue
                check = Check(op, provider.name, describe(case), version=version_of(provider))
                try:
                    check.max_diff, check.error, check.tolerance = run(provider, case)
                except Exception as e:  # raising on the model's own call is as wrong as miscounting
                    check.error = f"raised {type(e).__name__}: {str(e)[:200]}"
                report.checks.append(check)
                if check.passed:
                    passed.add((provider.name, i))
                    continue
                drop_provider(op, provider.name)
                pending = True
                break


def check_calls(op: Op, calls: list[tuple[tuple, dict]], report: SelfCheckReport) -> None:
    """An op's recorded calls (inputs made by op.check_inputs where it has one) against native."""
    cases = [op.check_inputs(*args, **kwargs) if op.check_inputs else (args, kwargs) for args, kwargs in calls]

    def run(provider: Provider, case: tuple[tuple, dict]) -> tuple[float, str | None, str]:
        args, kwargs = copy_call(*case)
        reference = op.native(*args, **kwargs)
        args, kwargs = copy_call(*case)
        return compare(provider.fn(*args, **kwargs), reference, op.tolerance)

    check_op(op.name, cases,
             lambda p, case: p.supports_args is None or p.supports_args(*case[0], **case[1]) is None,
             run, lambda case: _shape(case[0]), report)
