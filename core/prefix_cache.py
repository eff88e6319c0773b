"""Chained content keys of full KV blocks: a block's key covers its tokens and every token before it.

Keys are SHA-256 digests, not Python's hash(): a key decides whose cached KV a request reuses, so a second token
sequence with a known block's key would let one tenant read another's context. hash() is the same in every process
and cheap to invert block by block; finding a SHA-256 collision is infeasible.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

ROOT_HASH: bytes = hashlib.sha256(b"resin-prefix-root").digest()
_TOKEN = np.dtype("<i8")  # explicit width and byte order: keys are the same on every platform


def block_hashes(token_ids: Sequence[int], block_size: int, parents: list[bytes] | None = None) -> list[bytes]:
    """32-byte keys of the full blocks of token_ids, extending `parents` (the keys already known for the head).

    key = sha256(parent key + the block's token ids as int64 little-endian); the first block's parent is ROOT_HASH.
    Fixed-width ids mean two different blocks never pack to the same bytes.
    """
    hashes = list(parents or [])
    prev = hashes[-1] if hashes else ROOT_HASH
    first = len(hashes) * block_size
    num_new = max(0, (len(token_ids) - first) // block_size)
    if num_new == 0:
        return hashes
    packed = np.asarray(token_ids[first:first + num_new * block_size], dtype=_TOKEN).tobytes()  # one conversion
    step = block_size * _TOKEN.itemsize
    for offset in range(0, len(packed), step):
        prev = hashlib.sha256(prev + packed[offset:offset + step]).digest()
        hashes.append(prev)
    return hashes
