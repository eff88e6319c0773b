"""Ops, providers and the selection table.

An op is declared once with its native (plain PyTorch) implementation, which defines what is correct. Backends
register further providers on it, each with a static `supported(platform)` check and an optional per-call
`supports_args(...)` check. At startup a backend's priority list for each op is filtered by `supported` into a
chain that always ends in `native`; calls walk the chain to the first provider that accepts the arguments.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

from resin.hal.platform import Platform

# Returns (ok, reason). The reason explains a refusal ("aiter not importable", "gfx90a: no fp8").
SupportedFn = Callable[[Platform], "tuple[bool, str]"]
# Returns None when the call is accepted, else why not (head size, dtype, ...).
SupportsArgsFn = Callable[..., "str | None"]


def always(_: Platform) -> tuple[bool, str]:
    return True, ""


@dataclass(frozen=True)
class Provider:
    name: str
    fn: Callable[..., Any]
    supported: SupportedFn = always
    supports_args: SupportsArgsFn | None = None
    graph_safe: bool = True  # may run inside graph capture: no host syncs, no data-dependent shapes
    library: str | None = None  # the distribution its kernels come from (its version is shown by self-checks)


# How far a provider may be from native in the startup self-check, per dtype: (rtol, atol) elementwise.
DEFAULT_TOLERANCE = {"float32": (1e-4, 1e-4), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}


class Op:
    """A HAL op. Calling it runs the active backend's chain of providers for this op.

    tolerance: how far a provider may be from native in the startup self-check (dtype name -> (rtol, atol));
    check_inputs: turns a call recorded from the model into the inputs the self-check runs (default: the same
    arguments, non-parameter tensors copied), for ops whose real inputs are too large to copy or that a provider
    may rewrite in place; self_checked=False: the self-check leaves it out (collectives: no single-rank answer)."""

    def __init__(self, name: str, native: Callable[..., Any], doc: str = "", native_graph_safe: bool = True,
                 tolerance: dict[str, tuple[float, float]] | None = None,
                 check_inputs: Callable[..., tuple[tuple, dict]] | None = None, self_checked: bool = True):
        self.name = name
        self.self_checked = self_checked  # False: the startup self-check runs it natively and never replays it
        self.native = native
        self.__doc__ = doc or native.__doc__
        self.providers: dict[str, Provider] = {"native": Provider("native", native, graph_safe=native_graph_safe)}
        self.tolerance = {**DEFAULT_TOLERANCE, **(tolerance or {})}
        self.check_inputs = check_inputs
        _OPS[name] = self

    def register(self, name: str, supported: SupportedFn = always, supports_args: SupportsArgsFn | None = None,
                 graph_safe: bool | None = None, library: str | None = None) -> Callable[[Callable], Callable]:
        """Decorator used by backends: `@RMS_NORM.register("triton", supported=..., supports_args=...)`.
        graph_safe defaults to the provider's own `supports_graphs` (attention backends say it on the class),
        else True. library: the PyPI distribution of its kernels ("triton", "amd-aiter"), for version reports."""
        if name == "native":
            raise ValueError("'native' is the op's own definition and cannot be replaced")

        def deco(fn: Callable) -> Callable:
            safe = getattr(fn, "supports_graphs", True) if graph_safe is None else graph_safe
            self.providers[name] = Provider(name, fn, supported, supports_args, safe, library)
            return fn
        return deco

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        chain = _ACTIVE.get(self.name)
        if chain is None:
            return self.native(*args, **kwargs)
        mode = _MODE.get()
        if mode is not None and mode is not _GRAPH:
            return mode(self, args, kwargs)  # an interceptor: the self-check recording the model's calls
        in_graph = mode is _GRAPH
        for provider in chain:
            if in_graph and not provider.graph_safe:
                continue
            if provider.supports_args is None or provider.supports_args(*args, **kwargs) is None:
                return provider.fn(*args, **kwargs)
        if in_graph:
            names = ", ".join(p.name + ("" if p.graph_safe else " [not graph-safe]") for p in chain)
            raise GraphUnsafeError(f"op {self.name}: no graph-safe provider takes this call (chain: {names})")
        raise AssertionError(f"op {self.name}: chain without native")  # native accepts everything

    def __repr__(self) -> str:
        return f"Op({self.name}, providers={list(self.providers)})"


_OPS: dict[str, Op] = {}
# The only global mutable state: the provider chain of every op for the selected backend.
_ACTIVE: dict[str, tuple[Provider, ...]] = {}
_TRACING: set[str] | None = None  # set only inside trace_ops()
# How op calls are dispatched right now. None: the chain. _GRAPH while a decode step is captured into (or replayed
# from) a graph: calls skip providers that are not graph-safe, so a provider that cannot be captured costs graphs
# nothing (eager steps still use it). A callable (op, args, kwargs) intercepts every call (intercept_calls).
_GRAPH = object()
_MODE: ContextVar[Any] = ContextVar("resin_call_mode", default=None)


class GraphUnsafeError(RuntimeError):
    """Raised inside graph capture by an op call that no graph-safe provider takes."""


@contextmanager
def graph_phase() -> Iterator[None]:
    """Op calls inside the block use the first graph-safe provider that takes them (decode-graph capture/replay)."""
    token = _MODE.set(_GRAPH)
    try:
        yield
    finally:
        _MODE.reset(token)


@contextmanager
def intercept_calls(handler: Callable[["Op", tuple, dict], Any]) -> Iterator[None]:
    """Every op call inside the block (with a backend active) goes to handler(op, args, kwargs) instead."""
    token = _MODE.set(handler)
    try:
        yield
    finally:
        _MODE.reset(token)


def drop_provider(op: str, provider: str) -> None:
    """Take a provider out of an op's active chain for this run (the self-check does, for one that is wrong)."""
    if provider == "native":
        raise ValueError("native defines the op and cannot be dropped")
    _ACTIVE[op] = tuple(p for p in _ACTIVE.get(op, ()) if p.name != provider)


