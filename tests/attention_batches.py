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
