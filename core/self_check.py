"""Trust, then verify: before serving, every provider the loaded model will call runs once against the op's native
implementation on the device, on fresh random inputs shaped like the model's own calls.

How: one forward of the model over a small ragged batch of random tokens runs with every op call intercepted; each
call is recorded (the first few distinct shapes per op) and answered by native, so the recorded inputs are right
even where a provider is not. Each recorded call then runs through the provider that would serve it, in eager
steps and (where it differs) in captured decode steps, and through native (core/provider_check.py). Attention is
checked per distinct layer kind over three steps through a paged cache: a ragged prefill whose last block is
partial (longer than the window where the window is short), decodes beside a prefill chunk and a new sequence,
then decode only; so a provider wrong in a corner (the last block, one GQA group, a window edge) shows. A
provider that disagrees or raises is dropped from its chain for this run, and the one behind it is checked in
its place; `strict` refuses to start instead, `off` skips all of it.
"""
from __future__ import annotations

import logging
import time

import torch

from resin.core.provider_check import SelfCheckReport, check_calls, check_op, compare, copy_call
from resin.hal.attention import AttentionLayer, ForwardContext, step_metadata
from resin.hal.mla import attention_op
from resin.hal.recurrent import RecurrentMetadata
from resin.hal.registry import Op, active_chains, intercept_calls

log = logging.getLogger("resin.self_check")

MODES = ("on", "strict", "off")
_SIGNATURES_PER_OP = 6  # distinct call shapes checked per op (a dense layer's linears + the head: 5)


class SelfCheckError(RuntimeError):
    """--self-check strict: a chosen provider disagreed with native (the message names it and by how much)."""


def _signature(args: tuple, kwargs: dict) -> str:
    shape = [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for v in (*args, *kwargs.values())]
    return repr((shape, sorted(kwargs)))


