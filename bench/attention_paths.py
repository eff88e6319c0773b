"""Micro-benchmark behind the cpu attention provider's choices (backends/cpu/attention.py): for decode rows
(one query) and prefill chunks, bf16, SmolLM2-135M's head shape (9 query heads, 3 KV heads, head size 64).

    python bench/attention_paths.py
    python bench/attention_paths.py --prefill     # prefill chunks only: the cpu provider's SDPA vs cpp's kernel

Decode: SDPA with a padding mask vs fp32 SDPA vs two plain matmuls with the GQA heads stacked, in bf16 and with
K/V upcast to fp32 (faster for few sequences). Block gather: advanced indexing vs index_select over whole block
rows. Prefill: one padded, masked SDPA call over all sequences vs one causal SDPA call per sequence.
Paged decode, one layer as the providers run it (KV write included): the plain-torch `cpu` provider (block gather,
then the matmuls) vs the `cpp` provider (Resin's C++ kernel reading blocks in place).
Latent attention (MLA, DeepSeek-V2-Lite's 16 heads x (512 latent + 64 rope)), one layer, bf16: the native reference
(every sequence padded to the longest query and context) vs the `cpu` provider, on decode batches and on a step
that mixes decodes with a prefill chunk.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def bench(fn, n: int = 30) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def decode_paths(b: int, length: int, h: int = 9, hk: int = 3, d: int = 64) -> dict[str, float]:
    q = torch.randn(b, h, 1, d).to(torch.bfloat16)
    k = torch.randn(b, hk, length, d).to(torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.ones(b, 1, 1, length, dtype=torch.bool)

    def matmuls(upcast: bool):
        qg, kk, vv = q.view(b, hk, h // hk, d), k, v
        if upcast:
            qg, kk, vv = qg.float(), kk.float(), vv.float()
        s = torch.matmul(qg, kk.transpose(-1, -2)) * d ** -0.5
        return torch.matmul(torch.softmax(s, -1, dtype=torch.float32).to(vv.dtype), vv)

    return {"sdpa_bf16": bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)),
            "sdpa_fp32": bench(lambda: F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                      attn_mask=mask, enable_gqa=True)),
            "matmuls_bf16": bench(lambda: matmuls(False)), "matmuls_kv_upcast_fp32": bench(lambda: matmuls(True))}


def gather_paths(b: int, blocks_per_seq: int, hk: int = 3, d: int = 64, bs: int = 16) -> dict[str, float]:
    cache = torch.randn(2, hk, 4096, bs, d).to(torch.bfloat16)
    blocks = torch.randperm(4096)[:b * blocks_per_seq]
    flat = cache.view(2 * hk, 4096, bs * d)
    return {"advanced_indexing": bench(lambda: cache[:, :, blocks]),
            "index_select_rows": bench(lambda: torch.index_select(flat, 1, blocks))}


def paged_decode_paths(b: int, length: int, h: int = 9, hk: int = 3, d: int = 64, bs: int = 16) -> dict[str, float]:
    from resin import hal
    from resin.backends.cpu import kernels
    from resin.backends.cpu.attention import CppAttention, CpuAttention
    from resin.hal.platform import cpu_platform

    per_seq = -(-length // bs)
    num_blocks = b * per_seq + 8
    tables = torch.randperm(num_blocks)[:b * per_seq].view(b, per_seq).to(torch.int32)
    seq_lens = torch.full((b,), length, dtype=torch.int32)
    slots = (tables[:, -1].long() * bs + (length - 1) % bs)
    meta = hal.AttentionMetadata(query_start_loc=torch.arange(b + 1, dtype=torch.int32), seq_lens=seq_lens,
                                 block_tables=tables, slot_mapping=slots, max_query_len=1, max_seq_len=length,
                                 query_start_loc_host=torch.arange(b + 1, dtype=torch.int32))
    layer = hal.AttentionLayer(h, hk, d, scale=d ** -0.5)
    cache = torch.randn(2, hk, num_blocks, bs, d).to(torch.bfloat16)
    q, k, v = (torch.randn(b, n * d).to(torch.bfloat16) for n in (h, hk, hk))
    providers = [("cpu_gather_matmuls", CpuAttention)]
    if kernels.supported(cpu_platform())[0]:
        providers.append(("cpp_in_place", CppAttention))
    return time_providers(providers, layer, bs, meta, (q, k, v, cache), 100)


def time_providers(providers: list, layer, bs: int, meta, inputs: tuple, reps: int) -> dict[str, float]:
    """ms per forward of one layer for each (name, attention provider class), planned once on meta."""
    out = {}
    for name, cls in providers:
        backend = cls([layer], bs, torch.bfloat16, torch.device("cpu"))
        backend.plan(meta)
        out[name] = bench(lambda: backend.forward(0, *inputs), reps)
    return out


def prefill_paths(lengths: list[int], h: int = 9, hk: int = 3, d: int = 64) -> dict[str, float]:
    b, m = len(lengths), max(lengths)
    qs = [torch.randn(1, h, n, d).to(torch.bfloat16) for n in lengths]
    ks = [torch.randn(1, hk, n, d).to(torch.bfloat16) for n in lengths]
    qp = torch.zeros(b, h, m, d, dtype=torch.bfloat16)
    kp = torch.zeros(b, hk, m, d, dtype=torch.bfloat16)
    mask = torch.eye(m, dtype=torch.bool).expand(b, 1, m, m).clone()
    for i, n in enumerate(lengths):
        qp[i, :, :n], kp[i, :, :n] = qs[i][0], ks[i][0]
        mask[i, 0, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    return {"padded_masked_sdpa": bench(lambda: F.scaled_dot_product_attention(qp, kp, kp, attn_mask=mask,
                                                                               enable_gqa=True), 5),
            "per_sequence_causal_sdpa": bench(lambda: [F.scaled_dot_product_attention(q, k, k, is_causal=True,
                                                                                      enable_gqa=True)
                                                       for q, k in zip(qs, ks)], 5)}


def paged_prefill_paths(shapes: list[tuple[int, int]], h: int = 9, hk: int = 3, d: int = 64,
                        bs: int = 16) -> dict[str, float]:
    """One layer's prefill chunks as the providers run them (KV write included), bf16: the `cpu` provider (SDPA per
    sequence over gathered K/V; a chunk after a prefix as two flash calls merged) vs the `cpp` provider (the brgemm
    flash kernel reading the paged cache, where torch's ukernels have AMX tiles; otherwise the same SDPA)."""
    from attention_batches import paged_batch
    from resin import hal
    from resin.backends.cpu import kernels
    from resin.backends.cpu.attention import CppAttention, CpuAttention
    from resin.hal.platform import cpu_platform

    num_blocks = sum(-(-c // bs) for c, _ in shapes) + 4
    meta, t = paged_batch(shapes, bs, num_blocks)
    layer = hal.AttentionLayer(h, hk, d, scale=d ** -0.5)
    cache = torch.randn(2, hk, num_blocks, bs, d).to(torch.bfloat16)
    q, k, v = (torch.randn(t, n * d).to(torch.bfloat16) for n in (h, hk, hk))
    providers = [("cpu_sdpa", CpuAttention)]
    if kernels.supported(cpu_platform())[0]:
        providers.append(("cpp_flash" if kernels.brgemm_bf16() else "cpp_sdpa", CppAttention))
    return time_providers(providers, layer, bs, meta, (q, k, v, cache), 5)


def mla_paths(shapes: list[tuple[int, int]], bs: int = 16) -> dict[str, float]:
    """One DeepSeek-V3-shaped MLA layer (16 heads: 128 over 8 ranks): the native reference (absorbed, padded), the
    cpu provider (its per-sequence choice of form), and the cpu provider held to the absorbed form."""
    from attention_batches import paged_batch  # tests/: the random paged batches the provider tests use
    from resin import hal
    from resin.backends.cpu import mla as cpu_mla

    layer = hal.mla_layer(16, 512, 64, 128, 128, 192 ** -0.5)
    num_blocks = sum(-(-c // bs) for c, _ in shapes) + 4
    meta, t = paged_batch(shapes, bs, num_blocks)
    bf16 = torch.bfloat16
    cache = torch.randn(num_blocks, bs, 1, 576).to(bf16)
    q, rows = torch.randn(t, 16 * 192).to(bf16), torch.randn(t, 576).to(bf16)
    kv_b = (torch.randn(16, 256, 512) / 512 ** 0.5).to(bf16)
    out = {}
    chooses = cpu_mla.expanded_prefill_pays
    for name, cls, rule in (("native_padded", hal.NativeMla, chooses), ("cpu_provider", cpu_mla.CpuMla, chooses),
                            ("cpu_absorbed_only", cpu_mla.CpuMla, lambda *_: False)):
        cpu_mla.expanded_prefill_pays = rule
        backend = cls([layer], bs, bf16, torch.device("cpu"))
        backend.plan(meta)
        out[name] = bench(lambda: backend.forward(0, q, rows, kv_b, cache), 10)
    cpu_mla.expanded_prefill_pays = chooses
    return out


def main() -> None:
    torch.manual_seed(0)
    if "--prefill" in sys.argv[1:]:  # prefill chunks only: SDPA against the brgemm kernel, per layer
        for label, shapes in (("32 prompts of 256", [(256, 256)] * 32), ("a prompt of 1024", [(1024, 1024)]),
                              ("a prompt of 4096", [(4096, 4096)]), ("2048 after 2048", [(4096, 2048)]),
                              ("1856 after 6144", [(8000, 1856)])):
            print(f"prefill {label:<18}", {k: f"{v:.2f} ms" for k, v in paged_prefill_paths(shapes).items()})
        return
    for label, shapes in (("decode B=1 L=1000", [(1000, 1)]), ("decode B=16 L=300", [(300, 1)] * 16),
                          ("mixed 15 decodes L=300 + 256-token chunk", [(300, 1)] * 15 + [(512, 256)]),
                          ("fresh prompt of 1024", [(1024, 1024)]), ("64-token chunk after 960", [(1024, 64)])):
        print(f"mla {label}", {k: f"{v:.2f} ms" for k, v in mla_paths(shapes).items()})
    for b, length in ((1, 160), (1, 300), (4, 160), (8, 160), (32, 90), (32, 300)):
        print(f"decode  B={b:<3} L={length:<4}", {k: f"{v:.3f} ms" for k, v in decode_paths(b, length).items()})
    for b, length in ((1, 160), (1, 300), (8, 160), (32, 90), (32, 300)):
        print(f"paged decode B={b:<3} L={length:<4}",
              {k: f"{v:.3f} ms" for k, v in paged_decode_paths(b, length).items()})
    for b in (1, 8, 32):
        print(f"gather  B={b:<3} 12 blocks", {k: f"{v:.3f} ms" for k, v in gather_paths(b, 12).items()})
    rng = random.Random(0)
    lengths = [rng.randint(22, 200) for _ in range(32)]
    print("prefill 32 seqs of 22-200", {k: f"{v:.2f} ms" for k, v in prefill_paths(lengths).items()})


if __name__ == "__main__":
    main()
