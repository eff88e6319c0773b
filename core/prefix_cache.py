"""Chained content hashes of full KV blocks: a block's hash covers its tokens and every token before it."""
from __future__ import annotations

from typing import Sequence

ROOT_HASH = hash(("resin-prefix-root",))


def block_hashes(token_ids: Sequence[int], block_size: int, parents: list[int] | None = None) -> list[int]:
    """Hashes of the full blocks of token_ids, extending `parents` (the hashes already known for the head)."""
    hashes = list(parents or [])
    prev = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(token_ids[start:start + block_size])))
        hashes.append(prev)
    return hashes
