"""The recurrent-state ops (hal/recurrent.py): the native definitions against transformers' own references, state
carried across chunks equal to one pass, the decode update equal to a one-token chunk; then the Triton kernels
against native on ragged batches with state carried across chunks (in Triton's interpreter on a CPU)."""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from resin import hal
from resin.hal.recurrent import l2_normalize

from conftest import KERNEL_DEVICE


def ragged(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def conv_inputs(lengths, d=12, width=4, slots=6, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs every run
    x = torch.randn(sum(lengths), d, generator=g).to(dtype=dtype, device=device)
    w = torch.randn(d, width, generator=g).to(dtype=dtype, device=device)
    b = torch.randn(d, generator=g).to(dtype=dtype, device=device)
    state = torch.randn(slots, d, width - 1, generator=g).to(dtype=dtype, device=device)
    idx = torch.randperm(slots, generator=g)[:len(lengths)].to(torch.int32).to(device)
    return x, w, b, state, idx


def gdn_inputs(lengths, h=2, hv=4, dk=12, dv=20, slots=5, device="cpu"):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    t = sum(lengths)
    q, k = (torch.randn(t, h, dk, generator=g).to(device) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=g).to(device)
    decay = -F.softplus(torch.randn(t, hv, generator=g)).to(device)  # log decay <= 0
    beta = torch.rand(t, hv, generator=g).to(device)
    state = torch.randn(slots, hv, dk, dv, generator=g).to(device)
    idx = torch.randperm(slots, generator=g)[:len(lengths)].to(torch.int32).to(device)
    return q, k, v, decay, beta, state, idx


# ---- native definitions --------------------------------------------------------------------------------------
@pytest.mark.unit
def test_conv1d_matches_a_padded_torch_conv_and_carries_state():
    lengths = [5, 1, 7]
    x, w, b, state, idx = conv_inputs(lengths)
    fresh = torch.tensor([False, True, False])
    before = state.clone()
    out = hal.CAUSAL_CONV1D.native(x, w, b, state, ragged(lengths), idx, ~fresh)
    starts = ragged(lengths).tolist()
    for i, (a, e) in enumerate(zip(starts, starts[1:])):
        prior = torch.zeros(12, 3) if fresh[i] else before[idx[i]]
        ext = torch.cat((prior, x[a:e].T), 1)
        want = F.silu(F.conv1d(ext[None], w[:, None], b, groups=12)[0]).T
        torch.testing.assert_close(out[a:e], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[idx[i]], ext[:, -3:])
    # two chunks carrying the state = one pass; then a decode update = a chunk of one token
    x, w, b, state, idx = conv_inputs([9], slots=2)
    one = state.clone()
    whole = hal.CAUSAL_CONV1D.native(x, w, b, one, ragged([9]), idx, torch.tensor([True]))
    two = state.clone()
    first = hal.CAUSAL_CONV1D.native(x[:4], w, b, two, ragged([4]), idx, torch.tensor([True]))
    second = hal.CAUSAL_CONV1D.native(x[4:8], w, b, two, ragged([4]), idx, torch.tensor([True]))
    last = hal.CAUSAL_CONV1D_UPDATE.native(x[8:], w, b, two, idx)
    torch.testing.assert_close(torch.cat((first, second, last)), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(two, one)


@pytest.mark.unit
def test_gated_delta_rule_matches_transformers_recurrence_and_carries_state():
    qwen3_next = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    lengths = [6, 1, 4]
    q, k, v, decay, beta, state, idx = gdn_inputs(lengths)
    has = torch.tensor([True, False, True])
    before = state.clone()
    out = hal.GATED_DELTA_RULE.native(q, k, v, decay, beta, state, ragged(lengths), idx, has)
    starts = ragged(lengths).tolist()
    # the model repeats each q/k head over its value heads before the call, as transformers' Qwen3-Next does (its
    # reference takes equal head counts in some releases)
    qr, kr = (t.repeat_interleave(v.shape[1] // q.shape[1], dim=1) for t in (q, k))
    for i, (a, e) in enumerate(zip(starts, starts[1:])):
        want, final = qwen3_next.torch_recurrent_gated_delta_rule(
            qr[a:e][None], kr[a:e][None], v[a:e][None], decay[a:e][None], beta[a:e][None],
            initial_state=before[idx[i]][None] if has[i] else None, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[a:e], want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state[idx[i]], final[0], rtol=1e-4, atol=1e-4)
    # chunks carrying the state = one pass
    q, k, v, decay, beta, state, idx = gdn_inputs([7], slots=1)
    args = lambda a, e: (q[a:e], k[a:e], v[a:e], decay[a:e], beta[a:e])  # noqa: E731
    one, two = state.clone(), state.clone()
    whole = hal.GATED_DELTA_RULE.native(*args(0, 7), one, ragged([7]), idx, torch.tensor([True]))
    parts = [hal.GATED_DELTA_RULE.native(*args(a, e), two, ragged([e - a]), idx, torch.tensor([True]))
             for a, e in ((0, 3), (3, 6), (6, 7))]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-5)
    assert torch.allclose(l2_normalize(torch.tensor([[3.0, 4.0]])), torch.tensor([[0.6, 0.8]]), atol=1e-6)


# ---- Triton kernels ------------------------------------------------------------------------------------------
def _tol(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
def test_conv1d_kernel_matches_native_across_chunks(dtype, width):
    from resin.backends.triton import recurrent

    lengths = [5, 1, 3, 2]
    qsl = ragged(lengths).to(KERNEL_DEVICE)
    x, w, b, state, idx = conv_inputs(lengths, d=70, width=width, dtype=dtype, device=KERNEL_DEVICE)
    ref_state, got_state = state.clone(), state.clone()
    for chunk, bias in ((0, b), (1, None)):  # the second chunk continues from the state the first left
        has = torch.tensor([chunk > 0, False, True, True], device=KERNEL_DEVICE)
        if chunk:
            x = conv_inputs(lengths, d=70, width=width, dtype=dtype, device=KERNEL_DEVICE)[0]
        ref = hal.CAUSAL_CONV1D.native(x, w, bias, ref_state, qsl, idx, has)
        got = recurrent.causal_conv1d(x, w, bias, got_state, qsl, idx, has)
        torch.testing.assert_close(got.float(), ref.float(), **_tol(dtype))
        torch.testing.assert_close(got_state.float(), ref_state.float(), **_tol(dtype))
    step = conv_inputs([1] * 4, d=70, width=width, dtype=dtype, device=KERNEL_DEVICE)[0]
    torch.testing.assert_close(recurrent.causal_conv1d_update(step, w, b, got_state, idx).float(),
                               hal.CAUSAL_CONV1D_UPDATE.native(step, w, b, ref_state, idx).float(), **_tol(dtype))
    torch.testing.assert_close(got_state.float(), ref_state.float(), **_tol(dtype))


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("l2norm", [True, False])
def test_gated_delta_rule_kernel_matches_native_across_chunks(dtype, l2norm):
    from resin.backends.triton import recurrent

    lengths = [4, 1, 3]
    qsl = ragged(lengths).to(KERNEL_DEVICE)
    q, k, v, decay, beta, state, idx = gdn_inputs(lengths, dk=12, dv=40, device=KERNEL_DEVICE)
    ref_state, got_state = state.clone(), state.clone()
    for chunk in range(2):
        if chunk:
            q, k, v, decay, beta = gdn_inputs(lengths, dk=12, dv=40, device=KERNEL_DEVICE)[:5]
        q, k, v = (t.to(dtype) for t in (q, k, v))
        has = torch.tensor([chunk > 0, False, True], device=KERNEL_DEVICE)
        ref = hal.GATED_DELTA_RULE.native(q, k, v, decay, beta, ref_state, qsl, idx, has, use_qk_l2norm=l2norm)
        got = recurrent.gated_delta_rule(q, k, v, decay, beta, got_state, qsl, idx, has, use_qk_l2norm=l2norm)
        torch.testing.assert_close(got.float(), ref.float(), **_tol(dtype))
        torch.testing.assert_close(got_state, ref_state, rtol=1e-4, atol=1e-4)


@pytest.mark.kernels
def test_recurrent_kernels_decline_what_they_cannot_run():
    from resin.backends.triton import recurrent

    x, w, b, state, idx = conv_inputs([2], width=9)
    assert "width 9" in recurrent.conv1d_supports_args(x, w, b, state)
    assert "activation" in recurrent.conv1d_supports_args(x, w[:, :4], b, state[..., :3], activation="gelu")
    q, k, v, decay, beta, state, idx = gdn_inputs([2])
    assert "fp32" in recurrent.gdn_supports_args(q, k, v, decay, beta, state.half())
    assert recurrent.gdn_supports_args(q, k, v, decay, beta, state) is None


# ---- the cpu backend's chunked form ----------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_chunked_delta_rule_matches_the_recurrence_across_chunks_and_steps(chunk):
    """Ragged sequences longer and shorter than a chunk, fresh and continuing states, two successive steps (the
    second continuing what the first left), bf16 inputs too: the chunked form equals the token-by-token native."""
    from resin.backends.cpu.delta_rule import chunked_gated_delta_rule

    lengths = [19, 1, 7, 64]
    qsl = ragged(lengths)
    q, k, v, decay, beta, state, idx = gdn_inputs(lengths, dk=12, dv=20)
    ref_state, got_state = state.clone(), state.clone()
    for step, dtype in ((0, torch.float32), (1, torch.bfloat16)):
        if step:
            q, k, v, decay, beta = gdn_inputs(lengths, dk=12, dv=20)[:5]
        q, k, v = (t.to(dtype) for t in (q, k, v))
        has = torch.tensor([step > 0, False, True, True])
        ref = hal.GATED_DELTA_RULE.native(q, k, v, decay, beta, ref_state, qsl, idx, has)
        got = chunked_gated_delta_rule(q, k, v, decay, beta, got_state, qsl, idx, has, chunk=chunk)
        torch.testing.assert_close(got.float(), ref.float(), **_tol(dtype))
        torch.testing.assert_close(got_state, ref_state, rtol=1e-4, atol=1e-4)


@pytest.mark.unit
def test_chunked_delta_rule_leaves_decode_to_the_recurrent_step():
    sel = hal.select_backend("cpu")
    try:
        assert [p.name for p in sel.table["gated_delta_rule"].chain] == ["chunked", "native"]
        from resin.backends.cpu.delta_rule import supports_args

        q, k, v, decay, beta, state, idx = gdn_inputs([1, 1, 1])
        assert "one token per sequence" in supports_args(q, k, v, decay, beta, state, ragged([1, 1, 1]))
        assert supports_args(q, k, v, decay, beta, state, ragged([2, 1])) is None
    finally:
        from resin.hal.registry import deactivate
        deactivate()
