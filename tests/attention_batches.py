"""Random paged-attention batches shared by the attention provider tests."""
from __future__ import annotations

import torch

from resin import hal


def paged_batch(shapes: list[tuple[int, int]], block_size: int, num_blocks: int) -> tuple[hal.AttentionMetadata, int]:
    """shapes: (context length after this step, new tokens) per sequence; blocks drawn at random from the pool.
    Returns the metadata and the number of new tokens."""
    perm = torch.randperm(num_blocks).tolist()
    seqs, start = [], 0
    for ctx, qlen in shapes:
        nblk = -(-ctx // block_size)
        seqs.append((perm[:nblk], ctx, qlen, start))
        perm, start = perm[nblk:], start + qlen
    tables = torch.zeros(len(seqs), max(len(s[0]) for s in seqs), dtype=torch.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s[0])] = torch.tensor(s[0])
    slots = torch.tensor([b[p // block_size] * block_size + p % block_size
                          for b, ctx, qlen, _ in seqs for p in range(ctx - qlen, ctx)])
    qsl = torch.tensor([0] + [s[3] + s[2] for s in seqs], dtype=torch.int32)
    meta = hal.AttentionMetadata(
        query_start_loc=qsl, seq_lens=torch.tensor([s[1] for s in seqs], dtype=torch.int32), block_tables=tables,
        slot_mapping=slots, max_query_len=max(s[2] for s in seqs), max_seq_len=max(s[1] for s in seqs),
        query_start_loc_host=qsl)
    return meta, start


def head_major_outputs(backend_cls: type, layer: hal.AttentionLayer, shapes: list[tuple[int, int]],
                       dtype: torch.dtype, block_size: int = 4, num_blocks: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs a cpu attention provider (head-major cache) and native on the same random batch and cache; asserts the
    caches end up equal (the KV write) and returns both outputs (native's first) in fp32."""
    h, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_size
    meta, t = paged_batch(shapes, block_size, num_blocks)
    cache = torch.randn(2, num_blocks, block_size, hk, d).to(dtype)
    # q, k, v as strided views of one projection output, as the models pass them
    q, k, v = torch.randn(t, (h + 2 * hk) * d).to(dtype).split([h * d, hk * d, hk * d], dim=-1)
    native = hal.NativeAttention([layer], block_size, dtype, torch.device("cpu"))
    native.plan(meta)
    ref_cache = cache.clone()
    ref = native.forward(0, q, k, v, ref_cache).float()
    backend = backend_cls([layer], block_size, dtype, torch.device("cpu"))
    backend.plan(meta)
    head_major = cache.permute(0, 3, 1, 2, 4).contiguous()  # its own layout, same contents
    assert head_major.shape == backend.kv_cache_shape(num_blocks, block_size, hk, d)
    got = backend.forward(0, q, k, v, head_major).float()
    assert torch.equal(head_major.permute(0, 2, 3, 1, 4), ref_cache)
    return ref, got


def head_major_vs_native(backend_cls: type, layer: hal.AttentionLayer, shapes: list[tuple[int, int]],
                         dtype: torch.dtype, block_size: int = 4, num_blocks: int = 64) -> float:
    """The largest output difference between a cpu provider and native (head_major_outputs)."""
    ref, got = head_major_outputs(backend_cls, layer, shapes, dtype, block_size, num_blocks)
    return (ref - got).abs().max().item()
