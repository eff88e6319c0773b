"""Linear and embedding layers over weights kept quantised: GGUF blocks as the file stores them, per-channel int8.

Model files do not change: `pack_gguf_layers` swaps a model's Linear / MergedLinear / Embedding modules for these
before loading, for each layer whose checkpoint tensors are in a packed GGUF type; `quantize_int8` swaps them
after loading a safetensors checkpoint (--quantization int8). A fused projection (q/k/v, gate/up) whose
shards come in different types (Q4_K_M files store v_proj in Q6_K, q/k in Q4_K) keeps one segment per run of a
type and runs one quant_linear per segment, concatenating the outputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resin import hal
from resin.hal.quant import INT8, quant_format
from resin.models.fp8 import checkpoint_names
from resin.hal.distributed import parallel, row_max
from resin.models.layers import Embedding, Linear, LMHead, MergedLinear, default_loader, reduce_rows, take


@dataclass(frozen=True)
class Segment:
    qtype: str
    rows: int
    row_bytes: int
    byte_offset: int  # into the flat weight (only used when a layer has several segments)


def column_part(linear: Linear) -> tuple[int, int] | None:
    """A row-parallel layer's input columns on this rank (None: it holds whole rows)."""
    return getattr(linear, "in_part", None)


def splits_on_blocks(linear: Linear, qtype: str) -> bool:
    """Whether this rank's input columns start and end on the type's block boundaries, so its slice of each packed
    row is whole blocks (a row-parallel layer whose split falls inside a block is dequantised on load instead)."""
    part = column_part(linear)
    block = quant_format(qtype).block
    return part is None or (part[0] % block == 0 and part[1] % block == 0)


