"""How a model's per-layer KV needs become cache groups that share one pool of pages.

Every attention layer keeps either full KV or the KV of its last W tokens (a sliding window). Layers of one kind
form groups of equal size k; the layers of a group share a block table, so a page (block id) holds one block of
k layers. Memory is k layer tensors of `num_pages` blocks each, and tensor j serves the j-th layer of every group:
a page handed to a sliding-window group is simply not used by the full-attention layers and vice versa. So one
pool of pages, from one byte budget, serves every kind, and a sliding-window group that frees the pages falling out
of its window gives them back to everyone (vLLM's hybrid allocator makes the same trade).

k is the layer count of the rarest kind (Gemma 3's 5:1 pattern over 26 layers: 4 full layers, so groups of 4: one
full group and six sliding groups, the last with 2 layers and 2 idle tensor slots). A model of one kind is one
group of all its layers, exactly the classic layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from resin.hal.attention import AttentionLayer


@dataclass(frozen=True)
class CacheGroup:
    window: int | None  # None: full attention; else the sliding window in tokens
    layers: tuple[int, ...]  # model attention-layer indices; the j-th uses tensor slot j


@dataclass(frozen=True)
class CacheLayout:
    groups: tuple[CacheGroup, ...]
    block_size: int
    slot_bytes: tuple[int, ...]  # bytes of one block in each tensor slot

    @property
    def page_bytes(self) -> int:
        return sum(self.slot_bytes)

    @property
    def num_slots(self) -> int:
        return len(self.slot_bytes)

    def route(self) -> list[tuple[int, int]]:
        """Per attention layer: (group, its index within the group), which is also its tensor slot."""
        out: dict[int, tuple[int, int]] = {}
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                out[layer] = (g, j)
        return [out[i] for i in range(len(out))]

    def window_blocks(self, window: int, chunk: int) -> int:
        """The most blocks a sliding-window group holds for one sequence while `chunk` new tokens are computed:
        the W - 1 keys before the chunk, the chunk, and one block of misalignment at each end."""
        return (window - 1 + chunk - 1) // self.block_size + 2

    def pages_for(self, num_tokens: int, chunk: int) -> int:
        """Pages one sequence of num_tokens needs at most when prefilled in chunks of at most `chunk` tokens."""
        blocks = -(-num_tokens // self.block_size)
        return sum(blocks if g.window is None else min(blocks, self.window_blocks(g.window, chunk))
                   for g in self.groups)

    def capacity_tokens(self, num_pages: int, chunk: int, limit: int) -> int:
        """The longest single sequence (at most `limit`) that num_pages hold."""
        lo, hi = 0, limit
        while lo < hi:  # pages_for is monotone in num_tokens
            mid = (lo + hi + 1) // 2
            if self.pages_for(mid, chunk) <= num_pages:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def describe(self, layers: list[AttentionLayer], dtype: torch.dtype) -> list[str]:
        """One line per layer kind: how many layers, bytes per token, and the bound a window puts on them."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        kinds: dict[int | None, list[int]] = {}
        for group in self.groups:
            kinds.setdefault(group.window, []).extend(group.layers)
        lines = []
        for window, members in kinds.items():
            per_token = sum(layers[i].kv_tensors * layers[i].num_kv_heads * layers[i].head_size * itemsize
                            for i in members)
            kind = "full attention" if window is None else f"sliding window {window}"
            bound = "" if window is None else f", at most {window - 1 + self.block_size} tokens kept per sequence"
            expanded = sum(getattr(layers[i], "expanded_kv_size", 0) for i in members) * itemsize
            if expanded:  # latent attention: say what the latents save over per-head K and V
                kind = "latent attention (MLA)"
                bound = (f", {expanded / per_token:.1f}x the tokens K and V expanded to every head would hold "
                         f"({expanded} bytes/token)")
            lines.append(f"{kind}: {len(members)} layers, {per_token} bytes/token{bound}")
        return lines


def plan_cache_layout(layers: list[AttentionLayer], block_size: int, dtype: torch.dtype) -> CacheLayout:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    kinds: dict[int | None, list[int]] = {}
    for i, layer in enumerate(layers):
        kinds.setdefault(layer.sliding_window, []).append(i)
    if len(kinds) == 1:
        (window, members), = kinds.items()
        groups = (CacheGroup(window, tuple(members)),)
    else:
        k = min(len(members) for members in kinds.values())
        groups = tuple(CacheGroup(window, tuple(members[i:i + k]))
                       for window, members in kinds.items() for i in range(0, len(members), k))
    num_slots = max(len(g.layers) for g in groups)
    slot_shape: list[tuple[int, int, int] | None] = [None] * num_slots
    for group in groups:
        for j, i in enumerate(group.layers):
            shape = (layers[i].kv_tensors, layers[i].num_kv_heads, layers[i].head_size)
            if slot_shape[j] not in (None, shape):
                raise ValueError(f"attention layers of different kinds have different KV shapes ({slot_shape[j]} "
                                 f"and {shape} as (tensors, kv heads, head size)); Resin's shared page pool needs "
                                 f"one shape per tensor slot")
            slot_shape[j] = shape
    slot_bytes = tuple(n * block_size * hk * d * itemsize for n, hk, d in slot_shape)
    return CacheLayout(groups, block_size, slot_bytes)
