"""The GPU adapters' own decisions, on the cpu with the platform (and, where needed, the library) faked: which
calls each declines, what it passes, what it marks, which errors it survives. The library calls themselves are
untested on hardware here (no GPU in this project so far)."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from resin import hal
from resin.backends.cuda import flash_attn_attention, scaled_mm
from resin.backends.cuda.flashinfer_attention import FlashInferAttention
from resin.backends.rocm.aiter import moe as aiter_moe

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def test_rocm_with_aiter_captures_decode_graphs_with_the_triton_attention():
    sel = hal.describe_backend("rocm", arch="gfx942", libraries=frozenset({"aiter", "triton"}))
    attention = sel.table["attention"]
    assert attention.chosen == "aiter" and attention.chosen_in_graphs == "triton"
    assert "decode graphs use triton (aiter is not graph-safe)" in sel.format_table()
    assert all(c.chosen_in_graphs is not None for c in sel.table.values())  # every op can be captured
    cpu = hal.describe_backend("cpu")  # no graphs on the cpu: nothing to say about them
    assert "decode graphs" not in cpu.format_table()


def test_an_op_without_a_graph_safe_provider_is_named():
    sel = hal.describe_backend("cuda", arch="sm_90", libraries=frozenset({"flashinfer"}))
    assert sel.table["attention"].chosen == "flashinfer" and sel.table["attention"].chosen_in_graphs is None
    assert "no graph-safe provider: decode steps run eagerly" in sel.format_table()


def test_flashinfer_declines_sinks():
    sink = hal.AttentionLayer(64, 8, 64, 0.125, sliding_window=128, has_sinks=True)
    assert "sinks" in FlashInferAttention.unsupported_reason([sink], 16, torch.bfloat16, CPU)


@pytest.fixture
def fake_flash_attn(monkeypatch):
    calls = []

    def varlen(q, k_cache, v_cache, *args, **kwargs):
        calls.append(kwargs)
        return torch.zeros_like(q)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=varlen))
    return calls


@pytest.mark.parametrize("version,declines", [((2, 5), True), ((2, 6), False), ((0,), True)])
def test_flash_attn_soft_cap_needs_2_6(monkeypatch, version, declines):
    monkeypatch.setattr(flash_attn_attention, "_version", lambda: version)
    capped = hal.AttentionLayer(8, 8, 64, 0.125, logits_soft_cap=30.0)
    plain = hal.AttentionLayer(8, 8, 64, 0.125)
    reason = flash_attn_attention.FlashAttnAttention.unsupported_reason([capped], 256, torch.bfloat16, CPU)
    assert (reason is not None and "2.6" in reason) == declines
    assert flash_attn_attention.FlashAttnAttention.unsupported_reason([plain], 256, torch.bfloat16, CPU) is None


def test_flash_attn_passes_softcap_only_to_capped_layers(fake_flash_attn, monkeypatch):
    monkeypatch.setattr(flash_attn_attention, "kv_writer", lambda: lambda *a: None)
    layers = [hal.AttentionLayer(2, 1, 16, 0.25), hal.AttentionLayer(2, 1, 16, 0.25, logits_soft_cap=30.0)]
    attn = flash_attn_attention.FlashAttnAttention(layers, 256, torch.float32, CPU)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    attn.plan(hal.AttentionMetadata(qsl, torch.tensor([3], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                                    torch.arange(3), 3, 3, qsl))
    cache = torch.zeros(2, 1, 256, 1, 16)
    for i in range(2):
        attn.forward(i, torch.zeros(3, 32), torch.zeros(3, 16), torch.zeros(3, 16), cache)
    assert "softcap" not in fake_flash_attn[0] and fake_flash_attn[1]["softcap"] == 30.0


def test_aiter_grouped_routing_declines_what_its_kernels_cannot_take(monkeypatch):
    monkeypatch.setattr(aiter_moe, "_cu_count", lambda index: 2)  # a 2-CU device: the limit is 424 tokens
    logits, bias = torch.zeros(8, 96), torch.zeros(96)
    assert aiter_moe.route_supports_args(logits, 8, "sigmoid", True, 8, 4, bias) is None
    assert "expert groups" in aiter_moe.route_supports_args(logits, 8, "sigmoid", True, 3, 1, bias)
    assert "expert groups" in aiter_moe.route_supports_args(logits, 8, "softmax", True, 12, 4)
    many = torch.zeros(425, 96)
    assert "need_renorm" in aiter_moe.route_supports_args(many, 8, "sigmoid", False, 8, 4, bias)
    assert aiter_moe.route_supports_args(many, 8, "sigmoid", True, 8, 4, bias) is None  # renormalised: fine
    assert aiter_moe.route_supports_args(torch.zeros(424, 96), 8, "sigmoid", False, 8, 4, bias) is None


def test_aiter_experts_are_shuffled_once_and_marked_as_aiter_reads(monkeypatch):
    shuffles = []

    def shuffle_weight(w, layout):
        shuffles.append(layout)
        return w.flip(-1).contiguous()
    monkeypatch.setattr(aiter_moe, "aiter_module",
                        lambda name="aiter": types.SimpleNamespace(shuffle_weight=shuffle_weight))
    w = torch.nn.Parameter(torch.arange(64, dtype=torch.bfloat16).view(1, 4, 16), requires_grad=False)
    before = w.detach().clone()
    assert aiter_moe._shuffled(w) is w and w.is_shuffled is True
    aiter_moe._shuffled(w)
    assert shuffles == [(16, 16)] and torch.equal(w.detach(), before.flip(-1))
    assert aiter_moe.fused_moe_supports_args(torch.zeros(1, 16, dtype=torch.float32), w, w, None, None) is None


def test_aiter_fp8_gemm_needs_triton_for_its_activation_quantiser():
    sel = hal.describe_backend("rocm", arch="gfx942", libraries=frozenset({"aiter"}))
    assert "triton is not importable" in dict(sel.table["fp8_linear"].skipped)["aiter"]
    with_triton = hal.describe_backend("rocm", arch="gfx942", libraries=frozenset({"aiter", "triton"}))
    assert with_triton.table["fp8_linear"].chosen == "aiter"


@pytest.mark.parametrize("error,refusal", [
    (RuntimeError("Invalid scaling configuration. For tensorwise scaling, both scales should be scalar."), True),
    (RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
])
def test_scaled_mm_falls_back_only_on_layout_refusals(error, refusal):
    assert scaled_mm.is_layout_refusal(error) == refusal


@pytest.mark.parametrize("refused", [True, False])
def test_scaled_mm_marks_a_weight_only_when_refused(monkeypatch, refused):
    """Refused: the Triton GEMM serves this weight from then on. Out of memory: the error propagates and the weight
    keeps its provider (it is not routed elsewhere forever by a transient failure)."""
    def scaled(*args, **kwargs):
        raise RuntimeError("Invalid scaling configuration") if refused else torch.OutOfMemoryError("out of memory")
    monkeypatch.setattr(torch, "_scaled_mm", scaled)
    x, w = torch.randn(3, 32), torch.randn(16, 32)
    scale = (w.abs().amax(1) / 448.0)
    wq = (w / scale[:, None]).to(torch.float8_e4m3fn)
    if refused:
        out = scaled_mm.fp8_linear(x, wq, scale)
        assert getattr(wq, scaled_mm._REFUSED) is True
        torch.testing.assert_close(out, hal.FP8_LINEAR.native(x, wq, scale), rtol=2e-2, atol=2e-2)
    else:
        with pytest.raises(torch.OutOfMemoryError):
            scaled_mm.fp8_linear(x, wq, scale)
        assert not getattr(wq, scaled_mm._REFUSED, False)


def _fla_chunk_reference(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """flash-linear-attention's chunk_gated_delta_rule contract (as aiter ships it), computed with transformers'
    torch reference per sequence of cu_seqlens: (1, T, H, K) inputs, (N, H, K, V) states."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    assert q.shape[0] == 1 and q.shape[2] == v.shape[2] and scale is None  # equal heads, default scale
    assert initial_state.dtype == torch.float32 and output_final_state
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        o, s = torch_chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                            chunk_size=4, initial_state=initial_state[i:i + 1],
                                            output_final_state=True,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs.append(o)
        finals.append(s)
    return torch.cat(outs, 1), torch.cat(finals)


