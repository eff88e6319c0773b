"""aiter's chunked gated delta rule for prefill: forward-only Triton kernels adapted from flash-linear-attention,
`chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
cu_seqlens)` over one packed batch (leading dim 1, T tokens, heads, dim), states (N, H, K, V) in and out, one per
sequence of cu_seqlens. Module `aiter.ops.triton.gated_delta_net` (earlier releases:
`aiter.ops.triton.gated_delta_rule`). Its chunk kernel wants as many q/k heads as value heads, so q and k are
repeated over their value heads here; it takes bf16/fp16 inputs and fp32 states.

Decode (one token per sequence) is left to the Triton recurrent kernel behind it, which graphs can capture: the
chunk kernel plans its chunks from cu_seqlens on the host. UNTESTED ON HARDWARE (see backends/rocm/aiter/).
"""
from __future__ import annotations

import torch

from resin.backends.rocm.aiter import first_module


def supports_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, query_start_loc: torch.Tensor, *args, **kwargs) -> str | None:
    if q.shape[0] == query_start_loc.shape[0] - 1:
        return "one token per sequence: the recurrent step (triton) serves decode"
    if v.dtype not in (torch.float16, torch.bfloat16) or state.dtype != torch.float32:
        return f"{v.dtype} inputs / {state.dtype} state: aiter's chunk kernel takes fp16/bf16 with fp32 states"
    return None


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                     has_initial_state: torch.Tensor, use_qk_l2norm: bool = True,
                     scale: float | None = None) -> torch.Tensor:
    ops = first_module("aiter.ops.triton.gated_delta_net", "aiter.ops.triton.gated_delta_rule")
    repeat = v.shape[1] // q.shape[1]
    q, k = (t.repeat_interleave(repeat, dim=1).to(v.dtype) for t in (q, k))
    slots = state_indices.long()
    initial = torch.where(has_initial_state.view(-1, 1, 1, 1), state[slots], 0.0)  # fresh sequences start at 0
    out, final = ops.chunk_gated_delta_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0), beta.to(v.dtype).unsqueeze(0),
        scale=scale, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=query_start_loc.long())
    state[slots] = final.to(state.dtype)
    return out[0].to(v.dtype)
