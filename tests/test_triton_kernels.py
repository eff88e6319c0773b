"""Every shared Triton kernel against the HAL op's native implementation, on fresh random inputs with ragged and
non-power-of-two shapes. On a machine without a GPU conftest sets TRITON_INTERPRET=1, so the kernels run in
Triton's CPU interpreter (small shapes); tests/gpu/ repeats the checks at real sizes on a GPU.

Two limits of Triton 3.9's interpreter shape these tests: its tl.dot is wrong for bfloat16 operands, so kernels
with dots are checked here in fp32 and fp16 (bf16 on a GPU); and it truncates fp32 -> bf16 instead of rounding to
nearest, so bf16 results are compared to bf16 rounding, never bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from resin import hal
from resin.backends.triton import activation, fp8, kv_cache, moe, norm, rotary
from resin.backends.triton.attention import TritonAttention

from attention_batches import paged_batch
from conftest import KERNEL_DEVICE
from triton_cases import (ALL_DTYPES, DOT_DTYPES, FP8_UNDER_TEST, REPLAY_SCRATCH_BLOCK, TUNINGS,  # noqa: F401
                          close, on_kernel_device, replayed_batches)

pytestmark = pytest.mark.kernels


@TUNINGS
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (5, 40), (3, 7, 96)])
def test_rms_norms(dtype, shape, tuning):
    x, res = torch.randn(*shape).to(dtype), torch.randn(*shape).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    close(norm.rms_norm(x, w, 1e-6, tuning), hal.RMS_NORM.native(x, w, 1e-6))
    got, got_res = norm.fused_add_rms_norm(x, res, w, 1e-5, tuning)
    ref, ref_res = hal.FUSED_ADD_RMS_NORM.native(x, res, w, 1e-5)
    close(got, ref)
    if dtype == torch.bfloat16:
        close(got_res, ref_res)  # the interpreter truncates fp32 -> bf16 instead of rounding to nearest
    else:
        assert torch.equal(got_res, ref_res)  # the residual sum is rounded exactly as native rounds it


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (7, 2 * 37), (2, 3, 2 * 1100)])
def test_activations(dtype, shape):
    x = torch.randn(*shape).to(dtype)
    close(activation.silu_and_mul(x), hal.SILU_AND_MUL.native(x))
    for approximate in ("none", "tanh"):
        close(activation.gelu_and_mul(x, approximate), hal.GELU_AND_MUL.native(x, approximate))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("heads,kv_heads,head_size,rot_dim", [(3, 1, 40, 40), (4, 2, 64, 32), (5, 5, 24, 16)])
@pytest.mark.parametrize("fused", [False, True])
def test_rotary(dtype, is_neox, heads, kv_heads, head_size, rot_dim, fused):
    cache = hal.rope_cos_sin_cache(rot_dim, 97, 10000.0, None)
    pos = torch.randint(0, 97, (11,))
    if fused:  # q and k as models pass them: views into one fused q|k|v row per token (row stride > width)
        qkv = torch.randn(11, (heads + 2 * kv_heads) * head_size).to(dtype)
        q, k, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
        before = qkv.clone()
    else:
        q, k = torch.randn(11, heads * head_size).to(dtype), torch.randn(11, kv_heads * head_size).to(dtype)
    got = rotary.rotary(pos, q, k, cache, head_size, is_neox)
    ref = hal.ROTARY.native(pos, q, k, cache, head_size, is_neox)
    close(got[0], ref[0])
    close(got[1], ref[1])
    if fused:
        assert torch.equal(qkv, before)  # out of place: the fused row is left as it was


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_kv_write_by_slot_skips_padding(dtype):
    nb, bs, hk, d = 7, 16, 3, 40
    slots = torch.randperm(nb * bs)[:13]
    k, v = torch.randn(13, hk * d).to(dtype), torch.randn(13, hk * d).to(dtype)
    cache = torch.randn(2, nb, bs, hk, d).to(dtype)
    ref = cache.clone()
    hal.write_kv(ref, k, v, slots)
    got = cache.clone()
    kv_cache.write_kv(got, k, v, slots)
    assert torch.equal(got, ref)
    padded = torch.cat((slots[:5], torch.full((2,), -1)))  # -1: a padding row of a replayed graph
    got = cache.clone()
    kv_cache.write_kv(got, k[:7], v[:7], padded)
    ref = cache.clone()
    hal.write_kv(ref, k[:5], v[:5], slots[:5])
    assert torch.equal(got, ref)


ATTENTION_SHAPES = {
    "mixed": [(9, 1), (6, 6), (45, 17), (1, 1), (40, 1)],  # decodes and prefill chunks, with cached context
    "decode": [(5, 1), (70, 1), (33, 1)],  # decode only: split-K over the key range
    "prefill": [(37, 37), (29, 5)],
}


def _attention_case(shapes, layer, block_size, dtype, sinks=False):
    num_blocks = sum(-(-ctx // block_size) for ctx, _ in shapes) + 3
    meta, t = paged_batch(shapes, block_size, num_blocks)
    h, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_size
    cache = torch.randn(2, num_blocks, block_size, hk, d).to(dtype)
    q, k, v = (torch.randn(t, n * d).to(dtype) for n in (h, hk, hk))
    sink = torch.randn(h) if sinks else None
    native = hal.NativeAttention([layer], block_size, dtype, KERNEL_DEVICE)
    native.plan(meta)
    ref_cache = cache.clone()
    ref = native.forward(0, q, k, v, ref_cache, sink)
    return meta, cache, (q, k, v, sink), ref, ref_cache


@TUNINGS
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("batch", list(ATTENTION_SHAPES))
@pytest.mark.parametrize("heads,kv_heads,head_size,block_size", [(6, 2, 24, 16), (4, 4, 64, 32), (9, 3, 40, 16),
                                                                  (8, 1, 16, 16)])
def test_paged_attention(tuning, dtype, batch, heads, kv_heads, head_size, block_size):
    layer = hal.AttentionLayer(heads, kv_heads, head_size, scale=head_size ** -0.5)
    meta, cache, (q, k, v, _), ref, ref_cache = _attention_case(ATTENTION_SHAPES[batch], layer, block_size, dtype)
    attn = TritonAttention([layer], block_size, dtype, KERNEL_DEVICE, tuning)
    attn.plan(meta)
    if batch == "decode":
        assert attn.num_splits > 1  # the split-K path and its merge kernel are what this case checks
    got = attn.forward(0, q, k, v, cache)
    assert torch.equal(cache, ref_cache)
    close(got, ref)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("batch", ["mixed", "decode"])
@pytest.mark.parametrize("window,soft_cap,sinks", [(7, None, False), (None, 4.0, False), (None, None, True),
                                                   (20, 30.0, True)])
def test_paged_attention_window_softcap_sinks(dtype, batch, window, soft_cap, sinks):
    layer = hal.AttentionLayer(6, 2, 32, 32 ** -0.5, sliding_window=window, logits_soft_cap=soft_cap,
                               has_sinks=sinks)
    meta, cache, (q, k, v, sink), ref, ref_cache = _attention_case(ATTENTION_SHAPES[batch], layer, 16, dtype, sinks)
    attn = TritonAttention([layer], 16, dtype, KERNEL_DEVICE)
    attn.plan(meta)
    close(attn.forward(0, q, k, v, cache, sink), ref)


def test_paged_attention_replay_reads_new_lengths_without_replanning():
    """After capture_state + plan_for_replay for a bucket, the launch depends on nothing but the bucket size: run
    on a batch refilled into the same metadata tensors without planning again, the results must be that batch's."""
    layer = hal.AttentionLayer(4, 2, 32, 32 ** -0.5)
    attn = TritonAttention([layer], 16, torch.float32, KERNEL_DEVICE)
    for meta, t in replayed_batches(attn):
        cache = torch.randn(2, REPLAY_SCRATCH_BLOCK + 1, 16, 2, 32)
        q, k, v = torch.randn(4, 4 * 32), torch.randn(4, 2 * 32), torch.randn(4, 2 * 32)
        native = hal.NativeAttention([layer], 16, torch.float32, KERNEL_DEVICE)
        native.plan(meta)
        ref_cache = cache.clone()
        ref = native.forward(0, q[:t], k[:t], v[:t], ref_cache)
        close(attn.forward(0, q, k, v, cache)[:t], ref)
        scratch = REPLAY_SCRATCH_BLOCK
        assert torch.equal(cache[:, :scratch], ref_cache[:, :scratch])  # padding only touched the scratch block


