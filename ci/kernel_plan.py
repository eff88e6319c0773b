"""Drive the shapes of kernel_shapes through the engine's step phases for one vendor, recording every launch.

`record(vendor, fp8_dtype)` returns the launches (to compile) and, per model shape, the launches of one decode step
split into per layer and outside the layers (what decode graphs remove, and what a fusion would lower).
"""
from __future__ import annotations

import gc
import importlib
from dataclasses import dataclass

import torch

from resin.ci.kernel_launches import (BLOCK_SIZE, LONG_DECODE, MAX_GRAPH_BATCH, MIXED, Launch, Recorder, StepCount,
                                      recording_providers)
from resin.ci.kernel_shapes import ATTENTION_SHAPES, MODEL_SHAPES, AttentionShape, ModelShape
from resin.core.graph_runner import DecodeGraphs
from resin.hal.attention import ATTENTION, ForwardContext
from resin.hal.mla import attention_op
from resin.hal.recurrent import RecurrentMetadata

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_GRAPH_CONTEXT_BLOCKS = 8  # block-table width of the captured buckets (the replay plan does not depend on it)


@dataclass
class DecodeLaunches:
    shape: str
    layers: int  # the real model's depth
    count: StepCount

    def per_step(self) -> tuple[int, int]:
        """(Triton launches, other device kernels) of one decode step at the real depth."""
        c = self.count
        return (c.triton_per_layer * self.layers + c.triton_outside,
                c.torch_per_layer * self.layers + c.torch_outside)


def _model(shape: ModelShape, dtype: torch.dtype, fp8_dtype: torch.dtype | None,
           block: tuple[int, int] | None = None) -> torch.nn.Module:
    from resin.models import MODEL_REGISTRY
    from resin.models.block_fp8 import BlockFp8Linear, DequantizedWeight
    from resin.models.fp8 import Fp8Config, Fp8Linear, quantize_linears
    from resin.tiny import tiny_hf_config

    config = tiny_hf_config(shape.arch, **{**shape.config, "num_hidden_layers": 2, "vocab_size": 256}).to_dict()
    cls = MODEL_REGISTRY[shape.arch]
    model = cls(cls.parse_config(config), dtype)
    if fp8_dtype is not None:
        quantize_linears(model, Fp8Config(static_input=False, block=block))
        for module in model.modules():  # weights as the loader leaves them: in the arch's fp8 flavour
            if isinstance(module, (Fp8Linear, BlockFp8Linear)):
                module.weight = torch.nn.Parameter(torch.empty(module.weight.shape, dtype=fp8_dtype),
                                                   requires_grad=False)
            elif isinstance(module, DequantizedWeight):
                module.finish()
    return model