def derived(tensor: Any, key: Any, make: Callable[[], Any]) -> Any:
    """A value a provider derives from a tensor once (a cast table, a repacked weight), kept on the tensor itself
    so it lives and dies with it. Tensors compare by value, so they cannot key a (weak) dictionary."""
    memo = tensor.__dict__.setdefault("_resin_derived", {})
    if key not in memo:
        memo[key] = make()
    return memo[key]


def all_ops() -> dict[str, Op]:
    return dict(_OPS)


def active_chains() -> dict[str, tuple[Provider, ...]]:
    """A copy of the active table (op -> provider chain), e.g. to wrap providers for profiling and restore."""
    return dict(_ACTIVE)


def activate_chains(chains: dict[str, tuple[Provider, ...]]) -> None:
    _ACTIVE.clear()
    for name, chain in chains.items():
        if _TRACING is not None:
            chain = tuple(replace(p, fn=_recording(name, p.fn, _TRACING)) for p in chain)
        _ACTIVE[name] = chain


def needs_fp8(supported: SupportedFn) -> SupportedFn:
    """`supported`, and the platform has an fp8 dtype."""
    def check(platform: Platform) -> tuple[bool, str]:
        ok, why = supported(platform)
        if ok and platform.fp8_dtype is None:
            return False, f"{platform.arch}: no fp8"
        return ok, why
    return check


def graph_substitutions() -> dict[str, tuple[str, str]]:
    """Active ops whose captured decode steps use another provider than eager steps: op -> (eager, in graphs)."""
    out = {}
    for name, chain in sorted(_ACTIVE.items()):
        safe = next((p.name for p in chain if p.graph_safe), None)
        if chain and safe is not None and safe != chain[0].name:
            out[name] = (chain[0].name, safe)
    return out


def deactivate() -> None:
    _ACTIVE.clear()


@contextmanager
def trace_ops() -> Iterator[set[str]]:
    """Record which ops are called inside the block (for `resin models`), also across a backend selection made
    inside it. Outside a trace the call path is untouched."""
    global _TRACING
    seen: set[str] = set()
    saved = dict(_ACTIVE)
    _TRACING = seen
    activate_chains(saved or {name: (op.providers["native"],) for name, op in _OPS.items()})
    try:
        yield seen
    finally:
        _TRACING = None
        _ACTIVE.clear()
        _ACTIVE.update(saved)


def _recording(name: str, fn: Callable[..., Any], seen: set[str]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        seen.add(name)
        return fn(*args, **kwargs)
    return call
