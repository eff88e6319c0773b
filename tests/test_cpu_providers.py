"""CPU providers against the native op they replace, on fresh random inputs (fp32 tight, bf16 to bf16 rounding)."""
from __future__ import annotations

import pytest
import torch

from resin import hal
from resin.backends.cpu.attention import CpuAttention

from attention_batches import head_major_vs_native, paged_batch

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("shapes", [
    [(9, 1), (6, 6), (23, 7), (1, 1), (40, 1)],  # decodes and prefill chunks mixed
    [(5, 1), (17, 1), (33, 1)],  # decode only
    [(13, 13), (29, 5)],  # prefill only
])
@pytest.mark.parametrize("window", [None, 6])
def test_cpu_attention_matches_native(dtype, tol, shapes, window):
    layer = hal.AttentionLayer(6, 2, 24, scale=24 ** -0.5, sliding_window=window)
    assert head_major_vs_native(CpuAttention, layer, shapes, dtype, num_blocks=48) <= tol


@pytest.mark.parametrize("shape", [(1, 576), (7, 130), (3, 5, 64), (40, 576)])
@pytest.mark.parametrize("out_features", [1, 97, 3072])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_linear_matches_native(shape, out_features, with_bias, dtype):
    """bf16: to bf16 rounding. fp32: native's products summed in oneDNN's order, so within fp32 reassociation,
    K eps32 sum |x w| (+ |b|) elementwise."""
    from resin.backends.cpu import linear
    from resin.hal.platform import cpu_platform

    ok, reason = linear.supported(cpu_platform())
    if not ok:
        pytest.skip(f"requires torch's oneDNN: {reason}")
    if dtype not in linear._dtypes():
        pytest.skip("requires a CPU with native bf16 matmul (AVX512-BF16 or AMX) for oneDNN's bf16 linear")
    k = shape[-1]
    x = torch.randn(*shape).to(dtype)
    w = torch.randn(out_features, k).to(dtype)
    b = torch.randn(out_features).to(dtype) if with_bias else None
    assert linear.supports_args(x, w, b) is None
    ref = hal.LINEAR.native(x, w, b).double()
    if dtype == torch.float32:
        bound = k * 2.0 ** -23 * (x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs()))
    else:
        bound = torch.full_like(ref, 1e-2 * max(1.0, ref.abs().max().item()))
    for _ in range(2):  # bf16: the second call uses the weight packed by the first
        got = linear.onednn_linear(x, w, b).double()
        assert got.shape == ref.shape
        assert ((got - ref).abs() <= bound + 1e-30).all()
    assert linear.supports_args(x, w.to(torch.float16)) is not None  # mixed dtypes: native



