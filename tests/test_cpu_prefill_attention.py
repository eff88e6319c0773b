"""Resin's C++ prefill attention kernels (the brgemm one on AMX, the AVX2 one) against causal
attention in float64 on fresh random paged caches, and the provider's routing of prefill chunks to them."""
from __future__ import annotations

import pytest
import torch

from resin import hal
from resin.backends.cpu import kernels
from resin.backends.cpu.attention import CppAttention

from attention_batches import head_major_outputs
from conftest import require_cpu_kernels

pytestmark = pytest.mark.kernels

require_cpu_kernels()


def _require_brgemm_bf16() -> None:
    if not kernels.brgemm_bf16():
        pytest.skip("requires a CPU where torch's brgemm ukernels pack bf16 (AMX tiles); prefill stays on SDPA here")


def _paged_prefill_case(seq_len: int, q_len: int, h: int, hk: int, d: int, dtype: torch.dtype, kernel: str):
    """A random paged cache (16-token blocks in random order, spare blocks around them) and a chunk of q_len
    queries at the end of seq_len tokens, run through the named prefill kernel; with causal attention in float64
    over the same values: (got, ref, spread = P.|V|, keys, per-head queries), all float64."""
    bs, g = 16, torch.Generator().manual_seed(torch.seed() % 2**31)
    nblk = -(-seq_len // bs)
    cache = torch.randn(2, hk, nblk + 7, bs, d, generator=g).to(dtype)
    table = torch.randperm(nblk + 7, generator=g)[:nblk].to(torch.int32)
    q = torch.randn(q_len, h * d, generator=g).to(dtype)
    got = getattr(kernels.extension(), kernel)(q, cache, table, seq_len, h, d ** -0.5).double()
    kv = cache.double()[:, :, table.long()].flatten(2, 3)[:, :, :seq_len]  # (2, Hk, seq_len, D)
    keys, values = kv[0].repeat_interleave(h // hk, 0), kv[1].repeat_interleave(h // hk, 0)
    qh = q.double().view(q_len, h, d).transpose(0, 1)
    visible = torch.arange(seq_len).unsqueeze(0) <= torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    probs = (qh @ keys.transpose(1, 2) * d ** -0.5).masked_fill(~visible, float("-inf")).softmax(-1)
    ref = (probs @ values).transpose(0, 1).reshape(q_len, h * d)
    spread = (probs @ values.abs()).transpose(0, 1).reshape(q_len, h * d)
    return got, ref, spread, keys, qh


@pytest.mark.parametrize("seq_len,q_len", [(300, 300), (77, 13), (1000, 1000), (2100, 700), (257, 1), (64, 64)])
@pytest.mark.parametrize("h,hk,d", [(9, 3, 64), (8, 8, 64), (8, 2, 128)])
def test_flash_prefill_matches_exact_attention(seq_len, q_len, h, hk, d):
    """The brgemm prefill kernel on a random paged cache (blocks in random order, 16-token blocks, spare blocks
    around them) against causal attention in float64 over the same bf16 values. The kernel rounds each probability
    to bf16 before P.V (as torch's flash kernel does: at most 2^-8 of each weight, bf16 keeping 8 significant bits)
    and its output once, so the bound is 2^-8 of the weighted mean of |V| plus one bf16 step of the output; a
    mis-masked key or a wrong tile moves outputs by far more. Fresh prompts, chunks after cached context (700 after
    1400: tiles of 256 keys cut at the diagonal), one query, a tile-sized prompt; 1, 3 and 4 query heads per KV
    head."""
    _require_brgemm_bf16()
    got, ref, spread, _, _ = _paged_prefill_case(seq_len, q_len, h, hk, d, torch.bfloat16, "flash_prefill_attention")
    assert ((got - ref).abs() <= 2.0 ** -8 * (spread + ref.abs())).all()


@pytest.mark.parametrize("seq_len,q_len", [(300, 300), (77, 13), (1000, 1000), (2100, 700), (257, 1), (64, 64)])
@pytest.mark.parametrize("h,hk,d", [(9, 3, 64), (8, 8, 64), (8, 2, 128), (10, 5, 48), (10, 5, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_prefill_f32_matches_exact_attention(seq_len, q_len, h, hk, d, dtype):
    """The AVX2 prefill kernel, the same cases as the brgemm one (and D = 48 and 80: three and five 16-column
    panels; with bf16 products, P.V over 48 columns, and over 64 then 16), against causal attention in float64 over the same values. Its error is fp32 rounding: each score's
    dot product over D terms (at most D eps32 scale sum |q k|, which scales that key's weight by e^err), and the
    softmax and P.V sums over at most seq_len terms in another order; so |got - ref| <= (2 max err + (seq_len + D)
    eps32) (weighted mean of |V| + |ref|). bf16 in and out adds the output's one rounding, at most 2^-8 of it, and
    where the products run in bf16 (AVX512-BF16) the probabilities' rounding before P.V, at most 2^-8 of each
    weight, and their exps from a polynomial within 6e-5, which enters each probability twice (its exp and the
    sum): (2^-8 + 1.2e-4) of the weighted mean of |V|. A mis-masked key or a wrong tile moves outputs by far more."""
    if not kernels.flash_prefill_f32():
        pytest.skip("requires AVX2 + FMA: prefill stays on SDPA here")
    got, ref, spread, keys, qh = _paged_prefill_case(seq_len, q_len, h, hk, d, dtype, "flash_prefill_attention_f32")
    eps = 2.0 ** -23
    score_err = d * eps * d ** -0.5 * (qh.abs() @ keys.abs().transpose(1, 2)).amax(-1)  # (H, q_len)
    rel = 2 * score_err.transpose(0, 1).repeat_interleave(d, 1) + (seq_len + d) * eps
    bound = rel * (spread + ref.abs())
    if dtype == torch.bfloat16:
        if kernels.extension().bf16_panels_available():  # built with AVX512-BF16: bf16 products
            bound = bound + (2.0 ** -8 + 1.2e-4) * spread
        bound = bound + 2.0 ** -8 * (ref.abs() + bound)
    assert ((got - ref).abs() <= bound).all()


def _require_flash_prefill(dtype: torch.dtype) -> str:
    """The C++ prefill kernel the provider uses for this dtype here, or a skip."""
    if dtype == torch.bfloat16 and kernels.brgemm_bf16():
        return "flash_prefill_attention"
    if not kernels.flash_prefill_f32():
        pytest.skip("requires AMX (bf16) or AVX2 + FMA: prefill stays on SDPA here")
    return "flash_prefill_attention_f32"


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1.6e-2), (torch.float32, 2e-6)])
@pytest.mark.parametrize("shapes", [[(300, 300), (9, 1), (700, 200)], [(13, 13), (1000, 1), (640, 128)]])
def test_cpp_attention_prefill_on_the_flash_kernel(monkeypatch, dtype, tol, shapes):
    """The provider sends each prefill chunk to the C++ kernel of its dtype (fresh prompts and chunks after a
    prefix, beside decode rows), and agrees with native to test_cpp_attention_matches_native's tolerance."""
    import resin.backends.cpu.attention as attention

    name = _require_flash_prefill(dtype)
    real, chunks = kernels.extension(), []

    class Recording:
        def __getattr__(self, attr):
            fn = getattr(real, attr)
            if attr != name:
                return fn

            def recorded(q, *args):
                chunks.append(q.shape[0])
                return fn(q, *args)
            return recorded

    monkeypatch.setattr(attention, "extension", Recording)
    layer = hal.AttentionLayer(9, 3, 64, scale=64 ** -0.5)
    ref, got = head_major_outputs(CppAttention, layer, shapes, dtype, block_size=16, num_blocks=256)
    assert sorted(chunks) == sorted(q for _, q in shapes if q > 1)
    assert (got.float() - ref.float()).abs().max().item() <= tol