def test_attention_refuses_what_it_cannot_run():
    layer = hal.AttentionLayer(4, 2, 32, 1.0)
    assert "block size" in TritonAttention.unsupported_reason([layer], 8, torch.float16, KERNEL_DEVICE)
    big = hal.AttentionLayer(4, 2, 512, 1.0)
    assert "head size" in TritonAttention.unsupported_reason([big], 16, torch.float16, KERNEL_DEVICE)
    assert TritonAttention.unsupported_reason([layer], 16, torch.bfloat16, KERNEL_DEVICE) is None


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (12, 4), (60, 1), (64, 8), (40, 10), (9, 3)])
@pytest.mark.parametrize("bias,renormalize", [(False, True), (True, True), (False, False)])
def test_moe_route(scoring, num_experts, top_k, bias, renormalize):
    logits = torch.randn(13, num_experts)
    correction = torch.randn(num_experts) * 0.1 if bias else None
    assert moe.route_supports_args(logits, top_k, scoring) is None
    got_w, got_ids = moe.moe_route(logits, top_k, scoring, renormalize, correction_bias=correction,
                                   routed_scaling_factor=2.5)
    ref_w, ref_ids = hal.MOE_ROUTE.native(logits, top_k, scoring, renormalize, correction_bias=correction,
                                          routed_scaling_factor=2.5)
    assert torch.equal(got_ids, ref_ids)
    close(got_w, ref_w)


