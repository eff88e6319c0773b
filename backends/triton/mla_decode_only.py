"""The base of library MLA kernels that take decode-only batches (aiter's MLA decode, FlashMLA): a step whose
every sequence has one new token goes to the library; any other step (prefill chunks, mixed batches) to the Triton
MLA kernel, which reads the same cache. Importing this module does not import triton: the Triton backend is made on
the first step that needs it (NativeMla where triton is missing, so a library-only machine still runs)."""
from __future__ import annotations

import importlib

import torch

from resin.hal.attention import AttentionLayer, AttentionMetadata
from resin.hal.mla import NativeMla, write_latents


class DecodeOnlyMla(NativeMla):
    def __init__(self, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layers, block_size, dtype, device)
        self._other: NativeMla | None = None
        self.decode_step = False

    @property
    def other(self) -> NativeMla:
        """The backend for steps the library does not take."""
        if self._other is None:
            try:
                cls = importlib.import_module("resin.backends.triton.mla").TritonMla
            except ImportError:
                cls = NativeMla
            self._other = cls(self.layers, self.block_size, self.dtype, self.device)
        return self._other

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.decode_step = meta.max_query_len == 1
        if self.decode_step:
            self.plan_decode(meta)
        else:
            self.other.plan(meta)

    def latent_forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                       kv_cache: torch.Tensor) -> torch.Tensor:
        if not self.decode_step:
            return self.other.latent_forward(layer_idx, q, k, kv_cache)
        write_latents(kv_cache, k, self.meta.slot_mapping)
        layer = self.layers[layer_idx]
        return self.decode(layer, q.view(-1, layer.num_heads, layer.head_size), kv_cache)

    # -- the library's part -----------------------------------------------------------------------------------------
    def plan_decode(self, meta: AttentionMetadata) -> None:
        raise NotImplementedError

    def decode(self, layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """q (B, H, L + R), one token per sequence -> (B, H * L)."""
        raise NotImplementedError
