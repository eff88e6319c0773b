"""What the engine launches on a GPU, found on the CPU: every Triton kernel specialisation, and the launches per
decode step.

Each shape in kernel_shapes is built as a model (weights uninitialised: no kernel reads them here) and stepped
through the phases the engine runs: a mixed prefill + decode step, an eager decode-only step long enough to split
the key range, and the capture of every decode-graph bucket (DecodeGraphs itself, so the replay plans are the
engine's). Every op is called the way the engine calls it, through its registered Triton provider under the
vendor's Tuning, but launches are recorded instead of run (JITFunction.run is intercepted). A launch depends on
shapes, dtypes and the step's plan, never on values, so what flows on from op to op only needs the right shape and
valid indices: cheap ops pass on their native value, and the ops that would read weights (linear, fp8 linear,
fused MoE) or whose reference is costly (attention) pass on zeros of their output's shape.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from resin.hal.attention import AttentionBackend, AttentionLayer, AttentionMetadata, step_metadata
from resin.hal.registry import Provider, activate_chains, active_chains, all_ops

BLOCK_SIZE = 16  # the engine's default block size
MAX_GRAPH_BATCH = 256  # the engine's default largest decode-graph bucket


@dataclass(frozen=True)
class TensorArg:
    """What Triton specialises a tensor argument on (its dtype, its address's alignment), without the tensor: a
    recorded launch keeps no activation alive."""
    dtype: torch.dtype
    address: int

    def data_ptr(self) -> int:
        return self.address


@dataclass
class Launch:
    fn: Any  # the triton JITFunction
    args: tuple  # tensors as TensorArg
    kwargs: dict[str, Any]
    origin: str  # which shape, dtype and phase launched it


def _light(arg: Any) -> Any:
    return TensorArg(arg.dtype, arg.data_ptr()) if isinstance(arg, torch.Tensor) else arg


@dataclass
class StepCount:
    """Launches of one decode step: Triton kernels and other device kernels (torch ops that are not views)."""
    triton_per_layer: int = 0
    torch_per_layer: int = 0
    triton_outside: int = 0
    torch_outside: int = 0


# torch ops that launch nothing on a device: allocation and metadata
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh"}


class Recorder(TorchDispatchMode):
    """Collects Triton launches (instead of running them) and counts device kernels per layer of a step."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[Launch] = []
        self.origin = ""
        self.layer: int | None = None  # the decoder layer being run, None outside the layers
        self.counting: StepCount | None = None
        self.quiet = 0  # > 0 while native stand-ins compute values (the GPU does not run those ops)

    def _tally(self, kind: str) -> None:
        if self.counting is None or self.quiet:
            return
        where = "per_layer" if self.layer == 0 else ("outside" if self.layer is None else None)
        if where is not None:
            setattr(self.counting, f"{kind}_{where}", getattr(self.counting, f"{kind}_{where}") + 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.__name__.split(".")[0] not in _NO_KERNEL:
            self._tally("torch")
        return func(*args, **(kwargs or {}))

    @contextmanager
    def intercept(self) -> Iterator["Recorder"]:
        from triton.runtime.jit import JITFunction

        original = JITFunction.run

        def record(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            self.launches.append(Launch(fn, tuple(_light(a) for a in args),
                                        {k: _light(v) for k, v in kwargs.items()}, self.origin))
            self._tally("triton")

        JITFunction.run = record
        try:
            with self:
                yield self
        finally:
            JITFunction.run = original

    @contextmanager
    def native(self) -> Iterator[None]:
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    def device_op(self) -> None:
        """A stand-in ran for a GPU op that is not Triton (a cuBLAS GEMM): count its kernel launch."""
        self._tally("torch")


# Ops whose native reference would read the weights or cost much: a zero tensor of the output's shape stands in.
_STAND_INS: dict[str, Callable[..., torch.Tensor]] = {
    "linear": lambda x, weight, *args, **kwargs: x.new_zeros(*x.shape[:-1], weight.shape[0]),
    "fp8_linear": lambda x, weight, *args, **kwargs: x.new_zeros(*x.shape[:-1], weight.shape[0]),
    "block_fp8_linear": lambda x, weight, *args, **kwargs: x.new_zeros(*x.shape[:-1], weight.shape[0]),
    "fused_moe": lambda x, *args, **kwargs: torch.zeros_like(x),
    "gated_delta_rule": lambda q, k, v, *args, **kwargs: torch.zeros_like(v),  # a token-by-token loop
}


def _shadow(rec: Recorder, kernel: Provider | None, value: Callable[..., Any]) -> Callable[..., Any]:
    """Launch the Triton provider (recorded) if it takes the call, then compute the value to pass on."""
    def call(*args: Any, **kwargs: Any) -> Any:
        if kernel is None:
            rec.device_op()  # a torch op on the GPU (cuBLAS GEMM): one launch
        elif kernel.supports_args is None or kernel.supports_args(*args, **kwargs) is None:
            kernel.fn(*args, **kwargs)
        with rec.native():
            return value(*args, **kwargs)
    return call


def _shadow_attention(rec: Recorder, kernel: type[AttentionBackend]) -> type[AttentionBackend]:
    class Shadow(AttentionBackend):
        supports_graphs = True

        def __init__(self, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype, device: torch.device):
            super().__init__(layers, block_size, dtype, device)
            self.kernel = kernel(layers, block_size, dtype, device)
            self.kv_cache_shape = self.kernel.kv_cache_shape

        def plan(self, meta: AttentionMetadata) -> None:
            self.kernel.plan(meta)

        def capture_state(self, max_batch: int) -> None:
            self.kernel.capture_state(max_batch)

        def plan_for_replay(self, batch_size: int, meta: AttentionMetadata) -> None:
            self.kernel.plan_for_replay(batch_size, meta)

        def forward(self, layer_idx, q, k, v, kv_cache, sinks=None):
            self.kernel.forward(layer_idx, q, k, v, kv_cache, sinks)
            layer = self.layers[layer_idx]
            with rec.native():  # latent attention returns each head's value (v_head_dim)
                return q.new_zeros(q.shape[0], layer.num_heads * (getattr(layer, "value_size", 0) or layer.head_size))
    return Shadow


@contextmanager
def recording_providers(rec: Recorder) -> Iterator[None]:
    """Every op launches its Triton provider, recorded; what flows on is the native op's value, or a zero stand-in
    of the right shape (kernel_launches' docstring says why values do not matter here)."""
    chains: dict[str, tuple[Provider, ...]] = {}
    for name, op in all_ops().items():
        kernel = op.providers.get("triton")
        if name in ("attention", "mla_attention"):
            fn = _shadow_attention(rec, kernel.fn)
        elif kernel is not None or name in _STAND_INS:
            fn = _shadow(rec, kernel, _STAND_INS.get(name, op.native))
        else:  # embedding, graph capture: torch ops on a GPU too, counted as such by the dispatch mode
            fn = op.native
        chains[name] = (Provider("recorded", fn),)
    saved = active_chains()
    activate_chains(chains)
    try:
        yield
    finally:
        activate_chains(saved)


@dataclass
class Batch:
    """A step's sequences: new tokens and context already cached, each; sequence i owns a run of blocks."""
    q_lens: list[int]
    ctx_lens: list[int]
    meta: AttentionMetadata = field(init=False)
    input_ids: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        per_seq = -(-max(q + c for q, c in zip(self.q_lens, self.ctx_lens)) // BLOCK_SIZE)
        tables = torch.arange(len(self.q_lens) * per_seq).view(len(self.q_lens), per_seq)
        self.meta = step_metadata(tables, self.q_lens, self.ctx_lens, BLOCK_SIZE)
        self.positions = torch.cat([torch.arange(c, c + q) for q, c in zip(self.q_lens, self.ctx_lens)])
        self.input_ids = torch.zeros(self.positions.shape[0], dtype=torch.long)

    @property
    def num_blocks(self) -> int:
        return self.meta.block_tables.numel()


MIXED = Batch([7, 1, 33, 1], [0, 40, 5, 100])  # prefill chunks beside decodes
LONG_DECODE = Batch([1, 1], [300, 410])  # few sequences, long context: the key range is split
