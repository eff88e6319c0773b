"""Mixture-of-experts MLPs: routed experts (`SparseMoe`) and routed plus shared experts (`SharedExpertMoe`).

What differs between families is the router, which `MoeSpec` describes: softmax (Mixtral, Qwen-MoE, DeepSeek-V2)
or sigmoid scoring (DeepSeek-V3, GLM-4.5), grouped top-k, a per-expert correction bias that shifts the choice but
not the weights, a scaling factor on the routed sum; and the shared experts beside them (always on; Qwen2-MoE
scales its one shared expert by a sigmoid gate of its own).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resin import hal
from resin.hal.distributed import parallel, rank_range, split_range
from resin.models.layers import GatedMLP, Linear, default_loader, param, take


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # the top-k weights divided by their sum (norm_topk_prob)
    scoring: str = "softmax"  # or "sigmoid"
    num_expert_group: int | None = None  # grouped top-k: only experts of the best topk_group groups compete
    topk_group: int | None = None
    correction_bias: bool = False  # e_score_correction_bias: added to the scores for choosing only
    routed_scaling_factor: float = 1.0
    router_fp32: bool = False  # router weight and logits in fp32 whatever the model dtype (DeepSeek-V3 keeps it so)
    shared_intermediate_size: int = 0  # the shared experts' MLP (0: none)
    shared_gate: bool = False  # sigmoid(gate(x)) scales the shared expert (Qwen2-MoE, Qwen3-Next)


class SparseMoe(nn.Module):
    """Routed experts: the router (`gate`) picks top_k experts per token (MOE_ROUTE), the experts run fused
    (FUSED_MOE). Expert weights are stacked: w13 (E, 2I, H) = [gate | up] rows, w2 (E, H, I); each checkpoint tensor
    loads into its slice, shard ("gate" | "up", expert) or expert.

    Under tensor parallelism every rank holds every expert's slice of the intermediate size; with expert
    parallelism, whole experts [first, first + count) and routes the others' tokens nowhere (weight 0). Either way
    one all-reduce sums the ranks' parts."""

    def __init__(self, hidden: int, spec: MoeSpec, act: str = "silu", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.spec = spec
        if act not in ("silu", "swish", "gelu"):
            raise ValueError(f"MoE hidden_act {act!r} is not supported; supported: silu, gelu")
        self.act = "gelu" if act == "gelu" else "silu"
        g, inter, num_experts = parallel(), spec.intermediate_size, spec.num_experts
        if g.expert_parallel:
            self.experts, self.inter_part = split_range(num_experts, g.world, g.rank), (0, inter)
        else:
            self.experts, self.inter_part = (0, num_experts), rank_range(inter)
        first, count = self.experts
        inter_local = self.inter_part[1]
        self.gate = Linear(hidden, num_experts, dtype=torch.float32 if spec.router_fp32 else dtype)
        self.gate.router = True  # checkpoints keep routers unquantised
        if spec.correction_bias:  # the checkpoint keeps it beside the router weight
            self.gate.e_score_correction_bias = param(num_experts, dtype=torch.float32)
        self.w13 = param(count, 2 * inter_local, hidden, dtype=dtype)
        self.w13.weight_loader = self._load_w13
        self.w13.shards = [(which, e) for e in range(first, first + count) for which in ("gate", "up")]
        self.w2 = param(count, hidden, inter_local, dtype=dtype)
        self.w2.weight_loader = self._load_w2
        self.w2.shards = list(range(first, first + count))
        self.w13.reads_slices = self.w2.reads_slices = True
        self.block: tuple[int, int] | None = None  # block-scale fp8 experts (use_block_fp8)
        self.w13_scale = self.w2_scale = None

    def use_block_fp8(self, block: tuple[int, int]) -> None:
        """Keep the experts as the checkpoint stores them: fp8 weights, one scale per block[0] x block[1] tile
        (`weight_scale_inv`). This rank's part of the intermediate size must fall on whole blocks."""
        bn, bk = block
        start, inter = self.inter_part
        if start % bn or inter % bn or start % bk:
            raise ValueError(f"expert intermediate slice [{start}, {start + inter}) does not fall on {bn}x{bk} "
                             f"scale blocks: choose a tensor_parallel_size that splits it into whole blocks (or "
                             f"--enable-expert-parallel)")
        count, hidden = self.w13.shape[0], self.w13.shape[2]
        fp8 = dict(dtype=torch.float8_e4m3fn)
        for name, rows, cols, loader, shards in (("w13", 2 * inter, hidden, self._load_w13, self.w13.shards),
                                                 ("w2", hidden, inter, self._load_w2, self.w2.shards)):
            weight = param(count, rows, cols, **fp8)
            scale = param(count, -(-rows // bn), -(-cols // bk), dtype=torch.float32)
            weight.weight_loader, scale.weight_loader = loader, getattr(self, f"_load_{name}_scale")
            weight.shards, scale.shards = shards, shards
            weight.reads_slices = scale.reads_slices = True
            setattr(self, name, weight)
            setattr(self, f"{name}_scale", scale)
        self.block = block

    def _load_w13_scale(self, param: nn.Parameter, tensor: Any, shard: tuple[str, int]) -> None:
        which, expert = shard
        e, (bn, _), (start, inter) = self._local(expert), self.block, self.inter_part
        if e is not None:
            rows = inter // bn
            default_loader(param.data[e].narrow(0, 0 if which == "gate" else rows, rows),
                           take(tensor, 0, start // bn, rows).float())

    def _load_w2_scale(self, param: nn.Parameter, tensor: Any, expert: int) -> None:
        e, (_, bk), (start, inter) = self._local(expert), self.block, self.inter_part
        if e is not None:
            default_loader(param.data[e], take(tensor, 1, start // bk, -(-inter // bk)).float())

    def experts_to_fp8_flavour(self, fp8_dtype: torch.dtype | None) -> None:
        """e4m3fn -> e4m3fnuz on gfx942 (bits reinterpreted, block scales doubled)."""
        if self.block is None or fp8_dtype is None or fp8_dtype == self.w13.dtype:
            return
        for name in ("w13", "w2"):
            w, scale, _ = hal.e4m3fn_to_e4m3fnuz(getattr(self, name).data, getattr(self, f"{name}_scale").data)
            getattr(self, name).data = w
            getattr(self, f"{name}_scale").data.copy_(scale)

    def _local(self, expert: int) -> int | None:
        first, count = self.experts
        return expert - first if first <= expert < first + count else None

    def _load_w13(self, param: nn.Parameter, tensor: Any, shard: tuple[str, int]) -> None:
        which, expert = shard
        e, size = self._local(expert), self.inter_part[1]
        if e is not None:  # another rank's expert: never read
            default_loader(param.data[e].narrow(0, 0 if which == "gate" else size, size),
                           take(tensor, 0, *self.inter_part))

    def _load_w2(self, param: nn.Parameter, tensor: Any, expert: int) -> None:
        e = self._local(expert)
        if e is not None:
            default_loader(param.data[e], take(tensor, 1, *self.inter_part))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        logits = self.gate(x.float() if s.router_fp32 else x)
        return hal.MOE_ROUTE(logits, s.top_k, s.scoring, s.renormalize, s.num_expert_group, s.topk_group,
                             getattr(self.gate, "e_score_correction_bias", None), s.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        quant = {} if self.block is None else dict(w13_scale=self.w13_scale, w2_scale=self.w2_scale, block=self.block)
        if parallel().world == 1:
            return hal.FUSED_MOE(x, self.w13, self.w2, weights, ids, self.act, **quant)
        first, count = self.experts
        if count != self.spec.num_experts:
            # other ranks' experts: routed to local expert 0 with weight 0 (computed, then weighed out)
            mine = (ids >= first) & (ids < first + count)
            ids, weights = torch.where(mine, ids - first, 0), torch.where(mine, weights, 0)
        return hal.ALL_REDUCE(hal.FUSED_MOE(x, self.w13, self.w2, weights, ids, self.act, **quant))


class SharedExpertMoe(nn.Module):
    """Routed experts (`experts`) plus shared experts every token goes through, under the checkpoint's name for
    them (`shared_expert` in Qwen, `shared_experts` in DeepSeek / GLM), optionally scaled by sigmoid of their own
    gate (`shared_expert_gate`)."""

    def __init__(self, hidden: int, spec: MoeSpec, act: str, dtype: torch.dtype, shared_name: str = "shared_expert"):
        super().__init__()
        self.experts = SparseMoe(hidden, spec, act, dtype)
        self.shared_name = shared_name
        setattr(self, shared_name, GatedMLP(hidden, spec.shared_intermediate_size, act, dtype=dtype))
        self.shared_expert_gate = Linear(hidden, 1, dtype=dtype) if spec.shared_gate else None
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.router = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = getattr(self, self.shared_name)(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return self.experts(x) + shared


def make_moe(hidden: int, spec: MoeSpec, act: str, dtype: torch.dtype, shared_name: str = "shared_expert"
             ) -> nn.Module:
    if spec.shared_intermediate_size:
        return SharedExpertMoe(hidden, spec, act, dtype, shared_name)
    return SparseMoe(hidden, spec, act, dtype)


def expert_checkpoint_name(name: str, shared: bool, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                           ) -> tuple[str, Any] | None:
    """A checkpoint tensor of an MoE MLP under `<layer>.mlp` -> (Resin parameter, shard): per-expert tensors
    (names: the gate, up and down projections) into the stacked weights; with shared experts the routed ones
    live in `mlp.experts`, and the router (`mlp.gate.*`) moves there with them. None: not such a tensor."""
    gate, up, down = names
    m = re.fullmatch(rf"(.*\.mlp)\.experts\.(\d+)\.({gate}|{up}|{down})\.weight(_scale_inv)?", name)
    inner = ".experts" if shared else ""
    if m is None:
        return (name.replace(".mlp.gate.", ".mlp.experts.gate."), None) if shared and ".mlp.gate." in name else None
    prefix, expert, proj, scale = m.group(1), int(m.group(2)), m.group(3), "_scale" if m.group(4) else ""
    if proj == down:
        return f"{prefix}{inner}.w2{scale}", expert
    return f"{prefix}{inner}.w13{scale}", ("gate" if proj == gate else "up", expert)


def deepseek_moe(c: dict[str, Any], num_layers: int, noaux: bool) -> tuple[tuple[bool, ...], MoeSpec]:
    """DeepSeek-style MoE placement and router from a config (DeepSeek-V2/V3, GLM-4.5): experts on the layers from
    first_k_dense_replace on (every moe_layer_freq-th), n_shared_experts experts' worth of shared MLP.
    noaux (V3, GLM): sigmoid scores, a correction bias and grouped top-k always; else (V2) softmax scores, grouped
    only under topk_method group_limited_greedy."""
    experts = c.get("n_routed_experts") or c.get("num_local_experts") or 0
    first, freq = c.get("first_k_dense_replace") or 0, c.get("moe_layer_freq") or 1
    layers = tuple(experts > 0 and i >= first and i % freq == 0 for i in range(num_layers))
    grouped = noaux or c.get("topk_method") == "group_limited_greedy"
    spec = MoeSpec(experts, c["num_experts_per_tok"], c["moe_intermediate_size"], bool(c.get("norm_topk_prob")),
                   scoring=c.get("scoring_func") or ("sigmoid" if noaux else "softmax"),
                   num_expert_group=c.get("n_group") if grouped else None,
                   topk_group=c.get("topk_group") if grouped else None, correction_bias=noaux,
                   routed_scaling_factor=float(c.get("routed_scaling_factor") or 1.0), router_fp32=noaux,
                   shared_intermediate_size=c["moe_intermediate_size"] * (c.get("n_shared_experts") or 0))
    return layers, spec
