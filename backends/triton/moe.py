"""MoE on Triton: softmax/sigmoid top-k routing (grouped, with a correction bias), and fused experts as two
grouped GEMMs over tokens sorted by expert (gate/up, then SiLU/GELU-and-mul, then down scaled by the routing
weight), summed per token.

The sort is plain tensor ops with sizes bounded by (tokens, experts) only, so it needs no host sync and can be
captured in a graph: each expert's rows are padded to a multiple of BLOCK_M; blocks past the last expert are
marked -1 and their programs exit at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resin.backends.triton.activation import gelu_and_mul, silu_and_mul, swigluoai_and_mul
from resin.backends.triton.tuning import Tuning, current


@triton.jit
def _keep_best_groups(choose, e, ok, num_experts, HAS_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr,
                      TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
    """Grouped top-k: experts outside the TOPK_GROUP best of NUM_GROUPS equal groups drop out (-inf). A group
    scores its best expert, or its best two summed when a correction bias is given (DeepSeek-V3's rule)."""
    group_of = e // (num_experts // NUM_GROUPS)
    g = tl.arange(0, BLOCK_G)
    group_score = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for i in tl.static_range(NUM_GROUPS):
        vals = tl.where(ok & (group_of == i), choose, float("-inf"))
        best = tl.max(vals, 0)
        if HAS_BIAS:
            best = best + tl.max(tl.where(e == tl.argmax(vals, 0), float("-inf"), vals), 0)
        group_score = tl.where(g == i, best, group_score)
    keep = g < 0
    for _ in tl.static_range(TOPK_GROUP):
        pick = tl.argmax(group_score, 0)
        keep = keep | (g == pick)
        group_score = tl.where(g == pick, float("-inf"), group_score)
    kept = tl.sum(tl.where(keep[None, :] & (group_of[:, None] == g[None, :]), 1, 0), 1) > 0
    return tl.where(kept, choose, float("-inf"))


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, num_experts, logits_stride, scaling,
                  TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                  RENORM: tl.constexpr, BLOCK_E: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  BLOCK_G: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < num_experts
    x = tl.load(logits_ptr + tok * logits_stride + e, mask=ok, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        ex = tl.exp(x - tl.max(x, 0))
        scores = ex / tl.sum(ex, 0)
    choose = scores
    if HAS_BIAS:
        choose = scores + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    choose = tl.where(ok, choose, float("-inf"))
    if NUM_GROUPS > 1:
        choose = _keep_best_groups(choose, e, ok, num_experts, HAS_BIAS, NUM_GROUPS, TOPK_GROUP, BLOCK_G)
    # the k picks stay in registers (one store at the end): no lane reads another lane's global writes
    k = tl.arange(0, BLOCK_K)  # TOP_K padded to a power of two; the padding lanes stay 0 and are not stored
    ids = tl.zeros([BLOCK_K], tl.int32)
    ws = tl.zeros([BLOCK_K], tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(choose, 0)
        ids = tl.where(k == i, best.to(tl.int32), ids)
        ws = tl.where(k == i, tl.sum(tl.where(e == best, scores, 0.0), 0), ws)
        choose = tl.where(e == best, float("-inf"), choose)
    if RENORM:
        ws = ws / tl.sum(ws, 0)
    tl.store(ids_ptr + tok * TOP_K + k, ids, mask=k < TOP_K)
    tl.store(w_ptr + tok * TOP_K + k, ws * scaling, mask=k < TOP_K)


def moe_route(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True,
              num_expert_group: int | None = None, topk_group: int | None = None,
              correction_bias: torch.Tensor | None = None, routed_scaling_factor: float = 1.0,
              tuning: Tuning | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    tuning = tuning or current()
    t, e = router_logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    groups = num_expert_group or 1
    if t:
        _route_kernel[(t,)](router_logits, correction_bias if correction_bias is not None else router_logits,
                            weights, ids, e, router_logits.stride(0), routed_scaling_factor, TOP_K=top_k,
                            BLOCK_K=triton.next_power_of_2(top_k), SIGMOID=scoring == "sigmoid",
                            HAS_BIAS=correction_bias is not None, RENORM=renormalize,
                            BLOCK_E=triton.next_power_of_2(e), NUM_GROUPS=groups,
                            TOPK_GROUP=topk_group if groups > 1 else 1, BLOCK_G=triton.next_power_of_2(groups),
                            **tuning.launch(tuning.elementwise_warps))
    return weights, ids


def route_supports_args(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True,
                        num_expert_group: int | None = None, topk_group: int | None = None, *args,
                        **kwargs) -> str | None:
    if num_expert_group and (router_logits.shape[1] % num_expert_group or num_expert_group > 64
                             or not topk_group or topk_group > num_expert_group):
        return (f"grouped top-k over {num_expert_group} groups (top {topk_group}) of {router_logits.shape[1]} "
                f"experts: the kernel takes up to 64 equal groups")
    if scoring not in ("softmax", "sigmoid"):
        return f"scoring {scoring!r}"
    if top_k > router_logits.shape[1]:
        return f"top_k {top_k} > {router_logits.shape[1]} experts"
    if router_logits.shape[1] > 1024:
        return f"{router_logits.shape[1]} experts > 1024"
    return None


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_expert): rows of the flattened (token, k) pairs grouped by expert, each expert padded to
    a multiple of block_m with the sentinel T*k; block_expert[b] is the expert of block b, or -1 past the end."""
    flat = topk_ids.flatten().long()
    n = flat.shape[0]
    # scatter_add, not bincount: bincount reads the id range back to the host, which graph capture forbids
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    capacity = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((capacity,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[expert_of] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_start < ends[-1], block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr, bias_ptr, a_scale_ptr,
                         w_scale_ptr, n, k, num_rows, a_stride, w_stride_e, w_stride_n, c_stride, a_scale_stride,
                         w_scale_stride_e, w_scale_stride_n, A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK_SCALED: tl.constexpr, SCALE_N: tl.constexpr,
                         SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < num_rows
        a_rows = rows // A_ROW_DIV  # the token a (token, k) pair reads from, for the first GEMM
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < k
            a = tl.load(a_ptr + a_rows[:, None] * a_stride + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(w_ptr + expert * w_stride_e + cols[None, :] * w_stride_n + kk[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if BLOCK_SCALED:  # fp8 tiles inside one scale block: per (row, k-block) and (n-block, k-block) scales
                kb = k0 // SCALE_K
                a_s = tl.load(a_scale_ptr + a_rows * a_scale_stride + kb, mask=row_ok, other=0.0)
                w_s = tl.load(w_scale_ptr + expert * w_scale_stride_e + (cols // SCALE_N) * w_scale_stride_n + kb,
                              mask=col_ok, other=0.0)
                acc += tl.dot(a, b) * a_s[:, None] * w_s[None, :]
            elif IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        if HAS_BIAS:  # the expert's own bias, before the routing weight scales its output
            acc += tl.load(bias_ptr + expert * n + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if MUL_WEIGHT:
            acc = acc * tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0)[:, None]
        tl.store(c_ptr + rows[:, None] * c_stride + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, topk_w: torch.Tensor | None, bias: torch.Tensor | None, a_row_div: int,
                  tuning: Tuning, tile_dtype: torch.dtype, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                  block: tuple[int, int] = (1, 1)) -> None:
    """scales: block-scale fp8 (a's per (row, block[1] columns), w's per expert and block) for fp8 a and w."""
    bm, bn, bk = tuning.gemm_tile(tile_dtype)
    if scales is not None:
        bk = min(bk, block[1])  # a K tile inside one scale block (block[1]: a power of two, supports_args)
    a_scale, w_scale = scales if scales is not None else (c, c)
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.shape[0], triton.cdiv(n, bn))
    _grouped_gemm_kernel[grid](
        a, w, c, sorted_ids, block_expert, topk_w if topk_w is not None else c, bias if bias is not None else c,
        a_scale, w_scale, n, k, c.shape[0], a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        a_scale.stride(0), w_scale.stride(0), w_scale.stride(1) if scales is not None else 0, A_ROW_DIV=a_row_div,
        MUL_WEIGHT=topk_w is not None, HAS_BIAS=bias is not None, BLOCK_SCALED=scales is not None,
        SCALE_N=block[0], SCALE_K=block[1], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=a.dtype == torch.float32,
        **tuning.launch(tuning.gemm_warps, tuning.gemm_stages))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None, tuning: Tuning | None = None) -> torch.Tensor:
    """Block-scale fp8 experts (w13_scale / w2_scale, block): each GEMM's input is quantised per token per
    block[1] columns first (the down GEMM's per (token, expert) row of the activation), as native does."""
    tuning = tuning or current()
    t, top_k = topk_ids.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    sorted_ids, block_expert = sort_by_expert(topk_ids, w13.shape[0], tuning.gemm_tile(x.dtype)[0])
    gate_up = torch.empty(t * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    a, scales = _gemm_input(x, w13, w13_scale, block, tuning)
    _grouped_gemm(a, w13, gate_up, sorted_ids, block_expert, None, _contiguous(w13_bias), top_k, tuning, x.dtype,
                  scales, block or (1, 1))
    if activation == "swigluoai":
        h = swigluoai_and_mul(gate_up, alpha, limit, tuning)
    else:
        h = silu_and_mul(gate_up, tuning) if activation == "silu" else gelu_and_mul(gate_up, "none", tuning)
    down = torch.empty(t * top_k, w2.shape[1], dtype=torch.float32, device=x.device)
    a, scales = _gemm_input(h, w2, w2_scale, block, tuning)
    _grouped_gemm(a, w2, down, sorted_ids, block_expert, topk_weights.flatten().float().contiguous(),
                  _contiguous(w2_bias), 1, tuning, x.dtype, scales, block or (1, 1))
    return down.view(t, top_k, -1).sum(1).to(x.dtype)


def _gemm_input(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, block: tuple[int, int] | None,
                tuning: Tuning) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """A as a grouped GEMM reads it, and the block scales (None for float experts): for block-scale fp8 experts,
    A quantised to their flavour per row per block[1] columns, with its scales and the experts'."""
    if w_scale is None:
        return a, None
    from resin.backends.triton.block_fp8 import quantize_fp8_groups

    aq, a_scale = quantize_fp8_groups(a, w.dtype, block[1], tuning)
    return aq, (a_scale, w_scale.float().contiguous())


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.is_contiguous() else t.contiguous()


def fused_moe_supports_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, activation: str = "silu", *args, **kwargs) -> str | None:
    block = kwargs.get("block")
    if kwargs.get("w13_scale") is not None:
        if block[1] < 16 or block[1] & (block[1] - 1):
            return f"scale block width {block[1]}: the kernel takes a power of two >= 16"
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or activation == "swigluoai":
            return f"{x.dtype} activations / {activation}: block-scale experts run silu or gelu"
        return None
    if w13.dtype != x.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"activations {x.dtype} / experts {w13.dtype}: the triton kernel wants one float dtype"
    if activation not in ("silu", "gelu", "swigluoai"):
        return f"activation {activation!r}"
    return None
