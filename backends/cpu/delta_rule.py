"""The gated delta rule in chunked form (the WY / UT-transform form of Gated DeltaNet's prefill): per chunk of C
tokens one triangular solve and a few (C x C) and (C x K) matmuls replace C sequential rank-1 state updates.

Within a chunk starting from state S0, with cumulative log-decay G_t = g_1 + ... + g_t:
    u_t = beta_t (v_t - e^{G_t} S0^T k_t - sum_{i<t} e^{G_t - G_i} (k_t . k_i) u_i)
i.e. (I + A) U = diag(beta) (V - diag(e^G) K S0) with A strictly lower triangular; then
    o_t = e^{G_t} S0^T q_t + sum_{i<=t} e^{G_t - G_i} (q_t . k_i) u_i,    S_C = e^{G_C} S0 + (e^{G_C - G} * K)^T U.
All in fp32, as the native recurrence. Decode batches (one token per sequence) are left to the recurrent step.
"""
from __future__ import annotations

import torch

from resin.hal.recurrent import delta_rule_qk

CHUNK = 64


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk for every head at once: q, k (H, C, K); v (H, C, V); g, beta (H, C); s0 (H, K, V)."""
    c = q.shape[1]
    cum = g.cumsum(-1)  # (H, C)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf"))  # G_t - G_i for i <= t
    decay = diff.exp()  # (H, C, C), zero above the diagonal
    a = (beta.unsqueeze(-1) * decay * (k @ k.transpose(-1, -2))).tril(-1)
    rhs = beta.unsqueeze(-1) * (v - cum.exp().unsqueeze(-1) * (k @ s0))
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)  # (H, C, V)
    out = cum.exp().unsqueeze(-1) * (q @ s0) + (decay * (q @ k.transpose(-1, -2))) @ u
    tail = (cum[:, -1:] - cum).exp().unsqueeze(-1)  # e^{G_C - G_i}
    state = cum[:, -1].exp()[:, None, None] * s0 + (tail * k).transpose(-1, -2) @ u
    return out, state


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                             state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                             use_qk_l2norm: bool = True, scale: float | None = None,
                             chunk: int = CHUNK) -> torch.Tensor:
    """GATED_DELTA_RULE's contract (hal/recurrent.py), computed chunk by chunk."""
    heads_v, dim_k = v.shape[1], k.shape[2]
    q, k = delta_rule_qk(q, k, heads_v, use_qk_l2norm, scale)
    # every tensor head-major: (HV, T, ...)
    q, k, vf, g, beta = q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1), g.float().T, beta.float().T
    out = torch.empty(heads_v, v.shape[0], v.shape[2], dtype=torch.float32, device=v.device)
    starts = query_start_loc.tolist()
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        slot = int(state_indices[i])
        s = state[slot].float() if bool(has_initial_state[i]) else vf.new_zeros(heads_v, dim_k, v.shape[2])
        for c0 in range(a, b, chunk):
            c1 = min(c0 + chunk, b)
            out[:, c0:c1], s = _chunk(q[:, c0:c1], k[:, c0:c1], vf[:, c0:c1], g[:, c0:c1], beta[:, c0:c1], s)
        state[slot] = s.to(state.dtype)
    return out.transpose(0, 1).to(v.dtype)


def supports_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, query_start_loc: torch.Tensor, *args, **kwargs) -> str | None:
    if q.shape[0] == query_start_loc.shape[0] - 1:
        return "one token per sequence: the recurrent step is the cheaper form"
    return None