@pytest.mark.parametrize("scoring,bias", [("sigmoid", True), ("softmax", False), ("sigmoid", False)])
@pytest.mark.parametrize("num_experts,top_k,groups,topk_group", [(256, 8, 8, 4), (160, 4, 8, 3), (12, 2, 3, 1),
                                                                 (64, 6, 1, 1)])
def test_moe_route_grouped(scoring, bias, num_experts, top_k, groups, topk_group):
    """DeepSeek-V3's routing (256 experts, 8 groups, best 4, sigmoid with a correction bias), V2's (160 experts
    in 8 groups of 20, softmax), groups that are not a power of two, and one group (no grouping at all)."""
    logits = torch.randn(11, num_experts)
    correction = torch.rand(num_experts) * 0.2 if bias else None
    args = (top_k, scoring, True, groups, topk_group, correction, 2.5)
    assert moe.route_supports_args(logits, *args) is None
    got_w, got_ids = moe.moe_route(logits, *args)
    ref_w, ref_ids = hal.MOE_ROUTE.native(logits, *args)
    assert torch.equal(got_ids, ref_ids)
    close(got_w, ref_w)
    assert "equal groups" in moe.route_supports_args(torch.randn(2, 10), 2, scoring, True, 4, 2)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(1, 4, 2, 16), (37, 6, 2, 16), (20, 64, 8, 64)])
def test_sort_by_expert(num_tokens, num_experts, top_k, block_m):
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)]).to(torch.int32)
    sorted_ids, block_expert = moe.sort_by_expert(ids, num_experts, block_m)
    n = num_tokens * top_k
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))  # every (token, k) pair exactly once
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < n].long()
        if e < 0:
            assert rows.numel() == 0
        else:
            assert (ids.flatten()[rows] == e).all() and rows.tolist() == sorted(rows.tolist())


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k", [(1, 32, 48, 4, 2), (13, 48, 40, 6, 2),
                                                                       (29, 64, 24, 8, 1)])
@pytest.mark.parametrize("act", ["silu", "gelu", "swigluoai"])
def test_fused_moe(dtype, num_tokens, hidden, inter, num_experts, top_k, act):
    _check_fused_moe(dtype, num_tokens, hidden, inter, num_experts, top_k, act)


@pytest.mark.parametrize("num_tokens", [3, 40])
def test_fused_moe_at_deepseek_expert_count(num_tokens):
    """256 experts, 8 active per token (DeepSeek-V3, Kimi-K2), at a small hidden size: most experts get no token
    and their blocks must exit without writing; a few get several."""
    _check_fused_moe(torch.float32, num_tokens, 32, 16, 256, 8, "silu")


