"""aiter MoE: routing by `topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, need_renorm)`
(plus `grouped_topk` / `biased_grouped_topk` for grouped routing), and `aiter.fused_moe.fused_moe(hidden, w1, w2,
topk_weight, topk_ids, activation=...)` with w1 (E, 2I, H) gate rows first, w2 (E, H, I). Its CK kernels want
weights pre-shuffled by `shuffle_weight(w, layout=(16, 16))`: done on the first call, in place (as vLLM does at
load time), so expert memory is not doubled. The weights are then only valid for aiter; this provider accepts
every later call for them (its checks depend on shapes and dtypes only), so no other provider sees them."""
from __future__ import annotations

import functools

import torch

from resin.backends.rocm.aiter import aiter_module

# aiter's own mark for expert weights already in its shuffled layout: its fused_moe reads it (from v0.1.16, with a
# warning that results may be wrong without it), and this adapter reads it to shuffle once.
_SHUFFLED = "is_shuffled"
_GROUP_COUNTS = (1, 2, 4, 8)  # the num_expert_group values aiter's grouped top-k kernels are instantiated for
_TOKENS_PER_CU = 212  # above cu_count x this many tokens, biased_grouped_topk asserts need_renorm


@functools.cache
def _cu_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def route_supports_args(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True,
                        num_expert_group: int | None = None, topk_group: int | None = None,
                        correction_bias: torch.Tensor | None = None, routed_scaling_factor: float = 1.0) -> str | None:
    if num_expert_group:
        if num_expert_group not in _GROUP_COUNTS:
            return f"{num_expert_group} expert groups: aiter's grouped top-k takes {_GROUP_COUNTS}"
        if correction_bias is not None and scoring != "sigmoid":
            return "aiter biased_grouped_topk scores with sigmoid only"
        if correction_bias is not None and not renormalize:
            limit = _cu_count(router_logits.device.index or 0) * _TOKENS_PER_CU
            if router_logits.shape[0] > limit:
                return f"{router_logits.shape[0]} tokens > {limit} without renormalisation: aiter asserts need_renorm"
        return None  # grouped_topk / biased_grouped_topk
    if scoring != "softmax" or correction_bias is not None or routed_scaling_factor != 1.0:
        return "aiter topk_softmax: plain softmax top-k only"
    return None


def moe_route(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True,
              num_expert_group: int | None = None, topk_group: int | None = None,
              correction_bias: torch.Tensor | None = None,
              routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    aiter = aiter_module()
    t = router_logits.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    if num_expert_group and correction_bias is not None:
        aiter.biased_grouped_topk(router_logits, correction_bias.to(router_logits.dtype), weights, ids,
                                  num_expert_group, topk_group, renormalize, routed_scaling_factor)
    elif num_expert_group:
        aiter.grouped_topk(router_logits, weights, ids, num_expert_group, topk_group, renormalize,
                           scoring == "softmax", routed_scaling_factor)
    else:
        token_expert = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
        aiter.topk_softmax(weights, ids, token_expert, router_logits, renormalize)
    return weights, ids


def fused_moe_supports_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                            w2_bias: torch.Tensor | None = None, *args, **kwargs) -> str | None:
    if kwargs.get("w13_scale") is not None:
        return "block-scale fp8 experts: this adapter does not pass aiter's per-128x128 quantised path"
    if activation not in ("silu", "gelu") or w13_bias is not None or w2_bias is not None:
        # aiter's GPT-OSS path (a gfx950 MXFP4 kernel with its own bias layout) is not adapted here
        return f"activation {activation!r} / expert biases: this adapter passes silu or gelu without biases"
    if getattr(w13, _SHUFFLED, False):
        return None  # already shuffled for aiter: nothing else can read these weights now
    if x.dtype not in (torch.float16, torch.bfloat16) or w13.dtype != x.dtype:
        return f"{x.dtype} activations / {w13.dtype} experts: aiter fused_moe runs fp16/bf16"
    if w13.shape[1] % 16 or w13.shape[2] % 32 or w2.shape[1] % 16 or w2.shape[2] % 32:
        return "expert shapes not multiples of (16, 32): shuffle_weight cannot lay them out"
    return None


def _shuffled(w: torch.Tensor) -> torch.Tensor:
    """Shuffle in place (the .data swap keeps the Parameter), once, and mark it the way aiter reads."""
    if not getattr(w, _SHUFFLED, False):
        w.data = aiter_module("aiter.ops.shuffle").shuffle_weight(w.data, layout=(16, 16))
        setattr(w, _SHUFFLED, True)
    return w


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", *unused: object, **unused_kw: object) -> torch.Tensor:
    aiter = aiter_module()
    act = aiter.ActivationType.Silu if activation == "silu" else aiter.ActivationType.Gelu
    return aiter_module("aiter.fused_moe").fused_moe(
        x, _shuffled(w13), _shuffled(w2), topk_weights.float(), topk_ids.to(torch.int32), activation=act)
