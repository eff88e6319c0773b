"""The kernel checks at real sizes on a GPU, in bf16 too (the interpreter cannot run bf16 dots): every provider
the selected backend's table chose (Triton, aiter, torch._scaled_mm) against the op's native implementation."""
from __future__ import annotations

import pytest
import torch

from resin import hal

pytestmark = [pytest.mark.kernels, pytest.mark.requires_gpu]


@pytest.fixture(scope="module")
def table():
    sel = hal.select_backend("auto")
    yield sel
    hal.registry.deactivate()


def close(got, ref, dtype):
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    scale = max(1.0, ref.float().abs().max().item())
    assert (got.float() - ref.float()).abs().max().item() <= tol * scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norms_activations_rotary(gpu_device, table, dtype):
    x = torch.randn(4096, 4096, device=gpu_device, dtype=dtype)
    res = torch.randn_like(x)
    w = torch.randn(4096, device=gpu_device, dtype=dtype)
    close(hal.RMS_NORM(x, w, 1e-6), hal.RMS_NORM.native(x, w, 1e-6), dtype)
    got, got_res = hal.FUSED_ADD_RMS_NORM(x, res, w, 1e-6)
    ref, ref_res = hal.FUSED_ADD_RMS_NORM.native(x, res, w, 1e-6)
    close(got, ref, dtype)
    close(got_res, ref_res, dtype)
    gu = torch.randn(1024, 2 * 11008, device=gpu_device, dtype=dtype)
    close(hal.SILU_AND_MUL(gu), hal.SILU_AND_MUL.native(gu), dtype)
    close(hal.GELU_AND_MUL(gu, "tanh"), hal.GELU_AND_MUL.native(gu, "tanh"), dtype)
    cache = hal.rope_cos_sin_cache(128, 8192, 10000.0, None).to(gpu_device)
    pos = torch.randint(0, 8192, (2048,), device=gpu_device)
    for is_neox in (True, False):
        q = torch.randn(2048, 32 * 128, device=gpu_device, dtype=dtype)
        k = torch.randn(2048, 8 * 128, device=gpu_device, dtype=dtype)
        ref_q, ref_k = hal.ROTARY.native(pos, q, k, cache, 128, is_neox)
        got_q, got_k = hal.ROTARY(pos, q.clone(), k.clone(), cache, 128, is_neox)
        close(got_q, ref_q, dtype)
        close(got_k, ref_k, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shapes", [
    [(2048, 1)] * 8 + [(700, 1)] * 56,  # decode only (split-K)
    [(4096, 1)] * 4,  # few long decodes: many splits
    [(512, 512), (1500, 300)] + [(900, 1)] * 30,  # prefills mixed with decodes
])
@pytest.mark.parametrize("window,soft_cap,sinks", [(None, None, False), (256, 30.0, True)])
def test_paged_attention(gpu_device, table, dtype, shapes, window, soft_cap, sinks):
    from attention_batches import paged_batch

    h, hk, d, bs = 32, 8, 128, 16
    layer = hal.AttentionLayer(h, hk, d, d ** -0.5, sliding_window=window, logits_soft_cap=soft_cap,
                               has_sinks=sinks)
    num_blocks = sum(-(-c // bs) for c, _ in shapes) + 8
    meta, t = paged_batch(shapes, bs, num_blocks)
    meta = hal.AttentionMetadata(meta.query_start_loc.to(gpu_device), meta.seq_lens.to(gpu_device),
                                 meta.block_tables.to(gpu_device), meta.slot_mapping.to(gpu_device),
                                 meta.max_query_len, meta.max_seq_len, meta.query_start_loc_host)
    cache = torch.randn(2, num_blocks, bs, hk, d, device=gpu_device, dtype=dtype)
    q, k, v = (torch.randn(t, n * d, device=gpu_device, dtype=dtype) for n in (h, hk, hk))
    sink = torch.randn(h, device=gpu_device) if sinks else None
    native = hal.NativeAttention([layer], bs, dtype, gpu_device)
    native.plan(meta)
    ref_cache = cache.clone()
    ref = native.forward(0, q, k, v, ref_cache, sink)
    attn = hal.ATTENTION([layer], bs, dtype, gpu_device)
    attn.plan(meta)
    got_cache = cache.clone()
    if attn.kv_cache_shape(num_blocks, bs, hk, d) == tuple(cache.shape):
        got = attn.forward(0, q, k, v, got_cache, sink)
        assert torch.equal(got_cache, ref_cache)
        close(got, ref, dtype)
    else:
        pytest.fail(f"{type(attn).__name__} uses another cache layout; this test needs a layout converter")


def test_moe(gpu_device, table):
    for e, k in ((64, 8), (128, 8), (8, 2)):
        logits = torch.randn(1024, e, device=gpu_device)
        got_w, got_ids = hal.MOE_ROUTE(logits, k)
        ref_w, ref_ids = hal.MOE_ROUTE.native(logits, k)
        assert torch.equal(got_ids, ref_ids)
        close(got_w, ref_w, torch.float32)
    dtype = torch.bfloat16
    x = torch.randn(512, 2048, device=gpu_device, dtype=dtype)
    w13 = (torch.randn(8, 2 * 1408, 2048, device=gpu_device) * 2048 ** -0.5).to(dtype)
    w2 = (torch.randn(8, 2048, 1408, device=gpu_device) * 1408 ** -0.5).to(dtype)
    w, ids = hal.MOE_ROUTE.native(torch.randn(512, 8, device=gpu_device), 2)
    close(hal.FUSED_MOE(x, w13, w2, w, ids), hal.FUSED_MOE.native(x, w13, w2, w, ids), dtype)


@pytest.mark.parametrize("per_channel,static", [(False, True), (True, False), (False, False)])
def test_fp8_linear(gpu_device, table, per_channel, static):
    fp8 = table.platform.fp8_dtype
    if fp8 is None:
        pytest.skip(f"requires a GPU with fp8 ({table.platform.arch} has none)")
    fmax = torch.finfo(fp8).max
    x = torch.randn(300, 4096, device=gpu_device, dtype=torch.bfloat16)
    w = torch.randn(4096 + 64, 4096, device=gpu_device)
    ws = w.abs().amax(1) / fmax if per_channel else (w.abs().max() / fmax).reshape(1)
    wq = (w / ws.reshape(-1, 1)).to(fp8)
    xs = (x.float().abs().max() / fmax).reshape(1) if static else None
    close(hal.FP8_LINEAR(x, wq, ws, xs), hal.FP8_LINEAR.native(x, wq, ws, xs), torch.bfloat16)


@pytest.mark.parametrize("shapes", [
    [(2048, 1)] * 8 + [(700, 1)] * 24,  # decode only (split-K; aiter / FlashMLA where chosen)
    [(512, 512), (1500, 300)] + [(900, 1)] * 16,  # prefills mixed with decodes (the Triton kernel)
])
def test_paged_mla(gpu_device, table, shapes):
    """DeepSeek's latent attention (16 heads a rank, 512 latent + 64 rope) through the chosen mla_attention
    provider, at the block size it asks for (FlashMLA reads 64-token pages)."""
    from attention_batches import paged_batch

    dtype = torch.bfloat16
    layer = hal.mla_layer(16, 512, 64, 128, 128, 192 ** -0.5)
    bs = 64 if table.table["mla_attention"].chosen == "flashmla" else 16
    num_blocks = sum(-(-c // bs) for c, _ in shapes) + 8
    meta, t = paged_batch(shapes, bs, num_blocks)
    meta = hal.AttentionMetadata(meta.query_start_loc.to(gpu_device), meta.seq_lens.to(gpu_device),
                                 meta.block_tables.to(gpu_device), meta.slot_mapping.to(gpu_device),
                                 meta.max_query_len, meta.max_seq_len, meta.query_start_loc_host)
    cache = torch.randn(num_blocks, bs, 1, 576, device=gpu_device, dtype=dtype)
    q, rows = torch.randn(t, 16 * 576, device=gpu_device, dtype=dtype), torch.randn(t, 576, device=gpu_device,
                                                                                   dtype=dtype)
    native = hal.NativeMla([layer], bs, dtype, gpu_device)
    native.plan(meta)
    ref_cache = cache.clone()
    ref = native.latent_forward(0, q, rows, ref_cache)
    mla = hal.MLA_ATTENTION([layer], bs, dtype, gpu_device)
    mla.plan(meta)
    got = mla.latent_forward(0, q, rows, cache)
    assert torch.equal(cache, ref_cache)
    close(got, ref, dtype)


def test_grouped_routing_and_deepseek_experts(gpu_device, table):
    """DeepSeek-V3's router (256 experts in 8 groups, best 4, sigmoid with a correction bias, top 8) and fused
    experts at its expert count."""
    logits = torch.randn(1024, 256, device=gpu_device)
    bias = torch.rand(256, device=gpu_device) * 0.2
    args = (8, "sigmoid", True, 8, 4, bias, 2.5)
    got_w, got_ids = hal.MOE_ROUTE(logits, *args)
    ref_w, ref_ids = hal.MOE_ROUTE.native(logits, *args)
    assert torch.equal(got_ids.sort(-1).values, ref_ids.sort(-1).values)
    close(got_w.sort(-1).values, ref_w.sort(-1).values, torch.float32)
    dtype = torch.bfloat16
    x = torch.randn(256, 1024, device=gpu_device, dtype=dtype)
    w13 = (torch.randn(256, 2 * 256, 1024, device=gpu_device) * 1024 ** -0.5).to(dtype)
    w2 = (torch.randn(256, 1024, 256, device=gpu_device) * 256 ** -0.5).to(dtype)
    close(hal.FUSED_MOE(x, w13, w2, ref_w, ref_ids), hal.FUSED_MOE.native(x, w13, w2, ref_w, ref_ids), dtype)


def test_block_fp8_linear(gpu_device, table):
    fp8 = table.platform.fp8_dtype
    if fp8 is None:
        pytest.skip(f"requires a GPU with fp8 ({table.platform.arch} has none)")
    n, k = 7168 + 64, 2048  # a ragged last row block
    x = torch.randn(300, k, device=gpu_device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=gpu_device)
    tiles = torch.nn.functional.pad(w, (0, 0, 0, 64)).view(-1, 128, k // 128, 128)
    ws = tiles.abs().amax((1, 3)) / torch.finfo(fp8).max
    wq = (tiles / ws[:, None, :, None]).view(-1, k)[:n].to(fp8)
    close(hal.BLOCK_FP8_LINEAR(x, wq, ws, (128, 128)), hal.BLOCK_FP8_LINEAR.native(x, wq, ws, (128, 128)),
          torch.bfloat16)