@pytest.mark.parametrize("fp8_dtype", FP8_UNDER_TEST, ids=str)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (23, 8, 3)])
def test_fused_moe_block_fp8_experts(fp8_dtype, num_tokens, num_experts, top_k):
    """DeepSeek-V3's experts: fp8 weights with a scale per 16 x 32 tile (ragged at the intermediate edge), each
    GEMM's input quantised per token per 32 columns, against native's per-expert block_fp8_linear loop.

    The second GEMM quantises an intermediate that the kernel and native compute in different fp32 orders: an
    element within that rounding error of an fp8 rounding midpoint has two correct fp8 values, a whole step apart.
    Only those elements' one-step flips are allowed on top of the fp32 tolerance (_fp8_flip_allowance)."""
    hidden, inter, block = 64, 48, (16, 32)
    x = torch.randn(num_tokens, hidden)
    w13, s13 = _block_quantised(torch.randn(num_experts, 2 * inter, hidden) * hidden ** -0.5, block, fp8_dtype)
    w2, s2 = _block_quantised(torch.randn(num_experts, hidden, inter) * inter ** -0.5, block, fp8_dtype)
    weights, ids = hal.MOE_ROUTE.native(torch.randn(num_tokens, num_experts), top_k)
    quant = dict(w13_scale=s13, w2_scale=s2, block=block)
    assert moe.fused_moe_supports_args(x, w13, w2, weights, ids, "silu", **quant) is None
    got = moe.fused_moe(x, w13, w2, weights, ids, "silu", **quant)
    ref = hal.FUSED_MOE.native(x, w13, w2, weights, ids, "silu", **quant)
    excess = (got - ref).abs() - (1e-4 + 1e-4 * ref.abs()) - _fp8_flip_allowance(x, w13, s13, w2, s2, weights, ids,
                                                                                 block)
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} outputs beyond the bound, by up to {excess.max():.3g}"


