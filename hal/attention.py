"""The attention-backend contract and its native implementation.

Attention backends are stateful: `plan(metadata)` runs once per step and builds whatever the kernels need from the
flat batch (query start offsets, context lengths, block tables, slot mapping); `forward(...)` runs once per layer.
Graph capture is designed in through `capture_state` / `plan_for_replay`. A backend that cannot serve a
configuration says why in `unsupported_reason`, so selection errors explain themselves.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from resin.hal.recurrent import RecurrentMetadata
from resin.hal.registry import Op


@dataclass(frozen=True)
class AttentionLayer:
    """Static facts of one attention layer."""
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None  # a query at position p sees keys p - window < j <= p
    logits_soft_cap: float | None = None  # scores -> cap * tanh(scores / cap)
    has_sinks: bool = False  # a learned per-head logit that joins the softmax denominator

    @property
    def kv_tensors(self) -> int:
        """Cache tensors per layer: keys and values (a latent-attention layer keeps one, hal/mla.py)."""
        return 2

    def random_inputs(self, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fresh (q, k, v) for `tokens` new tokens, shaped as this layer's backend forward takes them (the
        startup self-check feeds them to a provider and to native)."""
        return tuple(torch.randn(tokens, n * self.head_size, generator=gen)
                     for n in (self.num_heads, self.num_kv_heads, self.num_kv_heads))