def test_aiter_delta_rule_adapter_maps_slots_heads_and_states(monkeypatch):
    """The adapter against a stand-in for aiter's module that keeps its contract: slots gathered and scattered,
    fresh sequences from zeros, q/k heads repeated over value heads; equal to the native op (in fp16 inputs)."""
    from resin.backends.rocm.aiter import delta_rule

    module = types.SimpleNamespace(chunk_gated_delta_rule=_fla_chunk_reference)
    monkeypatch.setitem(sys.modules, "aiter.ops.triton.gated_delta_net", module)
    lengths, h, hv, dk, dv = [6, 3, 9], 2, 4, 8, 8
    t = sum(lengths)
    q, k = torch.randn(t, h, dk).half(), torch.randn(t, h, dk).half()
    v = torch.randn(t, hv, dv).half()
    g, beta = -torch.nn.functional.softplus(torch.randn(t, hv)), torch.rand(t, hv).half().float()  # as models give it
    state = torch.randn(5, hv, dk, dv)
    qsl = torch.tensor([0, 6, 9, 18], dtype=torch.int32)
    idx, has = torch.tensor([3, 0, 4], dtype=torch.int32), torch.tensor([True, False, True])
    assert delta_rule.supports_args(q, k, v, g, beta, state, qsl) is None
    assert "one token" in delta_rule.supports_args(q[:3], k[:3], v[:3], g[:3], beta[:3], state, torch.arange(4))
    assert "fp16/bf16" in delta_rule.supports_args(q, k, v.float(), g, beta, state, qsl)
    ref_state, got_state = state.clone(), state.clone()
    ref = hal.GATED_DELTA_RULE.native(q, k, v, g, beta, ref_state, qsl, idx, has)
    got = delta_rule.gated_delta_rule(q, k, v, g, beta, got_state, qsl, idx, has)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-3, atol=2e-3)  # fp16 outputs
    torch.testing.assert_close(got_state, ref_state, rtol=1e-4, atol=1e-4)
    sel = hal.describe_backend("rocm", arch="gfx942", libraries=frozenset({"aiter", "triton"}))
    choice = sel.table["gated_delta_rule"]
    assert choice.chosen == "aiter" and choice.chosen_in_graphs == "triton"


