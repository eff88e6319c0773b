"""Recurrent-state ops: the short causal convolution in front of linear-attention and state-space layers, and the
gated delta rule (Gated DeltaNet, as in Qwen3-Next's linear-attention layers).

Batches are flat and ragged like attention's: sequences back to back, `query_start_loc` (B + 1) marks where each
begins. A sequence's state lives in one slot of a state pool (`state_indices` names it); the op reads the slot at
the start of the sequence's chunk (or zeros, where `has_initial_state` is false: a fresh sequence) and writes it
at the end, in place. So chunked prefill carries the state from chunk to chunk, a decode step is a chunk of one
token, and forking a sequence is a copy of its slot. The native implementations below define correct: they
compute in fp32, one sequence and one token at a time, and every faster provider is tested against them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from resin.hal.registry import Op


@dataclass(frozen=True)
class RecurrentLayer:
    """Static facts of one recurrent layer: the state tensors it keeps per sequence (shapes without the slot
    dimension) and their dtypes (None: the model's dtype)."""
    state_shapes: tuple[tuple[int, ...], ...]
    state_dtypes: tuple[torch.dtype | None, ...]

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros((num_slots, *shape), dtype=d or dtype, device=device)
                     for shape, d in zip(self.state_shapes, self.state_dtypes))

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        return sum(torch.Size(shape).numel() * torch.empty(0, dtype=d or dtype).element_size()
                   for shape, d in zip(self.state_shapes, self.state_dtypes))


@dataclass
class RecurrentMetadata:
    """One step's view of the recurrent state: which slot each sequence of the flat batch owns, where its tokens
    start, whether it continues a state (false: a fresh sequence, or one recomputed after preemption, starts from
    zeros), and whether every sequence has exactly one token (the decode-only batch graphs capture)."""
    query_start_loc: torch.Tensor  # (B + 1,) int32
    state_indices: torch.Tensor  # (B,) int32
    has_initial_state: torch.Tensor  # (B,) bool
    decode_only: bool

_ACTIVATIONS = {None: lambda x: x, "silu": F.silu}


def _causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                   query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                   activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal convolution over each sequence of a flat batch, continuing from its state.

    x (T, D); weight (D, W); bias (D) or None; conv_state (slots, D, W - 1): the last W - 1 inputs each sequence
    has seen, updated in place. out[t, d] = act(bias[d] + sum_j weight[d, j] * x_ext[t + j, d]) where x_ext is the
    sequence's state followed by its tokens. Returns (T, D) in x's dtype."""
    width = weight.shape[1]
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        slot = int(state_indices[i])
        prior = conv_state[slot].float() if bool(has_initial_state[i]) else x.new_zeros(x.shape[1], width - 1).float()
        ext = torch.cat((prior, x[a:b].float().T), dim=1)  # (D, W - 1 + L)
        y = F.conv1d(ext.unsqueeze(0), weight.float().unsqueeze(1), None if bias is None else bias.float(),
                     groups=x.shape[1])[0]  # (D, L)
        out[a:b] = _ACTIVATIONS[activation](y).T.to(x.dtype)
        conv_state[slot] = ext[:, ext.shape[1] - (width - 1):].to(conv_state.dtype)
    return out


def _causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                          state_indices: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """The decode step: one new token per sequence, x (B, D), each continuing from its slot's state (updated in
    place). The same as causal_conv1d over B sequences of one token that all have a state."""
    width = weight.shape[1]
    slots = state_indices.long()
    ext = torch.cat((conv_state[slots].float(), x.float().unsqueeze(-1)), dim=-1)  # (B, D, W)
    y = (ext * weight.float()).sum(-1) + (0 if bias is None else bias.float())
    conv_state[slots] = ext[..., ext.shape[-1] - (width - 1):].to(conv_state.dtype)
    return _ACTIVATIONS[activation](y).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the normalisation Gated DeltaNet applies to q and k)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_qk(q: torch.Tensor, k: torch.Tensor, heads_v: int, use_qk_l2norm: bool,
                  scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the recurrence reads them: fp32, each head repeated over its value heads, l2-normalised if asked,
    q scaled (by K ** -0.5 unless given)."""
    scale = k.shape[2] ** -0.5 if scale is None else scale
    q = q.float().repeat_interleave(heads_v // q.shape[1], dim=1)
    k = k.float().repeat_interleave(heads_v // k.shape[1], dim=1)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * scale, k


def _gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                      has_initial_state: torch.Tensor, use_qk_l2norm: bool = True,
                      scale: float | None = None) -> torch.Tensor:
    """Linear attention with the gated delta rule over each sequence of a flat batch, continuing from its state.

    q, k (T, H, K); v (T, HV, V) with HV a multiple of H (each q/k head serves HV / H consecutive value heads);
    g (T, HV): log of the per-token decay (<= 0); beta (T, HV): the write strength in (0, 1); state
    (slots, HV, K, V), fp32, updated in place. Per sequence and value head, token by token:
        S <- S * exp(g_t);  u = beta_t * (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T (scale * q_t)
    with q and k l2-normalised first when use_qk_l2norm, and scale = K ** -0.5 by default. Returns (T, HV, V) in
    v's dtype."""
    heads_v, dim_k = v.shape[1], k.shape[2]
    q, k = delta_rule_qk(q, k, heads_v, use_qk_l2norm, scale)
    vf, decay, beta = v.float(), g.float().exp(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    starts = query_start_loc.tolist()
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        slot = int(state_indices[i])
        s = state[slot].float() if bool(has_initial_state[i]) else vf.new_zeros(heads_v, dim_k, v.shape[2])
        for t in range(a, b):
            s = s * decay[t, :, None, None]
            u = beta[t, :, None] * (vf[t] - torch.einsum("hkv,hk->hv", s, k[t]))
            s = s + k[t, :, :, None] * u[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, q[t])
        state[slot] = s.to(state.dtype)
    return out.to(v.dtype)


CAUSAL_CONV1D = Op("causal_conv1d", _causal_conv1d, native_graph_safe=False)  # per-sequence host loop
CAUSAL_CONV1D_UPDATE = Op("causal_conv1d_update", _causal_conv1d_update)
GATED_DELTA_RULE = Op("gated_delta_rule", _gated_delta_rule, native_graph_safe=False)