def _record_calls(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, block_size: int,
                  gen: torch.Generator) -> dict[Op, list[tuple[tuple, dict]]]:
    """op -> its first few distinct calls in one forward of the model (inputs copied), every call answered by
    native so that no provider under check shapes another's inputs."""
    calls: dict[Op, list[tuple[tuple, dict]]] = {}
    seen: dict[str, set[str]] = {}

    def record(op: Op, args: tuple, kwargs: dict):
        key, shapes = _signature(args, kwargs), seen.setdefault(op.name, set())
        if op.self_checked and key not in shapes and len(shapes) < _SIGNATURES_PER_OP:
            shapes.add(key)
            calls.setdefault(op, []).append(copy_call(args, kwargs))
        return op.native(*args, **kwargs)

    layers = model.attention_layers
    attn = attention_op(layers).native(layers, block_size, dtype, device)
    q_lens = [block_size + 5, 3]  # ragged: the first sequence ends in a partial block
    per_seq = -(-q_lens[0] // block_size)
    caches = [torch.zeros(attn.kv_cache_shape(2 * per_seq, block_size, layer.num_kv_heads, layer.head_size),
                          dtype=dtype, device=device) for layer in layers]
    meta = step_metadata(torch.arange(2 * per_seq).view(2, per_seq), q_lens, [0, 0], block_size, device)
    ids = torch.randint(0, model.config.vocab_size, (sum(q_lens),), generator=gen).to(device)
    positions = torch.cat([torch.arange(q) for q in q_lens]).to(device)
    ctx = ForwardContext([attn], caches, states=[layer.allocate(2, dtype, device)
                                                 for layer in getattr(model, "recurrent_layers", [])])
    if ctx.states:  # two fresh sequences, one slot each
        ctx.recurrent = RecurrentMetadata(meta.query_start_loc, torch.arange(2, dtype=torch.int32, device=device),
                                          torch.zeros(2, dtype=torch.bool, device=device), decode_only=False)
    with intercept_calls(record):
        attn.plan(meta)
        hidden = model.forward(ids, positions, ctx)
        model.compute_logits(hidden[-2:])
    return calls


def _attention_steps(block_size: int, layer: AttentionLayer) -> list[tuple[list[int], list[int], list[int]]]:
    """(rows of the block table, new tokens, cached tokens) per step, for three sequences."""
    first = layer.sliding_window + 3 if layer.sliding_window and layer.sliding_window <= 256 else block_size + 5
    return [([0, 1], [first, 3], [0, 0]),  # ragged prefill, the first ends in a partial block
            ([0, 1, 2], [1, 4, 2], [first, 3, 0]),  # a decode beside a chunk and a new sequence
            ([0, 1, 2], [1, 1, 1], [first + 1, 7, 2])]  # decode only


def _attention_check(cls: type, layer: AttentionLayer, dtype: torch.dtype, device: torch.device, block_size: int,
                     gen: torch.Generator) -> tuple[float, str | None, str]:
    steps = _attention_steps(block_size, layer)
    per_seq = -(-(steps[-1][1][0] + steps[-1][2][0]) // block_size)  # the first sequence is the longest
    op = attention_op([layer])
    backends = [cls([layer], block_size, dtype, device), op.native([layer], block_size, dtype, device)]
    caches = [torch.zeros(b.kv_cache_shape(3 * per_seq, block_size, layer.num_kv_heads, layer.head_size),
                          dtype=dtype, device=device) for b in backends]
    tables = torch.arange(3 * per_seq).view(3, per_seq)
    sinks = torch.randn(layer.num_heads, generator=gen).to(device) if layer.has_sinks else None
    worst = 0.0
    for rows, q_lens, ctx_lens in steps:
        meta = step_metadata(tables[rows], q_lens, ctx_lens, block_size, device)
        t = sum(q_lens)
        q, k, v = (x.to(device, dtype) for x in layer.random_inputs(t, gen))
        outs = []
        for backend, cache in zip(backends, caches):
            backend.plan(meta)
            outs.append(backend.forward(0, q.clone(), k.clone(), v.clone(), cache, sinks))
        diff, error, tolerance = compare(outs[0], outs[1], op.tolerance)
        worst = max(worst, diff)
        if error is not None:
            return worst, f"step with new tokens {q_lens} after {ctx_lens}: {error}", tolerance
    return worst, None, tolerance


def _check_attention(layers: list[AttentionLayer], dtype: torch.dtype, device: torch.device, block_size: int,
                     gen: torch.Generator, report: SelfCheckReport) -> None:
    """The attention provider serving the model's layers, on each distinct layer kind."""
    check_op(attention_op(layers).name, list(dict.fromkeys(layers)),
             lambda p, layer: p.supports_args is None or p.supports_args(layers, block_size, dtype, device) is None,
             lambda p, layer: _attention_check(p.fn, layer, dtype, device, block_size, gen), str, report)


def run_self_check(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, block_size: int,
                   mode: str = "on") -> SelfCheckReport | None:
    """Check every provider the model will call against native; drop the ones that fail (or raise, if strict)."""
    if mode not in MODES:
        raise ValueError(f"self_check={mode!r}: choose one of {', '.join(MODES)}")
    if mode == "off" or not active_chains():
        return None
    start = time.perf_counter()
    seed = int(torch.randint(0, 2**31 - 1, (1,)))  # fresh inputs each run; logged, so a failure can be replayed
    gen = torch.Generator().manual_seed(seed)
    report = SelfCheckReport(seed=seed)
    with torch.inference_mode():
        for op, calls in _record_calls(model, dtype, device, block_size, gen).items():
            check_calls(op, calls, report)
        _check_attention(model.attention_layers, dtype, device, block_size, gen, report)
    report.seconds = time.perf_counter() - start
    if report.failed:
        if mode == "strict":
            raise SelfCheckError(f"{report.summary()}\nRefusing to start (--self-check strict); --self-check on "
                                 f"would drop the providers above and serve with the ones behind them.")
        log.warning("%s", report.summary())
    else:
        log.info("%s", report.summary())
    return report