def test_fp32_prefill_rows_go_to_mkl():
    """From MKL_FP32_MIN_ROWS fp32 rows (a prefill chunk) oneDNN declines where torch has MKL, so the HAL's chain
    hands the call to native (F.linear: MKL's sgemm); below it, and for bf16, oneDNN keeps them."""
    from resin.backends.cpu import linear

    w = torch.randn(64, 96)
    most = linear.MKL_FP32_MIN_ROWS
    assert linear.supports_args(torch.randn(most - 1, 96), w) is None
    many, batched = torch.randn(most, 96), torch.randn(2, most // 2, 96)
    for x in (many, batched):
        reason = linear.supports_args(x, w)
        assert (reason is not None) == torch.backends.mkl.is_available()
        if reason is not None:
            assert "MKL" in reason
            chain = hal.select_backend("cpu", install=False).table["linear"].chain
            taker = next(p for p in chain if p.supports_args is None or p.supports_args(x, w) is None)
            assert taker.name == "native"
            assert torch.equal(taker.fn(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("adjacent", [True, False])
def test_cpu_rotary_is_bit_equal_to_native(dtype, tokens, adjacent):
    from resin.backends.cpu import rotary

    h, hk, d = 9, 3, 64
    cache = hal.rope_cos_sin_cache(d, 500, 10000.0, None)
    pos = torch.randint(0, 500, (tokens,))
    qkv = torch.randn(tokens, (h + 2 * hk) * d).to(dtype)
    if adjacent:  # q and k as the fused projection leaves them: one row, side by side
        q, k, _ = qkv.split([h * d, hk * d, hk * d], dim=-1)
    else:
        q, k = torch.randn(tokens, h * d).to(dtype), torch.randn(tokens, hk * d).to(dtype)
    assert rotary.supports_args(pos, q, k, cache, d) is None
    got, ref = rotary.rotary(pos, q, k, cache, d), hal.ROTARY.native(pos, q, k, cache, d)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert got[0].shape == q.shape and got[1].shape == k.shape
    assert rotary.supports_args(pos, q, k, cache, d, is_neox=False) is not None
    assert rotary.supports_args(pos, q, k, hal.rope_cos_sin_cache(32, 500, 10000.0, None), d) is not None


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("shapes", [[(700, 200)], [(300, 299)], [(1000, 1), (640, 128)]])
def test_prefill_chunk_after_a_prefix_matches_native(dtype, tol, shapes):
    """A prefill chunk after a long prefix runs as two flash calls (the prefix unmasked, the chunk causal) merged by
    their log-sum-exps: a 1-token prefix, a chunk 4x shorter than its prefix, beside a decode row."""
    layer = hal.AttentionLayer(9, 3, 64, scale=64 ** -0.5)
    assert head_major_vs_native(CpuAttention, layer, shapes, dtype, block_size=16, num_blocks=128) <= tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("shapes", [
    [(9, 1), (6, 6), (23, 7), (1, 1), (40, 36), (40, 1)],  # decodes and prefill chunks in both forms, mixed
    [(5, 1), (17, 1), (33, 1), (2, 1), (8, 1), (30, 1)],  # decode only, past the fp32 batch
    [(13, 13), (29, 5)],  # prefill only: a fresh prompt (expanded), a short chunk after context (absorbed)
])
@pytest.mark.parametrize("tight", [False, True])
def test_cpu_latent_attention_matches_native(dtype, tol, shapes, tight, monkeypatch):
    """The latent (MLA) cache is the same layout for both: the caches must end equal (the row write) and each
    head's values agree to the dtype's rounding, whichever form the provider chose for a prefill (the native
    reference absorbs everything). tight: memory caps so small that no prefill may expand and the absorbed form's
    folded mask takes one or two heads per call."""
    from resin.backends.cpu import mla as cpu_mla
    from resin.backends.cpu.mla import CpuMla
    from resin.hal.mla import expanded_prefill_pays

    if tight:
        monkeypatch.setattr(cpu_mla, "_EXPANDED_ELEMENTS", 0)
        monkeypatch.setattr(cpu_mla, "_MASK_ELEMENTS", 400)

    layer = hal.mla_layer(6, 40, 8, 16, 16, scale=24 ** -0.5)
    prefills = [(seq_len, q_len) for seq_len, q_len in shapes if q_len > 1]
    assert {expanded_prefill_pays(q_len, seq_len, layer) for seq_len, q_len in prefills} == (
        {True, False} if prefills else set())
    meta, t = paged_batch(shapes, 4, 64)
    cache = torch.randn(64, 4, 1, 48).to(dtype)
    q, rows = torch.randn(t, 6 * 24).to(dtype), torch.randn(t, 48).to(dtype)
    kv_b = (torch.randn(6, 32, 40) / 40 ** 0.5).to(dtype)  # unit-scale values, so tol is relative to them
    outs, caches = [], []
    for cls in (hal.NativeMla, CpuMla):
        backend, mine = cls([layer], 4, dtype, torch.device("cpu")), cache.clone()
        assert backend.kv_cache_shape(64, 4, 1, 48) == cache.shape
        backend.plan(meta)
        outs.append(backend.forward(0, q, rows, kv_b, mine).float())
        caches.append(mine)
    assert torch.equal(caches[0], caches[1])
    assert outs[1].shape == (t, 6 * 16)
    assert ((outs[1] - outs[0]).abs() <= tol * outs[0].abs().clamp(min=1.0)).all()  # values reach ~4: ulps grow
