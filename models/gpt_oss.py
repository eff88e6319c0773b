"""GptOssForCausalLM: a Llama-shaped decoder with attention sinks (a learned per-head logit in each softmax),
sliding-window layers (128 tokens) alternating with full ones, biased q/k/v/o, YaRN rope, and an MoE MLP on every
layer: a biased router (softmax over the top k logits) and experts with biases and the clamped SwiGLU.

Checkpoints store the experts fused, gate and up interleaved column by column: (E, H, 2I) with gate at even
columns. Resin keeps [gate | up] rows, (E, 2I, H), the layout FUSED_MOE reads, and reorders on load. MXFP4 experts
(the released checkpoints) are dequantised on load to the model dtype: 4-bit weights are not kept in memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resin import hal
from resin.hal.distributed import parallel, rank_range, split_range
from resin.models.layers import Linear, default_loader, param
from resin.models.llama import DecoderConfig, DecoderLayer, LlamaForCausalLM
from resin.models.moe import MoeSpec
from resin.models.mxfp4 import dequantize_mxfp4


@dataclass
class GptOssConfig(DecoderConfig):
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4: bool = False


def _gate_up_rows(t: torch.Tensor) -> torch.Tensor:
    """(E, 2I, ...) with gate and up interleaved along dim 1 -> [gate | up] along dim 1."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


class GptOssExperts(nn.Module):
    """The experts' weights under the checkpoint's names, stored in FUSED_MOE's layout. With `mxfp4`, the two
    weights arrive as `_blocks` + `_scales` pairs (shards of one parameter) and are dequantised once both have.

    Under tensor parallelism a rank holds experts [first, first + count) (all of them unless expert-parallel) and
    of each, intermediate rows inter_part: gate and up rows i of the checkpoint are its interleaved rows 2i, 2i+1."""

    def __init__(self, hidden: int, inter: int, num_experts: int, mxfp4: bool, dtype: torch.dtype):
        super().__init__()
        g = parallel()
        if g.expert_parallel:
            self.experts, self.inter_part = split_range(num_experts, g.world, g.rank), (0, inter)
        else:
            self.experts, self.inter_part = (0, num_experts), rank_range(inter)
        self.num_experts = num_experts
        count, inter = self.experts[1], self.inter_part[1]
        self.gate_up_proj = param(count, 2 * inter, hidden, dtype=dtype)
        self.gate_up_proj_bias = param(count, 2 * inter, dtype=dtype)
        self.down_proj = param(count, hidden, inter, dtype=dtype)
        self.down_proj_bias = param(count, hidden, dtype=dtype)
        self.gate_up_proj_bias.weight_loader = lambda p, t, shard=None: default_loader(
            p, _gate_up_rows(self._mine(t, 1, interleaved=True)))
        self.down_proj_bias.weight_loader = lambda p, t, shard=None: default_loader(p, t.narrow(0, *self.experts))
        self._pending: dict[tuple[int, str], torch.Tensor] = {}  # an MXFP4 half waiting for its other half
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(self, name)
            p.weight_loader = self._load_mxfp4 if mxfp4 else self._load_dense
            if mxfp4:
                p.shards = ["blocks", "scales"]
            else:
                p.reads_slices = True  # only this rank's experts are read

    def _mine(self, t: Any, dim: int, interleaved: bool = False) -> torch.Tensor:
        """This rank's experts (dim 0) and intermediate rows (along dim) of a checkpoint tensor of every expert."""
        start, size = self.inter_part
        t = t.narrow(0, *self.experts)
        return t.narrow(dim, 2 * start, 2 * size) if interleaved else t.narrow(dim, start, size)

    def _load_dense(self, p: nn.Parameter, t: Any, shard: Any = None) -> None:
        # checkpoint (E, in, out) -> (E, out, in); gate_up's out is interleaved
        if p is self.gate_up_proj:
            default_loader(p, _gate_up_rows(self._mine(t, 2, interleaved=True).transpose(1, 2)))
        else:
            default_loader(p, self._mine(t, 1).transpose(1, 2))

    def _load_mxfp4(self, p: nn.Parameter, t: torch.Tensor, shard: str | None) -> None:
        if shard not in ("blocks", "scales"):
            raise ValueError(f"the config says MXFP4 (quant_method mxfp4) but expert weight {tuple(t.shape)} came "
                             f"without its _blocks/_scales pair: the checkpoint and its config.json disagree")
        other = "scales" if shard == "blocks" else "blocks"
        if (id(p), other) not in self._pending:
            self._pending[(id(p), shard)] = t
            return
        halves = {shard: t, other: self._pending.pop((id(p), other))}
        first, count = self.experts
        if halves["blocks"].shape[0] != self.num_experts:
            raise ValueError(f"MXFP4 expert weight for {self.num_experts} experts has {halves['blocks'].shape[0]}")
        start, size = self.inter_part
        for e in range(count):  # one expert at a time: the transient fp32 copy stays one expert's size
            # (out, in), rows as stored: gate_up's rows interleaved, down's columns the intermediate size
            w = dequantize_mxfp4(halves["blocks"][first + e], halves["scales"][first + e], p.dtype)
            if p is self.gate_up_proj:
                default_loader(p.data[e], _gate_up_rows(w.narrow(0, 2 * start, 2 * size).unsqueeze(0))[0])
            else:
                default_loader(p.data[e], w.narrow(1, start, size))


