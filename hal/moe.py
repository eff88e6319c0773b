"""Mixture-of-experts ops: routing (which experts, with what weight) and the expert computation itself."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from resin.hal.fp8 import _block_fp8_linear
from resin.hal.ops import GELU_AND_MUL, SILU_AND_MUL
from resin.hal.registry import Op


def _moe_route(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True,
               num_expert_group: int | None = None, topk_group: int | None = None,
               correction_bias: torch.Tensor | None = None,
               routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> (weights float32 (T, top_k), expert ids int32 (T, top_k)), best expert first.

    scoring: 'softmax' (Mixtral, Qwen-MoE) or 'sigmoid' (DeepSeek-V3). correction_bias shifts which experts are
    chosen but not their weights. Grouped top-k keeps the best `topk_group` of `num_expert_group` groups (a
    group scores its best expert, or its best two summed when a correction bias is given, as DeepSeek-V3 does).
    """
    if scoring == "softmax":
        scores = torch.softmax(router_logits.float(), dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(router_logits.float())
    else:
        raise ValueError(f"moe scoring {scoring!r} is not supported; use 'softmax' or 'sigmoid'")
    choose = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group:
        t, e = choose.shape
        groups = choose.view(t, num_expert_group, e // num_expert_group)
        group_score = groups.amax(-1) if correction_bias is None else groups.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
            1, group_score.topk(topk_group, dim=-1).indices, True)
        choose = choose.masked_fill(~keep.repeat_interleave(e // num_expert_group, dim=1), float("-inf"))
    ids = choose.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def swigluoai_and_mul(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU over a [gate | up] row: gate clamped above at `limit`, up to [-limit, limit];
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


MOE_ACTIVATIONS = ("silu", "gelu", "swigluoai")


def _fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
               w2_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0,
               w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """sum_k w_k * (down_e(act(gate_e(x), up_e(x))) + b2_e) over each token's routed experts e = topk_ids[t, k].

    x (T, H); w13 (E, 2I, H) = [gate | up] rows, with optional bias (E, 2I); w2 (E, H, I), optional bias (E, H),
    which the routing weight scales with the rest of the expert's output. activation: silu or gelu (act(g) * u),
    or swigluoai (GPT-OSS: clamped, alpha, limit). Block-scale fp8 experts (DeepSeek-V3): w13 / w2 in fp8 with
    w13_scale (E, ceil(2I / bn), ceil(H / bk)) and w2_scale (E, ceil(H / bn), ceil(I / bk)), each GEMM as
    block_fp8_linear (its input quantised per token per bk columns). Accumulates in fp32. This loop over experts is
    the definition (and the "unfused torch loop" the fused kernels are benchmarked against).
    """
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"MoE activation {activation!r} is not supported; supported: {', '.join(MOE_ACTIVATIONS)}")
    def project(inp: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None):
        if scale is None:
            return F.linear(inp, w, bias)
        assert block is not None, "block-scale experts need the block shape"
        return _block_fp8_linear(inp, w, scale, block, bias)

    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.flatten().long()
    for e in torch.unique(flat_ids).tolist():
        pos = torch.nonzero(flat_ids == e).squeeze(1)
        tok = pos // topk_ids.shape[1]
        gate_up = project(x[tok], w13[e], None if w13_scale is None else w13_scale[e],
                          None if w13_bias is None else w13_bias[e])
        if activation == "swigluoai":
            h = swigluoai_and_mul(gate_up, alpha, limit)
        else:
            h = (SILU_AND_MUL.native if activation == "silu" else GELU_AND_MUL.native)(gate_up)
        y = project(h, w2[e], None if w2_scale is None else w2_scale[e], None if w2_bias is None else w2_bias[e])
        out.index_add_(0, tok, y.float() * topk_weights.flatten()[pos].float().unsqueeze(1))
    return out.to(x.dtype)


def _experts_in_use(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                    w2_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0,
                    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                    block: tuple[int, int] | None = None) -> tuple[tuple, dict]:
    """Self-check inputs from a real call: copies of only the experts it routes to, ids renumbered to match, so
    the check holds a few experts' weights (not the layer's) and a provider that rewrites its weights in place
    (aiter shuffles them) rewrites copies."""
    used, ids = torch.unique(topk_ids.long(), return_inverse=True)
    per_expert = {name: b[used].clone() for name, b in (("w13_bias", w13_bias), ("w2_bias", w2_bias),
                                                         ("w13_scale", w13_scale), ("w2_scale", w2_scale))
                  if b is not None}
    return (x.clone(), w13[used].clone(), w2[used].clone(), topk_weights.clone(), ids.to(topk_ids.dtype)), \
        {"activation": activation, "alpha": alpha, "limit": limit, **per_expert,
         **({"block": block} if block is not None else {})}


def _distinct_logits(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True,
                     num_expert_group: int | None = None, topk_group: int | None = None,
                     correction_bias: torch.Tensor | None = None,
                     routed_scaling_factor: float = 1.0) -> tuple[tuple, dict]:
    """Self-check inputs from a real call: each token's logits a random permutation of distinct values (steps of
    1/16, exact in bf16 up to 256 experts; fp32 beyond), so no tie lets a correct provider pick other experts
    than native does."""
    t, e = router_logits.shape
    dtype = router_logits.dtype if e <= 256 else torch.float32
    values = ((torch.arange(e, device=router_logits.device) - e // 2) / 16).to(dtype)
    logits = values[torch.argsort(torch.rand(t, e, device=router_logits.device), dim=1)]
    bias = correction_bias.clone() if correction_bias is not None else None
    return (logits, top_k, scoring, renormalize, num_expert_group, topk_group, bias, routed_scaling_factor), {}


MOE_ROUTE = Op("moe_route", _moe_route, check_inputs=_distinct_logits)
FUSED_MOE = Op("fused_moe", _fused_moe, native_graph_safe=False,  # loops over the experts present (host sync)
               check_inputs=_experts_in_use)