def _latent_attention(q: torch.Tensor, rows: torch.Tensor, scale: float, latent: int) -> torch.Tensor:
    """One query token (H, D) against one sequence's cached rows (L, D): the MLA contract the libraries document."""
    probs = torch.softmax(q.float() @ rows.float().T * scale, dim=-1)
    return (probs @ rows[:, :latent].float()).to(q.dtype)


def _fake_aiter_mla(calls: list):
    def mla_decode_fwd(*, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       sm_scale):
        assert kv_buffer.shape[1:3] == (1, 1) and max_seqlen_q == 1 and (kv_last_page_lens == 1).all()
        calls.append(kv_indices.clone())
        rows = kv_buffer.view(-1, kv_buffer.shape[-1])
        for b in range(qo_indptr.shape[0] - 1):
            tokens = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
            o[qo_indptr[b]] = _latent_attention(q[qo_indptr[b]], rows[tokens], sm_scale, o.shape[-1])
    return types.SimpleNamespace(mla_decode_fwd=mla_decode_fwd)


def _fake_flash_mla(calls: list):
    def get_mla_metadata(seq_lens, heads_per_kv_head, kv_heads):
        assert seq_lens.dtype == torch.int32 and kv_heads == 1
        return torch.zeros(1), torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32)

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_metadata, num_splits,
                               softmax_scale, causal):
        assert k_cache.shape[1] == 64 and q.shape[1] == 1 and causal
        calls.append(block_table.clone())
        out = q.new_empty(q.shape[0], 1, q.shape[2], head_dim_v)
        for b in range(q.shape[0]):
            rows = k_cache[block_table[b].long()].reshape(-1, k_cache.shape[-1])[:cache_seqlens[b]]
            out[b, 0] = _latent_attention(q[b, 0], rows, softmax_scale, head_dim_v)
        return out, None
    return types.SimpleNamespace(get_mla_metadata=get_mla_metadata, flash_mla_with_kvcache=flash_mla_with_kvcache)


