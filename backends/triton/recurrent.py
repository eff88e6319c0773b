"""Recurrent-state kernels (see hal/recurrent.py for what they compute): the ragged causal conv1d with carried
state, and the gated delta rule as a recurrence (one program per sequence, value head and block of value dims,
holding its block of the state in registers while it walks the sequence's tokens). The recurrence serves decode
and prefill alike; a chunked form for long prefills is future work."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from resin.backends.triton.tuning import Tuning, current

_BLOCK_D = 64
_BLOCK_V = 32


@triton.jit
def _conv1d_kernel(x_ptr, w_ptr, b_ptr, state_ptr, out_ptr, qsl_ptr, idx_ptr, init_ptr,
                   x_stride, out_stride, state_stride_slot, state_stride_d, d, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
                   SILU: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < d
    start = tl.load(qsl_ptr + seq)
    length = tl.load(qsl_ptr + seq + 1) - start
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    has_init = tl.load(init_ptr + seq + cols * 0) != 0  # a vector: Triton's interpreter takes no scalar in masks
    state_row = state_ptr + slot * state_stride_slot + cols * state_stride_d
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_D], tl.float32)
    for t in range(0, length):
        acc = bias
        for j in tl.static_range(WIDTH):
            pos = cols * 0 + (t - (WIDTH - 1) + j)  # in the sequence; < 0 reads the state (a vector: masks are)
            from_x = tl.load(x_ptr + (start + pos).to(tl.int64) * x_stride + cols, mask=mask & (pos >= 0), other=0.0)
            from_state = tl.load(state_row + (WIDTH - 1 + pos), mask=mask & (pos < 0) & has_init, other=0.0)
            acc += tl.load(w_ptr + cols * WIDTH + j, mask=mask, other=0.0).to(tl.float32) * \
                (from_x.to(tl.float32) + from_state.to(tl.float32))
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (start + t).to(tl.int64) * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
    # The new state: the last WIDTH - 1 inputs. Ascending j reads old state index length + j before any write
    # reaches it (writes go to index j < length + j).
    for j in tl.static_range(WIDTH - 1):
        pos = cols * 0 + (length - (WIDTH - 1) + j)
        from_x = tl.load(x_ptr + (start + pos).to(tl.int64) * x_stride + cols, mask=mask & (pos >= 0), other=0.0)
        from_state = tl.load(state_row + (WIDTH - 1 + pos), mask=mask & (pos < 0) & has_init, other=0.0)
        tl.store(state_row + j, (from_x.to(tl.float32) + from_state.to(tl.float32)).to(state_ptr.dtype.element_ty),
                 mask=mask)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                  activation: str | None = "silu", tuning: Tuning | None = None) -> torch.Tensor:
    tuning = tuning or current()
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    batch, d, width = query_start_loc.shape[0] - 1, x.shape[1], weight.shape[1]
    if batch and x.shape[0]:
        _conv1d_kernel[(batch, triton.cdiv(d, _BLOCK_D))](
            x, weight, bias if bias is not None else weight, conv_state, out, query_start_loc, state_indices,
            has_initial_state.to(torch.int32), x.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1), d,
            WIDTH=width, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_D=_BLOCK_D,
            **tuning.launch(tuning.elementwise_warps))
    return out


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                         state_indices: torch.Tensor, activation: str | None = "silu",
                         tuning: Tuning | None = None) -> torch.Tensor:
    """The decode step: B sequences of one token that all continue from their state."""
    batch = x.shape[0]
    starts = torch.arange(batch + 1, dtype=torch.int32, device=x.device)
    return causal_conv1d(x, weight, bias, conv_state, starts, state_indices,
                         torch.ones(batch, dtype=torch.int32, device=x.device), activation, tuning)


def conv1d_supports_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, *args, activation: str | None = "silu", **kwargs) -> str | None:
    if conv_state.stride(-1) != 1:
        return "the conv state's last dim must be contiguous"
    if activation not in (None, "silu"):
        return f"activation {activation!r} (the kernel has silu or none)"
    if weight.shape[1] > 8:
        return f"convolution width {weight.shape[1]} (the kernel unrolls up to 8)"
    return None


@triton.jit
def _gdn_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, qsl_ptr, idx_ptr, init_ptr,
                q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, g_stride_t,
                beta_stride_t, out_stride_t, out_stride_h, s_stride_slot, s_stride_h, s_stride_k,
                dim_k, dim_v, group, scale, L2NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    kmask, vmask = ks < dim_k, vs < dim_v
    h = hv // group  # the q/k head this value head shares
    start = tl.load(qsl_ptr + seq)
    length = tl.load(qsl_ptr + seq + 1) - start
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    has_init = (tl.load(init_ptr + seq + ks * 0) != 0)[:, None]  # a vector, as in _conv1d_kernel
    s_ptrs = state_ptr + slot * s_stride_slot + hv * s_stride_h + ks[:, None] * s_stride_k + vs[None, :]
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(s_ptrs, mask=smask & has_init, other=0.0).to(tl.float32)
    for i in range(0, length):
        t = (start + i).to(tl.int64)
        q = tl.load(q_ptr + t * q_stride_t + h * q_stride_h + ks, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + ks, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * v_stride_t + hv * v_stride_h + vs, mask=vmask, other=0.0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        decay = tl.exp(tl.load(g_ptr + t * g_stride_t + hv).to(tl.float32))
        beta = tl.load(beta_ptr + t * beta_stride_t + hv).to(tl.float32)
        s = s * decay
        u = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * u[None, :]
        o = tl.sum(s * (q * scale)[:, None], axis=0)
        tl.store(out_ptr + t * out_stride_t + hv * out_stride_h + vs, o.to(out_ptr.dtype.element_ty), mask=vmask)
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=smask)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                     has_initial_state: torch.Tensor, use_qk_l2norm: bool = True, scale: float | None = None,
                     tuning: Tuning | None = None) -> torch.Tensor:
    tuning = tuning or current()
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    g, beta = g.contiguous(), beta.contiguous()
    batch, heads_v, dim_k, dim_v = query_start_loc.shape[0] - 1, v.shape[1], k.shape[2], v.shape[2]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if batch and v.shape[0]:
        _gdn_kernel[(batch, heads_v, triton.cdiv(dim_v, _BLOCK_V))](
            q, k, v, g, beta, state, out, query_start_loc, state_indices, has_initial_state.to(torch.int32),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
            beta.stride(0), out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2),
            dim_k, dim_v, heads_v // q.shape[1], dim_k ** -0.5 if scale is None else scale,
            L2NORM=use_qk_l2norm, BLOCK_K=triton.next_power_of_2(dim_k), BLOCK_V=_BLOCK_V,
            **tuning.launch(tuning.elementwise_warps))
    return out


def gdn_supports_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, *args, **kwargs) -> str | None:
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        return "the state must be contiguous fp32"
    if k.shape[2] > 256:
        return f"key head size {k.shape[2]} (the kernel holds at most 256 in registers)"
    return None