def _fp8_flip_allowance(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                        weights: torch.Tensor, ids: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(T, H): what legitimate one-step fp8 flips of the intermediate can move each output by.

    An element of silu(gate) * up (each token x routed expert), divided by its group's scale, may flip when it lies
    closer to an fp8 rounding midpoint than its fp32 error bound: gate and up are K-term dots (error <= K eps
    sum|x w| in any summation order), silu and the product add a few ulps, and the group's amax (the scale) carries
    its own relative error into every element. A flip moves the element by one grid step, and the output by that
    step x scale x |its down-projection column| x the routing weight."""
    from resin.hal.fp8 import expand_block_scales, quantize_fp8_groups
    eps, k, inter, fp8_dtype = torch.finfo(torch.float32).eps, x.shape[1], w13.shape[1] // 2, w13.dtype
    grid = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()
    grid = grid[grid.isfinite()].unique()
    midpoints, steps = (grid[1:] + grid[:-1]) / 2, grid[1:] - grid[:-1]
    xq, xs = quantize_fp8_groups(x, fp8_dtype, block[1])
    xd = xq.float() * xs.repeat_interleave(block[1], 1)[:, :k]
    groups = -(-inter // block[1])
    allowance = torch.zeros(x.shape[0], w2.shape[1])
    for e in ids.long().unique().tolist():
        tok, slot = (ids.long() == e).nonzero(as_tuple=True)
        wd = w13[e].float() * expand_block_scales(s13[e], block, tuple(w13[e].shape))
        gate_up, bound = xd[tok] @ wd.T, k * eps * (xd[tok].abs() @ wd.abs().T)
        g, u, bg, bu = gate_up[:, :inter], gate_up[:, inter:], bound[:, :inter], bound[:, inter:]
        sig = torch.sigmoid(g)
        h = g * sig * u
        bh = (sig * (1 + g * (1 - sig)) * u).abs() * bg + (g * sig).abs() * bu + 8 * eps * h.abs()
        hg, bhg = (torch.nn.functional.pad(t, (0, groups * block[1] - inter)).view(-1, groups, block[1])
                   for t in (h, bh))
        amax = hg.abs().amax(-1, keepdim=True)
        scale = amax / torch.finfo(fp8_dtype).max
        v = hg / scale
        # the element's own error, then the scale's: whichever element the kernel finds largest, amax is off by at
        # most the largest error in the group
        bv = bhg / scale + v.abs() * bhg.amax(-1, keepdim=True) / amax
        distance, nearest = (v.unsqueeze(-1) - midpoints).abs().min(-1)
        flip = torch.where(distance <= bv, steps[nearest] * scale, 0.0).view(len(tok), -1)[:, :inter]
        w2d = w2[e].float() * expand_block_scales(s2[e], block, tuple(w2[e].shape))
        allowance.index_add_(0, tok, (flip @ w2d.abs().T) * weights[tok, slot].float().unsqueeze(1))
    return allowance


def _block_quantised(w: torch.Tensor, block: tuple[int, int], fp8_dtype: torch.dtype):
    """(E, N, K) weights -> fp8 and (E, ceil(N / bn), ceil(K / bk)) amax scales."""
    e, n, k = w.shape
    nb, kb = -(-n // block[0]), -(-k // block[1])
    tiles = torch.nn.functional.pad(w, (0, kb * block[1] - k, 0, nb * block[0] - n)).view(e, nb, block[0], kb,
                                                                                         block[1])
    scale = tiles.abs().amax((2, 4)) / torch.finfo(fp8_dtype).max
    q = (tiles / scale[:, :, None, :, None]).view(e, nb * block[0], kb * block[1])[:, :n, :k].to(fp8_dtype)
    return q, scale


def _check_fused_moe(dtype, num_tokens, hidden, inter, num_experts, top_k, act):
    """swigluoai runs as GPT-OSS does, with expert biases on both GEMMs and gate/up values wide enough that the
    clamps at +-limit (3 here) act."""
    gpt_oss = act == "swigluoai"
    x = torch.randn(num_tokens, hidden).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden) * hidden ** -0.5 * (4 if gpt_oss else 1)).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter) * inter ** -0.5).to(dtype)
    weights, ids = hal.MOE_ROUTE.native(torch.randn(num_tokens, num_experts), top_k)
    extra = dict(w13_bias=torch.randn(num_experts, 2 * inter).to(dtype),
                 w2_bias=torch.randn(num_experts, hidden).to(dtype), alpha=1.5, limit=3.0) if gpt_oss else {}
    if gpt_oss:
        gate = torch.nn.functional.linear(x.float(), w13[ids[0, 0].long()].float())[..., :inter]
        assert (gate.abs() > 3.0).any()  # the clamp is exercised
    assert moe.fused_moe_supports_args(x, w13, w2, weights, ids, act, **extra) is None
    close(moe.fused_moe(x, w13, w2, weights, ids, act, **extra),
          hal.FUSED_MOE.native(x, w13, w2, weights, ids, act, **extra))


@pytest.mark.parametrize("fp8_dtype", FP8_UNDER_TEST, ids=str)
@pytest.mark.parametrize("m,k", [(1, 16), (7, 96), (19, 200), (3, 4100)])  # 4100: three chunks, ragged tail
@pytest.mark.parametrize("static", [False, True])
def test_fp8_quantize_matches_native(fp8_dtype, m, k, static):
    x = torch.randn(m, k) * 3
    x[0, :8] = torch.tensor([1e-4, -1e-4, 3e-3, -2e-2, 0.0, 124.3, -124.3, 1e-6]) * x.abs().max() / 124.3
    scale = (x.abs().max() / torch.finfo(fp8_dtype).max * 1.3).reshape(1) if static else None
    got_q, got_s = fp8.quantize_fp8(x, fp8_dtype, scale)
    ref_q, ref_s = hal.quantize_fp8(x, fp8_dtype, scale)
    assert torch.equal(got_q.float(), ref_q.float())  # every value on the same grid point (-0.0 == 0.0)
    close(got_s.reshape(-1), ref_s.reshape(-1))


@pytest.mark.parametrize("fp8_dtype", FP8_UNDER_TEST, ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 33, 64), (7, 130, 96), (70, 16, 32)])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("static_input", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear(fp8_dtype, m, n, k, per_channel, static_input, x_dtype):
    fmax = torch.finfo(fp8_dtype).max
    x, w, bias = torch.randn(m, k).to(x_dtype), torch.randn(n, k), torch.randn(n).to(x_dtype)
    w_scale = w.abs().amax(1) / fmax if per_channel else (w.abs().max() / fmax).reshape(1)
    wq = (w / w_scale.reshape(-1, 1)).to(fp8_dtype)
    in_scale = (x.float().abs().max() / fmax).reshape(1) if static_input else None
    assert fp8.fp8_linear_supports_args(x, wq) is None
    got = fp8.fp8_linear(x, wq, w_scale, in_scale, bias)
    ref = hal.FP8_LINEAR.native(x, wq, w_scale, in_scale, bias)
    assert got.dtype == ref.dtype == x_dtype
    close(got, ref)
