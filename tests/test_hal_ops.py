"""Every native HAL op against a direct float64 computation on fresh random inputs."""
from __future__ import annotations

import math

import pytest
import torch

from resin import hal
from resin.hal.rotary import inverse_frequencies

pytestmark = pytest.mark.unit


def f64(x):
    return x.detach().to(torch.float64)


@pytest.mark.parametrize("shape", [(1, 7), (5, 64), (13, 96)])
def test_rms_norm_and_fused_add(shape):
    x, res, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    ref = f64(x) / torch.sqrt(f64(x).pow(2).mean(-1, keepdim=True) + 1e-6) * f64(w)
    assert torch.allclose(f64(hal.RMS_NORM(x, w, 1e-6)), ref, atol=1e-5)
    out, new_res = hal.FUSED_ADD_RMS_NORM(x, res, w, 1e-6)
    s = f64(x) + f64(res)
    assert torch.allclose(f64(new_res), s, atol=1e-6)
    assert torch.allclose(f64(out), s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * f64(w), atol=1e-5)


def _rotate_ref(x, pos, inv_freq, head_size, neox):
    x = f64(x).view(x.shape[0], -1, head_size).clone()
    ang = f64(pos).unsqueeze(-1) * f64(inv_freq)  # (T, rot/2)
    rot = inv_freq.shape[0] * 2
    out = x.clone()
    for i in range(rot // 2):  # explicit pairs: (i, i + rot/2) for neox, (2i, 2i+1) for gpt-j
        a, b = (i, i + rot // 2) if neox else (2 * i, 2 * i + 1)
        c, s = torch.cos(ang[:, i]).unsqueeze(-1), torch.sin(ang[:, i]).unsqueeze(-1)
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out.view(x.shape[0], -1)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim", [(24, 24), (16, 8), (10, 10)])
def test_rotary(neox, head_size, rot_dim):
    t, hq, hk = 9, 3, 1
    q, k = torch.randn(t, hq * head_size), torch.randn(t, hk * head_size)
    pos = torch.randint(0, 100, (t,))
    cache = hal.rope_cos_sin_cache(rot_dim, 128, 10000.0)
    q2, k2 = hal.ROTARY(pos, q.clone(), k.clone(), cache, head_size, neox)  # providers may rotate in place
    inv = inverse_frequencies(rot_dim, 10000.0, None)
    assert torch.allclose(f64(q2), _rotate_ref(q, pos, inv, head_size, neox), atol=1e-5)
    assert torch.allclose(f64(k2), _rotate_ref(k, pos, inv, head_size, neox), atol=1e-5)


def test_llama3_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, rope_scaling=dict(scaling), rope_theta=500000.0)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert torch.allclose(inverse_frequencies(32, 500000.0, scaling), ref, rtol=1e-6)


@pytest.mark.parametrize("scaling", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    {"factor": 4.0, "original_max_position_embeddings": 32},  # truncated ramp, default betas
    {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 64},
    {"factor": None, "original_max_position_embeddings": 256, "attention_factor": 1.3},  # factor from the lengths
])
def test_yarn_table_matches_transformers(scaling):
    """Inverse frequencies and the cos/sin scale (YaRN's attention factor) as transformers computes them."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 150000.0, **scaling}
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=2048,
                      rope_parameters=dict(params))
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    assert torch.allclose(inverse_frequencies(64, 150000.0, params, 2048), ref_inv, rtol=1e-6)
    table = hal.rope_cos_sin_cache(64, 2048, 150000.0, params)
    pos = torch.arange(2048, dtype=torch.float32).unsqueeze(1) * ref_inv
    assert torch.allclose(table, torch.cat((pos.cos(), pos.sin()), -1) * ref_scale, atol=1e-6)
    assert ref_scale != 1.0


@pytest.mark.parametrize("approx", ["none", "tanh"])
def test_activations(approx):
    x = torch.randn(7, 2 * 33)
    g, u = f64(x).chunk(2, -1)
    assert torch.allclose(f64(hal.SILU_AND_MUL(x)), g / (1 + torch.exp(-g)) * u, atol=1e-5)
    if approx == "none":
        ref = 0.5 * g * (1 + torch.erf(g / math.sqrt(2))) * u
    else:
        ref = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * u
    assert torch.allclose(f64(hal.GELU_AND_MUL(x, approx)), ref, atol=1e-5)


def test_linear_and_embedding():
    x, w, b = torch.randn(5, 19), torch.randn(11, 19), torch.randn(11)
    assert torch.allclose(f64(hal.LINEAR(x, w, b)), f64(x) @ f64(w).T + f64(b), atol=1e-5)
    ids = torch.randint(0, 11, (6,))
    assert torch.equal(hal.EMBEDDING(ids, w), w[ids])


def _attention_ref(q, cache, seqs, layer, block_size, sinks=None):
    """Loop over sequences and tokens in float64: the textbook definition."""
    h, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_size
    outs = []
    for blocks, ctx_len, q_len, q_start in seqs:
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(ctx_len)]
        keys = f64(cache[0].reshape(-1, hk, d)[slots])
        vals = f64(cache[1].reshape(-1, hk, d)[slots])
        for i in range(q_len):
            pos = ctx_len - q_len + i
            qi = f64(q[q_start + i].view(h, d))
            row = []
            for head in range(h):
                kvh = head // (h // hk)
                s = keys[:pos + 1, kvh] @ qi[head] * layer.scale
                if layer.logits_soft_cap:
                    s = layer.logits_soft_cap * torch.tanh(s / layer.logits_soft_cap)
                lo = 0 if layer.sliding_window is None else max(0, pos - layer.sliding_window + 1)
                s[:lo] = float("-inf")
                extra = f64(sinks[head]).view(1) if sinks is not None else s.new_empty(0)
                p = torch.softmax(torch.cat([s, extra]), 0)[:pos + 1]
                row.append(p @ vals[:pos + 1, kvh])
            outs.append(torch.cat(row))
    return torch.stack(outs)


@pytest.mark.parametrize("window,cap,with_sinks", [(None, None, False), (5, None, False), (None, 30.0, True)])
@pytest.mark.parametrize("h,hk,d", [(4, 2, 24), (6, 1, 20), (3, 3, 8)])
def test_native_paged_attention_mixed_batch(window, cap, with_sinks, h, hk, d):
    block_size, num_blocks = 4, 40
    layer = hal.AttentionLayer(h, hk, d, scale=d ** -0.5, sliding_window=window, logits_soft_cap=cap,
                               has_sinks=with_sinks)
    cache = torch.randn(2, num_blocks, block_size, hk, d)  # pre-existing context lives in the cache already
    # (context length after step, new tokens): a decode, a fresh prefill, a later prefill chunk, another decode
    shapes = [(9, 1), (6, 6), (23, 7), (1, 1)]
    perm = torch.randperm(num_blocks).tolist()
    seqs, qs = [], 0
    for ctx, qlen in shapes:
        nblk = -(-ctx // block_size)
        seqs.append((perm[:nblk], ctx, qlen, qs))
        perm = perm[nblk:]
        qs += qlen
    t = qs
    q, k, v = torch.randn(t, h * d), torch.randn(t, hk * d), torch.randn(t, hk * d)
    slot_mapping = torch.tensor([blocks[p // block_size] * block_size + p % block_size
                                 for blocks, ctx, qlen, _ in seqs for p in range(ctx - qlen, ctx)])
    max_blocks = max(len(s[0]) for s in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s[0])] = torch.tensor(s[0])
    meta = hal.AttentionMetadata(
        query_start_loc=torch.tensor([0] + [s[3] + s[2] for s in seqs], dtype=torch.int32),
        seq_lens=torch.tensor([s[1] for s in seqs], dtype=torch.int32), block_tables=tables,
        slot_mapping=slot_mapping, max_query_len=max(s[2] for s in seqs), max_seq_len=max(s[1] for s in seqs))
    sinks = torch.randn(h) if with_sinks else None
    backend = hal.NativeAttention([layer], block_size, torch.float32, torch.device("cpu"))
    backend.plan(meta)
    out = backend.forward(0, q, k, v, cache, sinks)
    # the new K/V landed at their slots
    assert torch.equal(cache[0].reshape(-1, hk, d)[slot_mapping], k.view(t, hk, d))
    assert torch.equal(cache[1].reshape(-1, hk, d)[slot_mapping], v.view(t, hk, d))
    ref = _attention_ref(q, cache, seqs, layer, block_size, sinks)
    assert (f64(out) - ref).abs().max().item() < 1e-5


def test_random_sample_native_follows_the_distribution_and_skips_masked_tokens():
    """The sampler's draw: frequencies within 5 standard deviations of softmax(logits), a -inf token never drawn,
    u = 0 the first token of weight and u just below 1 the last."""
    logits = torch.tensor([1.0, 0.0, float("-inf"), 2.0, 0.5, float("-inf")])
    n = 40000
    draws = hal.RANDOM_SAMPLE.native(logits.expand(n, 6).contiguous(), torch.rand(n, dtype=torch.float64))
    freq = torch.bincount(draws, minlength=6).double() / n
    probs = torch.softmax(logits.double(), 0)
    assert ((freq - probs).abs() <= 5 * (probs * (1 - probs) / n).sqrt()).all() and freq[2] == freq[5] == 0
    edges = hal.RANDOM_SAMPLE.native(logits.expand(2, 6).contiguous(),
                                     torch.tensor([0.0, 1.0 - 2.0 ** -53], dtype=torch.float64))
    assert edges.tolist() == [0, 4]