@pytest.mark.parametrize("library", ["aiter", "flashmla"])
def test_mla_library_adapters_pass_each_sequences_rows(monkeypatch, library):
    """aiter (page size 1: token slots listed per sequence) and FlashMLA (64-token pages through the block table),
    each faked by its documented contract, must give native's output on a decode step from a paged cache with
    scattered pages; a mixed step goes to the Triton kernel (interpreted here) and matches native too. What they
    decline is named."""
    from attention_batches import paged_batch
    from conftest import KERNEL_DEVICE
    from resin.backends.cuda import flashmla
    from resin.backends.rocm.aiter import mla as aiter_mla
    from resin.backends.triton.mla import TritonMla

    calls: list = []
    if library == "aiter":
        monkeypatch.setattr(aiter_mla, "aiter_module", lambda name: _fake_aiter_mla(calls))
        cls, block_size = aiter_mla.AiterMla, 16
        layer = hal.mla_layer(16, 512, 64, 128, 128, 192 ** -0.5)
        assert cls.unsupported_reason([layer], block_size, torch.bfloat16, CPU) is None
        assert "bf16" in cls.unsupported_reason([layer], block_size, torch.float16, CPU)
        assert "query heads" in cls.unsupported_reason([hal.mla_layer(8, 512, 64, 128, 128, 1.0)], 16,
                                                       torch.bfloat16, CPU)
    else:
        monkeypatch.setitem(sys.modules, "flash_mla", _fake_flash_mla(calls))
        cls, block_size = flashmla.FlashMla, 64
        layer = hal.mla_layer(16, 512, 64, 128, 128, 192 ** -0.5)
        assert cls.unsupported_reason([layer], 64, torch.bfloat16, CPU) is None
        assert "--block-size 64" in cls.unsupported_reason([layer], 16, torch.bfloat16, CPU)
    assert "512 + 64" in cls.unsupported_reason([hal.mla_layer(16, 256, 64, 128, 128, 1.0)], block_size,
                                                torch.bfloat16, CPU)
    # fp32 here (the interpreter's bf16 dots are wrong); the adapters' own decisions do not depend on it
    for shapes, via_library in (([(70, 1), (5, 1), (130, 1)], True), ([(9, 1), (40, 6)], False)):
        meta, t = paged_batch(shapes, block_size, 24)
        cache = torch.randn(24, block_size, 1, 576)
        q, rows = torch.randn(t, 16 * 576), torch.randn(t, 576)
        native = hal.NativeMla([layer], block_size, torch.float32, CPU)
        native.plan(meta)
        ref_cache = cache.clone()
        ref = native.latent_forward(0, q, rows, ref_cache)
        backend = cls([layer], block_size, torch.float32, CPU)
        if KERNEL_DEVICE.type != "cpu":  # compiled Triton cannot take these cpu tensors: native stands in for it
            backend._other = hal.NativeMla([layer], block_size, torch.float32, CPU)
        backend.plan(meta)
        got = backend.latent_forward(0, q, rows, cache)
        assert torch.equal(cache, ref_cache)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert (len(calls) == 1) == via_library
        if KERNEL_DEVICE.type == "cpu":  # the mixed step went to the (interpreted) Triton kernel
            assert isinstance(backend._other, TritonMla) != via_library
        calls.clear()
