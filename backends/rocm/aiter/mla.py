"""aiter's MLA decode: `aiter.mla.mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices,
kv_last_page_lens, max_seqlen_q, sm_scale=...)`, the signature of aiter v0.1.7 through v0.1.20 (the form with
qo_indptr and max_seqlen_q; every argument is passed by keyword, so an older aiter fails by name, not silently).

Its layout rules: a page size of 1, so the paged cache (pages, block size, 1, L + R) is viewed as one token per
page and `kv_indices` lists each sequence's token slots (block * block_size + offset) back to back; every last page
holds one token. Its assembly kernels are built for DeepSeek's 512 latent + 64 rope dims, 16 or 128 query heads
(as vLLM's ROCm MLA backend gates them) and bf16: anything else is declined. Prefill and mixed steps run on the
Triton MLA kernel (DecodeOnlyMla). Not graph-safe (host-built indices, per-call split buffers): captured decode
steps use the Triton kernel.

UNTESTED ON HARDWARE (see backends/rocm/aiter/__init__.py): tests/test_gpu_adapters.py checks the arguments
against a stand-in for the library; tests/gpu/ runs it against native where aiter is installed.
"""
from __future__ import annotations

import torch

from resin.backends.rocm.aiter import aiter_module
from resin.backends.triton.mla_decode_only import DecodeOnlyMla
from resin.hal.attention import AttentionLayer, AttentionMetadata
from resin.hal.mla import MlaLayer

_HEADS = (16, 128)
_LATENT, _ROPE = 512, 64


class AiterMla(DecodeOnlyMla):
    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        reason = super().unsupported_reason(layers, block_size, dtype, device)
        if reason:
            return reason
        if dtype != torch.bfloat16:
            return f"aiter's MLA decode kernels run bf16 caches, not {dtype}"
        for layer in layers:
            assert isinstance(layer, MlaLayer)
            if (layer.latent_size, layer.rope_size) != (_LATENT, _ROPE):
                return (f"latent {layer.latent_size} + rope {layer.rope_size}: aiter's MLA "
                        f"decode takes {_LATENT} + {_ROPE}")
            if layer.num_heads not in _HEADS:
                return f"{layer.num_heads} query heads per rank: aiter's MLA decode takes {_HEADS}"
        return None

    def plan_decode(self, meta: AttentionMetadata) -> None:
        bs, lens = self.block_size, meta.seq_lens.long()
        pos = torch.arange(meta.max_seq_len, device=lens.device)
        slots = meta.block_tables[:, pos // bs].long() * bs + pos % bs  # (B, max_len): every token's slot
        self.kv_indices = slots[pos.unsqueeze(0) < lens.unsqueeze(1)].to(torch.int32)
        self.kv_indptr = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
        self.last_page_lens = torch.ones_like(lens, dtype=torch.int32)
        self.qo_indptr = meta.query_start_loc.to(torch.int32)

    def decode(self, layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        b, h, d = q.shape
        out = torch.empty(b, h, layer.latent_size, dtype=q.dtype, device=q.device)
        aiter_module("aiter.mla").mla_decode_fwd(
            q=q, kv_buffer=kv_cache.view(-1, 1, 1, d), o=out, qo_indptr=self.qo_indptr, kv_indptr=self.kv_indptr,
            kv_indices=self.kv_indices, kv_last_page_lens=self.last_page_lens, max_seqlen_q=1, sm_scale=layer.scale)
        return out.view(b, h * layer.latent_size)
