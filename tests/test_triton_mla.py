"""The Triton latent-attention (MLA) kernel against NativeMla's absorbed form on ragged batches, in Triton's
interpreter on a machine without a GPU (test_triton_kernels.py's docstring gives the interpreter's limits)."""
from __future__ import annotations

import pytest
import torch

from resin import hal
from resin.backends.triton.tuning import current

from attention_batches import paged_batch
from conftest import KERNEL_DEVICE
from triton_cases import (DOT_DTYPES, REPLAY_SCRATCH_BLOCK, TUNINGS, close, on_kernel_device,  # noqa: F401
                          replayed_batches)

pytestmark = pytest.mark.kernels


MLA_SHAPES = {  # (context after the step, new tokens) per sequence
    "mixed": [(9, 1), (6, 6), (45, 17), (1, 1), (40, 1)],
    "decode": [(5, 1), (70, 1), (33, 1)],
}


@TUNINGS
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("batch", list(MLA_SHAPES))
@pytest.mark.parametrize("heads,latent,rope", [(4, 32, 16), (20, 48, 16)])
def test_paged_mla(tuning, dtype, batch, heads, latent, rope):
    """The latent-attention kernel against NativeMla on ragged batches: the cache write, split-K decode, head
    blocks that do not divide the heads (20 = 16 + 4), and latent / rope widths that are not powers of two."""
    _check_paged_mla(tuning, dtype, batch, heads, latent, rope)


@pytest.mark.parametrize("batch", list(MLA_SHAPES))
def test_paged_mla_at_deepseek_widths(batch):
    """DeepSeek-V3's 512 latent + 64 rope dims, 16 heads (128 over 8 ranks), fp32: slow interpreted, so once."""
    _check_paged_mla(current(), torch.float32, batch, 16, 512, 64)


def _check_paged_mla(tuning, dtype, batch, heads, latent, rope):
    from resin.backends.triton.mla import TritonMla

    layer = hal.mla_layer(heads, latent, rope, 16, 16, (16 + rope) ** -0.5)
    block_size, d = 16, latent + rope
    shapes = MLA_SHAPES[batch]
    num_blocks = sum(-(-ctx // block_size) for ctx, _ in shapes) + 3
    meta, t = paged_batch(shapes, block_size, num_blocks)
    cache = torch.randn(num_blocks, block_size, 1, d).to(dtype)
    q, rows = torch.randn(t, heads * d).to(dtype), torch.randn(t, d).to(dtype)
    native = hal.NativeMla([layer], block_size, dtype, KERNEL_DEVICE)
    native.plan(meta)
    ref_cache = cache.clone()
    ref = native.latent_forward(0, q, rows, ref_cache)
    assert TritonMla.unsupported_reason([layer], block_size, dtype, KERNEL_DEVICE) is None
    mla = TritonMla([layer], block_size, dtype, KERNEL_DEVICE, tuning)
    mla.plan(meta)
    if batch == "decode":
        assert mla.num_splits > 1
    got = mla.latent_forward(0, q, rows, cache)
    assert torch.equal(cache, ref_cache)
    close(got, ref)


def test_paged_mla_replay_reads_new_lengths_without_replanning():
    """The graph contract for latent attention, as for paged attention: planned once for a bucket, the launch
    serves any later batch refilled into the same metadata tensors (padding rows on a scratch block)."""
    from resin.backends.triton.mla import TritonMla

    layer = hal.mla_layer(4, 32, 16, 16, 16, 48 ** -0.5)
    mla = TritonMla([layer], 16, torch.float32, KERNEL_DEVICE)
    for meta, t in replayed_batches(mla):
        cache = torch.randn(REPLAY_SCRATCH_BLOCK + 1, 16, 1, 48)
        q, rows = torch.randn(4, 4 * 48), torch.randn(4, 48)
        native = hal.NativeMla([layer], 16, torch.float32, KERNEL_DEVICE)
        native.plan(meta)
        ref_cache = cache.clone()
        ref = native.latent_forward(0, q[:t], rows[:t], ref_cache)
        close(mla.latent_forward(0, q, rows, cache)[:t], ref)
        assert torch.equal(cache[:REPLAY_SCRATCH_BLOCK], ref_cache[:REPLAY_SCRATCH_BLOCK])