class QuantLinear(nn.Module):
    """y = quant_linear(x, W) + b over packed rows. shard_types: each shard's (or None's, unfused) GGUF type.

    Under tensor parallelism it keeps the layer's split: a column-parallel layer (MergedLinear) holds its rows of
    each shard, the vocabulary-parallel lm_head its rows and gathers the logits, a row-parallel layer (RowLinear)
    the bytes of its input columns' blocks in every row and sums the ranks' products with one all-reduce."""

    def __init__(self, linear: Linear, shard_types: dict[Any, str]):
        super().__init__()
        out_features, self.in_features = linear.weight.shape
        self.parts: dict[Any, tuple[int, int]] | None = getattr(linear, "parts", None)  # column-parallel rows
        vocab = isinstance(linear, LMHead)  # its vocabulary rows; every rank's logits gathered
        self.vocab_part: tuple[int, int] | None = linear.part if vocab else None
        self.vocab_sizes: tuple[int, ...] | None = linear.sizes if vocab else None
        self.in_part = column_part(linear)
        offsets: dict[Any, tuple[int, int]] = getattr(linear, "offsets", None) or {None: (0, out_features)}
        self.segments: list[Segment] = []
        self.where: dict[Any, tuple[int, int]] = {}  # shard -> (segment, first row in it)
        offset = 0
        for shard, (start, size) in offsets.items():
            qtype = shard_types[shard]
            if not self.segments or self.segments[-1].qtype != qtype:
                row_bytes = quant_format(qtype).row_bytes(self.in_features)
                self.segments.append(Segment(qtype, 0, row_bytes, offset))
            seg = self.segments[-1]
            self.where[shard] = (len(self.segments) - 1, seg.rows)
            self.segments[-1] = Segment(seg.qtype, seg.rows + size, seg.row_bytes, seg.byte_offset)
            offset += size * seg.row_bytes
        single = len(self.segments) == 1
        shape = (out_features, self.segments[0].row_bytes) if single else (offset,)
        self.weight = nn.Parameter(torch.zeros(shape, dtype=torch.uint8), requires_grad=False)
        self.weight.weight_loader = self._load_rows
        self.weight.reads_slices = True  # _load_rows takes this rank's part of each tensor
        if linear.weight.__dict__.get("shards"):
            self.weight.shards = list(linear.weight.shards)
        self.qtype = self.segments[0].qtype if single else None
        self.bias = _fp32_bias(linear.bias)

    def _load_rows(self, param: nn.Parameter, tensor: torch.Tensor, shard: Any = None) -> None:
        index, row = self.where[shard]
        seg = self.segments[index]
        if self.parts is not None:
            tensor = take(tensor, 0, *self.parts[shard])
        elif self.vocab_part is not None:
            tensor = take(tensor, 0, *self.vocab_part)
        if self.in_part is not None:  # whole blocks (splits_on_blocks): their bytes in each row
            fmt = quant_format(seg.qtype)
            block_bytes = fmt.row_bytes(fmt.block)
            tensor = take(tensor, 1, self.in_part[0] // fmt.block * block_bytes, seg.row_bytes)
        rows = self._segment(param.data, index).narrow(0, row, tensor.shape[0])
        if tensor.dtype != torch.uint8 or tuple(tensor.shape) != (rows.shape[0], seg.row_bytes):
            raise ValueError(f"packed {seg.qtype} tensor of shape {tuple(tensor.shape)} {tensor.dtype} does not fit "
                             f"{tuple(rows.shape)} uint8 rows")
        default_loader(rows, tensor)

    def _segment(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        seg = self.segments[index]
        if flat.dim() == 2:
            return flat
        return flat.narrow(0, seg.byte_offset, seg.rows * seg.row_bytes).view(seg.rows, seg.row_bytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_part is not None:
            return reduce_rows(lambda bias: self._project(x, bias), self.bias)
        out = self._project(x, self.bias)
        if self.vocab_sizes is not None and parallel().world > 1:
            return hal.ALL_GATHER(out, self.vocab_sizes)
        return out

    def _project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.qtype is not None:
            return hal.QUANT_LINEAR(x, self.weight, self.qtype, None, bias)
        outs, first = [], 0
        for i, seg in enumerate(self.segments):  # each with its rows of the bias, so each output rounds once
            part = None if bias is None else bias.narrow(0, first, seg.rows)
            outs.append(hal.QUANT_LINEAR(x, self._segment(self.weight, i), seg.qtype, None, part))
            first += seg.rows
        return torch.cat(outs, dim=-1)


class Int8Linear(nn.Module):
    """Weight-only int8 with one fp32 scale per output row: w ~ q * scale, q = round(w / scale) in [-127, 127]."""

    def __init__(self, linear: Linear):
        super().__init__()
        w = linear.weight.detach().float()
        self.in_part = getattr(linear, "in_part", None)  # row-parallel: this rank's columns of each row
        amax = w.abs().amax(dim=1)
        if self.in_part is not None:
            amax = row_max(amax)  # the scale of the whole row, so every rank rounds as one rank would
        scale = (amax / 127.0).clamp_min(1e-12)
        self.weight = nn.Parameter(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8),
                                   requires_grad=False)
        self.scales = nn.Parameter(scale, requires_grad=False)
        self.bias = _fp32_bias(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_part is not None:
            return reduce_rows(lambda bias: hal.QUANT_LINEAR(x, self.weight, INT8, self.scales, bias), self.bias)
        return hal.QUANT_LINEAR(x, self.weight, INT8, self.scales, self.bias)


class QuantEmbedding(nn.Module):
    """A packed (vocab, hidden) table: rows dequantised on lookup; `project` is the tied lm_head over it. Split
    over the vocabulary as Embedding is: each rank holds rows part = (start, size)."""

    def __init__(self, embedding: Embedding, qtype: str):
        super().__init__()
        rows, hidden = embedding.weight.shape
        self.qtype, self.dtype = qtype, embedding.weight.dtype
        self.part, self.sizes = embedding.part, embedding.sizes
        self.weight = nn.Parameter(torch.zeros(rows, quant_format(qtype).row_bytes(hidden), dtype=torch.uint8),
                                   requires_grad=False)
        self.weight.weight_loader = lambda param, tensor, shard=None: default_loader(param, take(tensor, 0,
                                                                                                *self.part))
        self.weight.reads_slices = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if parallel().world == 1:
            return hal.QUANT_EMBEDDING(ids, self.weight, self.qtype, None, self.dtype)
        start, size = self.part
        mine = (ids >= start) & (ids < start + size)
        rows = hal.QUANT_EMBEDDING(torch.where(mine, ids - start, 0), self.weight, self.qtype, None, self.dtype)
        return hal.ALL_REDUCE(rows * mine.unsqueeze(-1).to(rows.dtype))

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hal.QUANT_LINEAR(hidden, self.weight, self.qtype)
        return logits if parallel().world == 1 else hal.ALL_GATHER(logits, self.sizes)


def _fp32_bias(bias: nn.Parameter | None) -> nn.Parameter | None:
    """Biases stay fp32 beside packed weights: the op adds them in fp32 before its one rounding."""
    if bias is None:
        return None
    p = nn.Parameter(bias.detach().float(), requires_grad=False)
    p.weight_loader = bias.weight_loader
    if bias.__dict__.get("shards"):
        p.shards = list(bias.shards)
    return p


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def pack_gguf_layers(model: nn.Module, packable: dict[str, str]) -> set[str]:
    """Swap each layer whose every checkpoint weight is packable (HF tensor name -> GGUF type) for its packed
    form; returns the checkpoint tensor names that are to be loaded packed (the rest are dequantised on read)."""
    packed: set[str] = set()
    for name, module in list(model.named_modules()):
        if isinstance(module, Embedding):
            source = next((f"{a}.weight" for a in checkpoint_names(model, name)[0] if f"{a}.weight" in packable), None)
            if source is not None:
                _swap(model, name, QuantEmbedding(module, packable[source]))
                packed.add(source)
            continue
        if not isinstance(module, (Linear, MergedLinear)):
            continue
        # checkpoint_names lists a fused layer's sources in packed_modules order: name each source's shard from there
        leaf = name.rpartition(".")[2]
        shards = [shard for fused, shard in getattr(model, "packed_modules", {}).values() if fused == leaf] or [None]
        sources: list[str | None] = []
        for aliases in checkpoint_names(model, name):
            sources.append(next((f"{a}.weight" for a in aliases if f"{a}.weight" in packable), None))
        if None in sources or len(sources) != len(shards) or set(shards) != set(getattr(module, "offsets", None)
                                                                                 or [None]):
            continue  # some shard is stored unpacked (or in a type without a kernel): the layer stays dense
        if not all(splits_on_blocks(module, packable[src]) for src in sources):
            continue  # this rank's columns cut through blocks: dequantised on load, then split
        _swap(model, name, QuantLinear(module, {s: packable[src] for s, src in zip(shards, sources)}))
        packed.update(sources)
    return packed


def quantize_int8(model: nn.Module) -> list[str]:
    """--quantization int8 on a loaded model: every Linear / MergedLinear but the lm_head to weight-only int8."""
    names = [name for name, m in model.named_modules() if isinstance(m, (Linear, MergedLinear)) and name != "lm_head"]
    for name in names:
        _swap(model, name, Int8Linear(model.get_submodule(name)))
    return names


def weight_bytes(model: nn.Module) -> int:
    """Bytes the weights hold in memory: parameters, and copies providers derived from them (oneDNN's reordered
    bf16 weights), which are resident too."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        for derived in p.__dict__.get("_resin_derived", {}).values():
            if isinstance(derived, torch.Tensor):
                total += derived.numel() * derived.element_size()
    return total


def describe_weights(model: nn.Module) -> str:
    """'136.1 MiB resident; packed: 210 layers (q4_1 x 210), 1 embedding (q8_0)' for the startup log."""
    kinds: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            for seg in m.segments:
                kinds[seg.qtype] = kinds.get(seg.qtype, 0) + 1
        elif isinstance(m, (Int8Linear, QuantEmbedding)):
            key = INT8 if isinstance(m, Int8Linear) else f"{m.qtype} embedding"
            kinds[key] = kinds.get(key, 0) + 1
    packed = ", ".join(f"{k} x {n}" for k, n in sorted(kinds.items())) or "none (dense weights)"
    return f"{weight_bytes(model) / (1 << 20):.1f} MiB resident; packed: {packed}"
