"""flashinfer's paged prefill wrapper as an attention provider: one `BatchPrefillWithPagedKVCacheWrapper` call
serves a mixed batch (decodes are queries of length 1). Targets flashinfer 0.2.2 … 0.6 (plan's argument order
has been stable since 0.2.2): plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
num_qo_heads, num_kv_heads, head_dim, page_size, causal=True, sm_scale=, window_left=, logits_soft_cap=,
q_data_type=, kv_data_type=) once per step and layer shape; run(q, (k_cache, v_cache)) per layer, NHD layout,
which is the HAL's default cache layout split on its first axis. KV writes use the shared Triton kernel.

Not graph-safe (plan() reads lengths on the host), so it comes after the Triton kernel in the cuda priority list:
it serves what that kernel declines, or everything with `--ops attention=flashinfer`.
UNTESTED ON HARDWARE: no NVIDIA GPU in this project so far; tests/gpu/test_kernels_gpu.py compares whichever
attention provider is selected against native.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from resin.hal.attention import AttentionBackend, AttentionLayer, AttentionMetadata, write_kv

_WORKSPACE_BYTES = 128 << 20


class FlashInferAttention(AttentionBackend):
    @classmethod
    def unsupported_reason(cls, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype,
                           device: torch.device) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16):
            return f"{dtype}: flashinfer runs fp16/bf16 caches"
        if any(layer.head_size not in (64, 128, 256) for layer in layers):
            return "flashinfer's prebuilt kernels cover head sizes 64, 128, 256"
        if any(layer.has_sinks for layer in layers):
            # The fa2/fa3 prefill backends (what the auto backend picks on A100/H100) ignore `sinks`, and before
            # 0.2.10 run(sinks=) is a TypeError: attention with sinks would be silently wrong.
            return "attention sinks: flashinfer's fa2/fa3 prefill backends ignore them"
        return None

    def __init__(self, layers: list[AttentionLayer], block_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layers, block_size, dtype, device)
        flashinfer = importlib.import_module("flashinfer")
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # one wrapper per distinct layer shape (window and soft-cap are planned, not passed per run)
        self._shapes = sorted({self._shape(layer) for layer in layers}, key=str)
        self._wrappers = {shape: flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
                          for shape in self._shapes}
        self._write_kv = kv_writer()

    @staticmethod
    def _shape(layer: AttentionLayer) -> tuple:
        return (layer.num_heads, layer.num_kv_heads, layer.head_size, layer.scale, layer.sliding_window,
                layer.logits_soft_cap)

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        bs = self.block_size
        seq_lens = meta.seq_lens.cpu().long()
        pages = (seq_lens + bs - 1) // bs
        kv_indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
        torch.cumsum(pages, 0, out=kv_indptr[1:])
        used = torch.arange(meta.block_tables.shape[1]).unsqueeze(0) < pages.unsqueeze(1)
        indices = meta.block_tables.cpu()[used].to(self.device, non_blocking=True)
        last = (seq_lens - (pages - 1) * bs).to(torch.int32)
        qo = meta.query_start_loc_host if meta.query_start_loc_host is not None else meta.query_start_loc.cpu()
        for (h, hk, d, scale, window, cap), wrapper in self._wrappers.items():
            wrapper.plan(qo.to(torch.int32), kv_indptr, indices, last, h, hk, d, bs, causal=True, sm_scale=scale,
                         window_left=window - 1 if window else -1, logits_soft_cap=cap or None,
                         q_data_type=self.dtype, kv_data_type=self.dtype)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.layers[layer_idx]
        self._write_kv(kv_cache, k, v, self.meta.slot_mapping)
        t = q.shape[0]
        wrapper = self._wrappers[self._shape(layer)]
        out = wrapper.run(q.reshape(t, layer.num_heads, layer.head_size), (kv_cache[0], kv_cache[1]))
        return out.reshape(t, layer.num_heads * layer.head_size)


def kv_writer() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """The shared Triton KV write where triton is installed, else the native one (chosen once, not per call)."""
    try:
        from resin.backends.triton.kv_cache import write_kv as triton_write_kv
    except ImportError:
        return write_kv
    return triton_write_kv
