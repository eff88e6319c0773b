"""FlashMLA (DeepSeek's MLA decode kernels, Hopper): `flash_mla.get_mla_metadata(cache_seqlens,
num_heads_q // num_heads_k, num_heads_k)` then `flash_mla.flash_mla_with_kvcache(q, k_cache, block_table,
cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale=..., causal=True)`, the API of the
`flash_mla` package as first released (February 2025).

Its layout rules: pages of 64 tokens, (pages, 64, 1, 576) (Resin's MLA layout, at block size 64), bf16 or fp16,
512 latent + 64 rope dims, sm_90. Anything else is declined. Prefill and mixed steps run on the Triton MLA kernel
(DecodeOnlyMla); eager only here (captured decode steps use the Triton kernel).

UNTESTED ON HARDWARE: tests/test_gpu_adapters.py checks the arguments against a stand-in for the library.
"""
from __future__ import annotations

import importlib

import torch

from resin.backends.triton.mla_decode_only import DecodeOnlyMla
from resin.hal.attention import AttentionLayer, AttentionMetadata
from resin.hal.mla import MlaLayer
from resin.hal.platform import Platform

PAGE = 64


def supported(platform: Platform) -> tuple[bool, str]:
    if platform.kind != "cuda":
        return False, "FlashMLA runs on NVIDIA GPUs"
    if "flash_mla" not in platform.libraries:
        return False, "flash_mla is not importable (build DeepSeek's FlashMLA)"
    if platform.arch != "sm_90":
        return False, f"{platform.arch}: FlashMLA's kernels are built for sm_90"
    return True, ""


class FlashMla(DecodeOnlyMla):
    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        reason = super().unsupported_reason(layers, block_size, dtype, device)
        if reason:
            return reason
        if block_size != PAGE:
            return f"block size {block_size}: FlashMLA reads pages of {PAGE} tokens (--block-size {PAGE})"
        if dtype not in (torch.bfloat16, torch.float16):
            return f"FlashMLA runs bf16 / fp16 caches, not {dtype}"
        for layer in layers:
            assert isinstance(layer, MlaLayer)
            if (layer.latent_size, layer.rope_size) != (512, 64):
                return f"latent {layer.latent_size} + rope {layer.rope_size}: FlashMLA takes 512 + 64"
        return None

    def plan_decode(self, meta: AttentionMetadata) -> None:
        self.seq_lens = meta.seq_lens.to(torch.int32)
        self.tables = meta.block_tables.to(torch.int32)
        heads = self.layers[0].num_heads
        self.tile_metadata, self.num_splits = importlib.import_module("flash_mla").get_mla_metadata(
            self.seq_lens, heads, 1)

    def decode(self, layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        b, h, _ = q.shape
        out, _ = importlib.import_module("flash_mla").flash_mla_with_kvcache(
            q.unsqueeze(1), kv_cache, self.tables, self.seq_lens, layer.latent_size, self.tile_metadata,
            self.num_splits, softmax_scale=layer.scale, causal=True)
        return out.reshape(b, h * layer.latent_size)
