"""Resin's C++ CPU kernels against the native ops they replace, on fresh random inputs each run.

Rotary must be bit-equal to native in every dtype. Norms and silu-and-mul may differ from native only where an
fp32 sum is taken in another order or exp differs in its last bit, so: fp32 to a few ulp, bf16/fp16 by at most
one step of the output's rounding. Attention is computed in fp32 like native and rounded once.
"""
from __future__ import annotations

import pytest
import torch

from resin import hal
from resin.backends.cpu import kernels
from resin.backends.cpu.attention import CppAttention

from attention_batches import head_major_outputs, head_major_vs_native
from conftest import require_cpu_kernels

pytestmark = pytest.mark.kernels

require_cpu_kernels()

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One step of dtype's rounding at each reference value (the spacing above |ref|)."""
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    tiny = {torch.float32: 2.0 ** -126, torch.bfloat16: 2.0 ** -126, torch.float16: 2.0 ** -14}[dtype]
    mag = ref.double().abs().clamp_min(tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - mantissa)


def _assert_within_ulps(got: torch.Tensor, ref: torch.Tensor, ulps: float) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    err = (got.double() - ref.double()).abs()
    worst = (err / _ulp(ref, ref.dtype)).max().item()
    assert worst <= ulps, f"{worst} ulp from native (allowed {ulps})"


def _assert_norm_close(got: torch.Tensor, ref: torch.Tensor, h: torch.Tensor, w: torch.Tensor, eps: float) -> None:
    """RMSNorm rounds twice, as native does: the normalised row to the dtype, then its product with the weight.
    The kernel's fp32 sum of squares runs in another order, so the first rounding may land one step apart; the
    weight then carries that step: at most |w| * ulp(normalised) + one ulp of the output (fp32: 4 ulp)."""
    if ref.dtype == torch.float32:
        return _assert_within_ulps(got, ref, 4)
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(ref.dtype)
    bound = _ulp(ref, ref.dtype) + w.double().abs() * _ulp(normed, ref.dtype)
    err = (got.double() - ref.double()).abs()
    assert (err <= bound).all(), f"{(err - bound).max().item()} over the double-rounding bound"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 130), (3, 5, 64), (33, 17)])
def test_rms_norm_matches_native(dtype, shape):
    x = (torch.randn(*shape) * 3).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    assert kernels.norm_args(x, w, 1e-5) is None
    _assert_norm_close(kernels.rms_norm(x, w, 1e-5), hal.RMS_NORM.native(x, w, 1e-5), x, w, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (9, 130), (40, 64)])
def test_fused_add_rms_norm_matches_native(dtype, rows, hidden):
    wide = torch.randn(rows, hidden * 2).to(dtype)
    x = wide[:, :hidden]  # a strided view, as a projection's output slice is
    residual = torch.randn(rows, hidden).to(dtype)
    w = torch.randn(hidden).to(dtype)
    assert kernels.add_norm_args(x, residual, w, 1e-6) is None
    out, res = kernels.fused_add_rms_norm(x, residual, w, 1e-6)
    ref_out, ref_res = hal.FUSED_ADD_RMS_NORM.native(x, residual, w, 1e-6)
    assert torch.equal(res, ref_res)  # one rounded add, as native's
    _assert_norm_close(out, ref_out, ref_res, w, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (24, 24), (32, 16)])
def test_rotary_is_bit_equal_to_native(dtype, is_neox, head_size, rot_dim):
    t, hq, hk = 11, 6, 2
    qkv = torch.randn(t, (hq + 2 * hk) * head_size).to(dtype)  # q and k as views of one projection output
    q, k, _ = qkv.split([hq * head_size, hk * head_size, hk * head_size], dim=-1)
    positions = torch.randint(0, 500, (t,))
    cache = hal.rope_cos_sin_cache(rot_dim, 512, 10000.0)
    ref_q, ref_k = hal.ROTARY.native(positions, q.clone(), k.clone(), cache, head_size, is_neox)
    assert kernels.rotary_args(positions, q, k, cache, head_size, is_neox) is None
    got_q, got_k = kernels.rotary(positions, q, k, cache, head_size, is_neox)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3072), (5, 130), (2, 3, 64)])
def test_silu_and_mul_matches_native(dtype, shape):
    x = (torch.randn(*shape) * 4).to(dtype)
    assert kernels.act_args(x) is None
    ref = hal.SILU_AND_MUL.native(x)
    # fp32: silu's exp and division each add an ulp before the product's rounding
    _assert_within_ulps(kernels.silu_and_mul(x), ref, 8 if dtype == torch.float32 else 1)