@dataclass
class AttentionMetadata:
    """One step's flat batch: B sequences, T tokens; sequence b owns tokens query_start_loc[b]:[b+1]."""
    query_start_loc: torch.Tensor  # (B+1,) int32
    seq_lens: torch.Tensor  # (B,) int32: context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # (B, max_blocks) int32
    slot_mapping: torch.Tensor  # (T,) int64: cache slot (block * block_size + offset) of each new token
    max_query_len: int
    max_seq_len: int
    query_start_loc_host: torch.Tensor | None = None  # the same offsets on the CPU, so plans need no device sync

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def step_metadata(block_tables: torch.Tensor, q_lens: list[int], ctx_lens: list[int], block_size: int,
                  device: torch.device | None = None) -> AttentionMetadata:
    """One step's metadata from each sequence's block table row, new tokens and cached context: for batches made
    up outside the scheduler (the startup self-check, the cross-compile gate)."""
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(q_lens, ctx_lens)])
    seq_of = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    tables = block_tables[:, :-(-max(seq_lens) // block_size)].to(torch.int32)
    slots = tables[seq_of, positions // block_size].long() * block_size + positions % block_size
    return AttentionMetadata(qsl.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                             tables.to(device), slots.to(device), max(q_lens), max(seq_lens), qsl)


class AttentionBackend:
    """Base of every attention provider. Each backend owns its KV cache layout (kv_cache_shape); the default is
    (2, num_blocks, block_size, num_kv_heads, head_size)."""

    supports_graphs = False

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def __init__(self, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype, device: torch.device):
        self.layers = layers
        self.block_size = block_size
        self.dtype = dtype
        self.device = device

    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        return None

    def plan(self, meta: AttentionMetadata) -> None:
        raise NotImplementedError

    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages src[i] -> dst[i] of one cache tensor in this backend's layout (a forked sequence's
        partial last block). The default layout keeps pages on axis 1."""
        kv_cache.index_copy_(1, dst, kv_cache.index_select(1, src))

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    # Graph hooks. capture_state(max_batch) allocates what replays need; plan_for_replay(batch_size, meta) plans a
    # decode-only batch padded to batch_size. A backend with supports_graphs=True makes the launch a function of
    # batch_size alone (lengths and tables are read from device memory), so a captured graph stays valid. These
    # defaults (nothing to allocate; plan as usual) are right for eager replay only.
    def capture_state(self, max_batch: int) -> None:
        pass

    def plan_for_replay(self, batch_size: int, meta: AttentionMetadata) -> None:
        self.plan(meta)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values at their slots: the cache is viewed as (num_slots, kv_heads, head_size)."""
    _, nb, bs, hk, d = kv_cache.shape
    kv_cache[0].view(nb * bs, hk, d).index_copy_(0, slot_mapping, k.view(-1, hk, d).to(kv_cache.dtype))
    kv_cache[1].view(nb * bs, hk, d).index_copy_(0, slot_mapping, v.view(-1, hk, d).to(kv_cache.dtype))


class NativeAttention(AttentionBackend):
    """Reference paged attention over a mixed prefill-chunk + decode batch, written as plain tensor math.

    Queries are scattered into a padded (B, max_q) grid, each sequence's keys gathered through its block table
    into (B, max_kv); one masked softmax (valid keys, causality, window) serves every sequence at once.
    """

    def plan(self, meta: AttentionMetadata) -> None:
        qsl = meta.query_start_loc.long()
        q_lens = qsl[1:] - qsl[:-1]
        num_tokens = int(meta.slot_mapping.shape[0])
        seq_of_token = torch.repeat_interleave(torch.arange(meta.num_seqs, device=qsl.device), q_lens,
                                               output_size=num_tokens)
        idx_in_seq = torch.arange(num_tokens, device=qsl.device) - qsl[seq_of_token]
        max_q, max_kv = meta.max_query_len, meta.max_seq_len
        self.slot_mapping = meta.slot_mapping
        self.token_index = seq_of_token * max_q + idx_in_seq  # flat position in the padded query grid
        self.num_seqs, self.max_q, self.max_kv = meta.num_seqs, max_q, max_kv
        nblk = -(-max_kv // self.block_size)
        offsets = torch.arange(self.block_size, device=qsl.device)
        slots = meta.block_tables[:, :nblk].long().unsqueeze(-1) * self.block_size + offsets
        self.kv_slots = slots.flatten(1)[:, :max_kv]  # (B, max_kv)
        seq_lens = meta.seq_lens.long()
        key_pos = torch.arange(max_kv, device=qsl.device)
        q_pos = (seq_lens - q_lens).unsqueeze(1) + torch.arange(max_q, device=qsl.device)  # (B, max_q)
        self.q_pos, self.key_pos = q_pos, key_pos
        self.valid = key_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)  # causal (implies key < seq_len)
        self._windows: dict[int, torch.Tensor] = {}

    def _mask(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.valid
        if window not in self._windows:
            recent = self.key_pos.view(1, 1, -1) > self.q_pos.unsqueeze(-1) - window
            self._windows[window] = self.valid & recent
        return self._windows[window]

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.layers[layer_idx]
        h, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_size
        write_kv(kv_cache, k, v, self.slot_mapping)
        b, mq, mkv = self.num_seqs, self.max_q, self.max_kv
        qpad = q.new_zeros(b * mq, h, d)
        qpad[self.token_index] = q.view(-1, h, d)
        qpad = qpad.view(b, mq, hk, h // hk, d).permute(0, 2, 3, 1, 4).float()  # (B, Hk, G, mq, D)
        _, nb, bs, _, _ = kv_cache.shape
        keys = kv_cache[0].view(nb * bs, hk, d)[self.kv_slots].permute(0, 2, 1, 3).float()  # (B, Hk, mkv, D)
        values = kv_cache[1].view(nb * bs, hk, d)[self.kv_slots].permute(0, 2, 1, 3).float()
        scores = torch.matmul(qpad, keys.unsqueeze(2).transpose(-1, -2)) * layer.scale  # (B, Hk, G, mq, mkv)
        if layer.logits_soft_cap:
            scores = layer.logits_soft_cap * torch.tanh(scores / layer.logits_soft_cap)
        mask = self._mask(layer.sliding_window).view(b, 1, 1, mq, mkv)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(1, hk, h // hk, 1, 1).expand(b, hk, h // hk, mq, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :mkv]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values.unsqueeze(2))  # (B, Hk, G, mq, D)
        out = out.permute(0, 3, 1, 2, 4).reshape(b * mq, h, d)[self.token_index]
        return out.to(q.dtype).reshape(-1, h * d)



ATTENTION = Op("attention", NativeAttention, native_graph_safe=False,  # plans on the host from real lengths
               doc="Paged attention backend factory: ATTENTION(layers, block_size, dtype, device) -> backend.")


@dataclass
class ForwardContext:
    """What a model's attention and recurrent layers need during one forward: the planned attention backends (one
    per KV cache group: the groups have their own block tables), each layer's cache, which backend serves a layer
    under which index, and the recurrent layers' state slots."""
    backends: list[AttentionBackend]
    kv_caches: list[torch.Tensor]  # per attention layer
    route: list[tuple[int, int]] | None = None  # per layer: (backend, layer index there); None: backend 0, same
    states: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # per recurrent layer: (slots, ...) each
    recurrent: RecurrentMetadata | None = None  # this step's slots, set by the runner when there are states

    def attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        group, index = (0, layer_idx) if self.route is None else self.route[layer_idx]
        return self.backends[group].forward(index, q, k, v, self.kv_caches[layer_idx], sinks)