class GptOssMoe(nn.Module):
    def __init__(self, cfg: GptOssConfig, dtype: torch.dtype):
        super().__init__()
        self.top_k, self.alpha, self.limit = cfg.moe.top_k, cfg.swiglu_alpha, cfg.swiglu_limit
        self.router = Linear(cfg.hidden_size, cfg.moe.num_experts, bias=True, dtype=dtype)
        self.experts = GptOssExperts(cfg.hidden_size, cfg.moe.intermediate_size, cfg.moe.num_experts, cfg.mxfp4, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # softmax over the top k logits = softmax over all, renormalised over the top k
        weights, ids = hal.MOE_ROUTE(self.router(x), self.top_k, "softmax", True)
        e, g = self.experts, parallel()
        if g.world == 1:
            return hal.FUSED_MOE(x, e.gate_up_proj, e.down_proj, weights, ids, "swigluoai", e.gate_up_proj_bias,
                                 e.down_proj_bias, self.alpha, self.limit)
        first, count = e.experts
        if count != e.num_experts:  # expert-parallel: the other ranks' experts weigh 0 here
            mine = (ids >= first) & (ids < first + count)
            ids, weights = torch.where(mine, ids - first, 0), torch.where(mine, weights, 0)
        # the down bias once per expert: expert-parallel ranks add their own experts', tensor-parallel only rank 0
        down_bias = e.down_proj_bias if g.expert_parallel or g.rank == 0 else None
        return hal.ALL_REDUCE(hal.FUSED_MOE(x, e.gate_up_proj, e.down_proj, weights, ids, "swigluoai",
                                            e.gate_up_proj_bias, down_bias, self.alpha, self.limit))


class GptOssDecoderLayer(DecoderLayer):
    @staticmethod
    def make_mlp(cfg: DecoderConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return GptOssMoe(cfg, dtype)


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer = GptOssDecoderLayer
    gguf_permutes_qk = False
    reads_mxfp4 = True  # the loader leaves quant_method mxfp4 to this family's experts

    @classmethod
    def parse_config(cls, c: dict[str, Any]) -> "GptOssConfig":
        bias = c.get("attention_bias", True)
        return GptOssConfig.from_hf(
            c, qkv_bias=bias, o_bias=bias, attention_sinks=True,
            moe=MoeSpec(c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"], True),
            swiglu_alpha=float(c.get("swiglu_alpha", 1.702)), swiglu_limit=float(c.get("swiglu_limit", 7.0)),
            mxfp4=(c.get("quantization_config") or {}).get("quant_method") == "mxfp4")

    def checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """MXFP4 experts: `<weight>_blocks` / `<weight>_scales` are the two shards of `<weight>`."""
        for suffix in ("_blocks", "_scales"):
            if name.endswith(suffix):
                return name[:-len(suffix)], suffix[1:]
        return None