class _LayerTag:
    """Tells the recorder which decoder layer runs (forward hooks), so launches are counted per layer."""

    def __init__(self, model: torch.nn.Module, rec: Recorder):
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            self.handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(rec, "layer", i)))
            self.handles.append(layer.register_forward_hook(lambda m, a, o: setattr(rec, "layer", None)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _kv_caches(attn, layers, num_blocks: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.zeros(attn.kv_cache_shape(num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size),
                        dtype=dtype) for layer in layers]


def _run_model(shape: ModelShape, dtype: torch.dtype, fp8_dtype: torch.dtype | None, rec: Recorder,
               count_decode: bool, block: tuple[int, int] | None = None) -> StepCount | None:
    model = _model(shape, dtype, fp8_dtype, block)
    layers = model.attention_layers
    attn = attention_op(layers)(layers, BLOCK_SIZE, dtype, torch.device("cpu"))
    num_blocks = max(MIXED.num_blocks, LONG_DECODE.num_blocks, MAX_GRAPH_BATCH) + 1
    # recurrent layers: a state slot per sequence of the largest graph bucket, and the padding rows' scratch slot
    states = [layer.allocate(MAX_GRAPH_BATCH + 1, dtype, torch.device("cpu"))
              for layer in getattr(model, "recurrent_layers", [])]
    ctx = ForwardContext([attn], _kv_caches(attn, layers, num_blocks, dtype), states=states)
    name = f"{shape.name} {_DTYPE_NAMES[dtype] if fp8_dtype is None else 'fp8 blocks' if block else 'fp8'}"
    count = None
    tags = _LayerTag(model, rec)
    try:
        for phase, batch in (("mixed", MIXED), ("decode", LONG_DECODE)):
            rec.origin = f"{name} {phase}"
            if phase == "decode" and count_decode:
                count = rec.counting = StepCount()
            attn.plan(batch.meta)
            if states:
                seqs = len(batch.q_lens)
                ctx.recurrent = RecurrentMetadata(batch.meta.query_start_loc, torch.arange(seqs, dtype=torch.int32),
                                                  torch.tensor(batch.ctx_lens) > 0, max(batch.q_lens) == 1)
            model(batch.input_ids, batch.positions, ctx)
            rec.counting = None
        rec.origin = f"{name} graph buckets"
        graphs = DecodeGraphs(model.forward, ctx, MAX_GRAPH_BATCH, _GRAPH_CONTEXT_BLOCKS,
                              scratch_block=num_blocks - 1, block_size=BLOCK_SIZE, device=torch.device("cpu"))
        graphs.capture()
    finally:
        tags.remove()
        gc.collect()  # the captured graphs hold the model through a reference cycle: free its weights now
    return count


def _run_attention(shape: AttentionShape, dtype: torch.dtype, rec: Recorder) -> None:
    layer = shape.layer
    attn = ATTENTION([layer], BLOCK_SIZE, dtype, torch.device("cpu"))
    cache = _kv_caches(attn, [layer], max(MIXED.num_blocks, LONG_DECODE.num_blocks), dtype)[0]
    sinks = torch.zeros(layer.num_heads, dtype=torch.float32) if shape.sinks else None
    for phase, batch in (("mixed", MIXED), ("decode", LONG_DECODE)):
        rec.origin = f"{shape.name} {_DTYPE_NAMES[dtype]} {phase}"
        attn.plan(batch.meta)
        t = batch.positions.shape[0]
        q = torch.zeros(t, layer.num_heads * layer.head_size, dtype=dtype)
        kv = torch.zeros(t, layer.num_kv_heads * layer.head_size, dtype=dtype)
        attn.forward(0, q, kv, kv, cache, sinks)


def record(vendor: str, fp8_dtype: torch.dtype,
           shapes: list[str] | None = None) -> tuple[list[Launch], list[DecodeLaunches]]:
    """Every launch of every shape under `vendor`'s Tuning (fp8 shapes in `fp8_dtype`), and decode-step counts.
    `shapes`: only the shapes whose name contains one of these strings."""
    def wanted(name: str) -> bool:
        return shapes is None or any(s.lower() in name.lower() for s in shapes)

    from resin.backends.triton import providers  # noqa: F401  (registers the "triton" providers)
    from resin.backends.triton.tuning import using

    tuning = importlib.import_module(f"resin.backends.{vendor}.tuning").TUNING
    rec = Recorder()
    counts: list[DecodeLaunches] = []
    with torch.no_grad(), using(tuning), recording_providers(rec), rec.intercept():
        for shape in filter(lambda s: wanted(s.name), MODEL_SHAPES):
            for dtype in shape.dtypes:
                count = _run_model(shape, dtype, None, rec, count_decode=dtype == _first_gpu_dtype(shape))
                if count is not None:
                    counts.append(DecodeLaunches(shape.name, shape.layers, count))
            if shape.fp8:
                _run_model(shape, torch.bfloat16, fp8_dtype, rec, count_decode=False)
            if shape.block_fp8:
                _run_model(shape, torch.bfloat16, fp8_dtype, rec, count_decode=False, block=(128, 128))
        for attention in filter(lambda s: wanted(s.name), ATTENTION_SHAPES):
            for dtype in attention.dtypes:
                _run_attention(attention, dtype, rec)
    return rec.launches, counts


def _first_gpu_dtype(shape: ModelShape) -> torch.dtype:
    return next(d for d in shape.dtypes if d != torch.float32)