def test_silu_and_mul_extreme_inputs():
    x = torch.tensor([[-200.0, -88.0, -20.0, 0.0, 20.0, 90.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    got = kernels.silu_and_mul(x)
    ref = hal.SILU_AND_MUL.native(x)
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("shapes", [
    [(9, 1), (6, 6), (23, 7), (1, 1), (40, 1)],  # decodes and prefill chunks mixed
    [(5, 1), (17, 1), (33, 1), (70, 1)],  # decode only
])
@pytest.mark.parametrize("window", [None, 6])
# groups of 3 and 5 at D = 64 (passes of 4 + 1), 4 at D = 128 (passes of 2 + 2)
@pytest.mark.parametrize("h,hk,d", [(6, 2, 24), (9, 3, 64), (10, 2, 64), (4, 4, 128), (8, 2, 128)])
@pytest.mark.parametrize("block_size", [4, 16, 24])  # 24: sixteen keys at a time, then a tail of eight
def test_cpp_attention_matches_native(dtype, tol, shapes, window, h, hk, d, block_size):
    """Decode rows through the C++ kernel (prefill rows still SDPA), KV written by the C++ writer."""
    layer = hal.AttentionLayer(h, hk, d, scale=d ** -0.5, sliding_window=window)
    assert head_major_vs_native(CppAttention, layer, shapes, dtype, block_size=block_size) <= tol


# bf16 and fp16: both sides compute in fp32 and round once, so they may sit one step of the dtype apart (2^-7 or
# 2^-10 of |ref|); fp32: both sum in fp32 in their own orders (the same bound as test_cpp_attention_matches_native)
SPLIT_BOUNDS = {torch.bfloat16: (2.0 ** -7, 1e-6), torch.float16: (2.0 ** -10, 1e-6), torch.float32: (0.0, 2e-6)}


@pytest.mark.parametrize("dtype", list(SPLIT_BOUNDS))
@pytest.mark.parametrize("shapes", [[(2000, 1)], [(3000, 1), (1, 1)], [(130, 1), (3, 1)]])
@pytest.mark.parametrize("window", [None, 600])
@pytest.mark.parametrize("h,hk,d", [(9, 3, 64), (8, 1, 128)])
def test_cpp_decode_split_across_threads_matches_native(dtype, shapes, window, h, hk, d):
    """Few (sequence, KV head) items and long contexts: the part kernels (bf16 on AVX512-BF16, any float type on
    AVX2 + FMA) split each key range into parts that run on every thread and merge them by their maxima. Four
    threads whatever the machine, so the splits are the same everywhere: 2000 keys in 3 or 7 parts, a 1-key
    sequence beside a 3000-key one (empty parts), a 600-key window (2 parts), short sequences (one part, no
    merge). A part lost or mis-weighted in the merge moves the output far more than the bounds."""
    layer = hal.AttentionLayer(h, hk, d, scale=d ** -0.5, sliding_window=window)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        ref, got = head_major_outputs(CppAttention, layer, shapes, dtype, block_size=16, num_blocks=256)
    finally:
        torch.set_num_threads(threads)
    rel, floor = SPLIT_BOUNDS[dtype]
    assert ((got.float() - ref.float()).abs() <= rel * ref.float().abs() + floor).all()


@pytest.mark.parametrize("rows, n", [(1, 49152), (5, 37), (33, 1000), (2, 16)])
def test_argmax_equals_torch(rows, n):
    """Fresh random rows, plus ties (the first wins), -inf rows, a NaN (counts as largest), a maximum in the scalar
    tail, and rows of a wider matrix (the sampler's vocabulary slice)."""
    x = torch.randn(rows, n + 3)[:, :n]
    x[0, n // 2] = x[0, n // 3] = x[0].max() + 1
    if rows > 1:
        x[1] = float("-inf")
    if rows > 2:
        x[2, n - 1] = float("inf")
        x[3, n // 2], x[3, n - 2] = float("nan"), float("nan")
        x[4, :] = 0.0
        x[4, 3] = -0.0
    assert kernels.argmax_args(x) is None
    assert torch.equal(kernels.argmax(x), hal.ARGMAX.native(x))
    assert kernels.argmax_args(x.double()) is not None and kernels.argmax_args(x.t()) is not None


@pytest.mark.parametrize("rows, n", [(1, 49152), (6, 37), (40, 1000), (3, 1)])
def test_random_sample_equals_native(rows, n):
    """Fresh random logits with -inf entries, a row with one finite token, uniforms at 0 and just below 1: the
    kernel's draw equals native's wherever u x total is not within fp32 rounding of a CDF boundary (the kernel sums
    fp32 weights in its own order; native sums fp64 ones), and it never picks a token of zero weight."""
    x = (torch.randn(rows, n + 5) * 4)[:, :n]
    x[torch.rand(rows, n) < 0.2] = float("-inf")
    x[:, 0] = torch.randn(rows)  # every row keeps a finite maximum
    if rows > 2:
        x[2, 1:] = float("-inf")
    u = torch.rand(rows, dtype=torch.float64)
    u[0] = 0.0
    if rows > 1:
        u[1] = 1.0 - 2.0 ** -53
    assert kernels.random_sample_args(x, u) is None
    got, ref = kernels.random_sample(x, u), hal.RANDOM_SAMPLE.native(x, u)
    assert (x.gather(1, got.unsqueeze(1)) > float("-inf")).all()
    cdf = torch.exp(x.double() - x.double().amax(1, keepdim=True)).cumsum(1)
    target = u * cdf[:, -1]
    for r in torch.nonzero(got != ref).flatten().tolist():
        lo = min(got[r].item(), ref[r].item())
        gap = (cdf[r, lo] - target[r]).abs().item()
        assert gap <= 1e-5 * cdf[r, -1].item(), f"row {r}: {got[r].item()} vs {ref[r].item()}, gap {gap}"
    assert kernels.random_sample_args(x.double(), u) is not None and kernels.random_sample_args(x, u.float())


def test_random_sample_kernel_follows_the_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, float("-inf"), 0.5])
    n = 40000
    draws = kernels.random_sample(logits.expand(n, 6).contiguous(), torch.rand(n, dtype=torch.float64))
    freq = torch.bincount(draws, minlength=6).double() / n
    probs = torch.softmax(logits.double(), 0)
    assert ((freq - probs).abs() <= 5 * (probs * (1 - probs) / n).sqrt()).all()  # 5 standard deviations


def test_cpp_attention_declines_other_dtypes():
    layers = [hal.AttentionLayer(4, 2, 16, 0.25)]
    assert "float64" in CppAttention.unsupported_reason(layers, 16, torch.float64, torch.device("cpu"))
    assert CppAttention.unsupported_reason(layers, 16, torch.bfloat16, torch.device("cpu")) is None


def test_bad_indices_raise_instead_of_reading_out_of_bounds():
    cache = torch.zeros(2, 1, 4, 16, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 2 * 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.extension().paged_decode_attention(q, cache, torch.tensor([[7]], dtype=torch.int32),
                                                   torch.tensor([3], dtype=torch.int32), 2, 0.1, 0)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        kernels.rotary(torch.tensor([512]), q[:, :64].clone(), q[:, :64].clone(),
                       hal.rope_cos_sin_cache(64, 512, 10000.0), 64)


def test_selected_on_this_cpu():
    sel = hal.select_backend("cpu", install=False)
    for op in ("rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "attention"):
        assert sel.table[op].chosen == "cpp", sel.format_table()


def test_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++")
    assert "no C++ compiler (no-such-c++)" in kernels.missing_toolchain()


def test_build_failure_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this source does not compile\n")
    monkeypatch.setattr(kernels, "SOURCES", [broken])
    monkeypatch.setattr(kernels, "build_dir", lambda: tmp_path / "build")
    module, reason = kernels.load.__wrapped__()  # uncached: the real build of a broken source
    assert module is None and "building Resin's CPU kernels failed" in reason and "error" in reason
    # remembered: the next start reports the same reason without building again, and says how to retry
    (tmp_path / "build" / "build.ninja").unlink()
    again, reason_again = kernels.load.__wrapped__()
    assert again is None and reason_again.startswith(reason) and "to retry" in reason_again
    assert not (tmp_path / "build" / "build.ninja").exists()


@pytest.mark.timeout(120)
def test_stale_build_lock_does_not_hang(monkeypatch, tmp_path):
    """A build killed midway leaves torch's `lock` file; the next start must not wait on it forever."""
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this source does not compile\n")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "lock").write_text("")
    monkeypatch.setattr(kernels, "SOURCES", [broken])
    monkeypatch.setattr(kernels, "build_dir", lambda: tmp_path / "build")
    module, reason = kernels.load.__wrapped__()
    assert module is None and "failed" in reason


def test_without_kernels_the_torch_providers_serve(monkeypatch):
    monkeypatch.setattr(kernels, "load", lambda: (None, "no C++ compiler (c++) on PATH"))
    sel = hal.select_backend("cpu", install=False)
    assert sel.table["attention"].chosen == "cpu" and sel.table["rotary"].chosen == "cpu"
    assert sel.table["rms_norm"].chosen == "native"
    assert ("cpp", "no C++ compiler (c++) on PATH") in sel.table["silu_and_mul"].skipped
