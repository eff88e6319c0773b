"""What the Triton kernel tests share: the kernels' device as the default device, both vendors' tunings under the
interpreter, the dtypes a kernel's dots are checked in, and the comparison rule (test_triton_kernels.py's docstring
says why bf16 dots are checked on a GPU only)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from resin.backends.cuda.tuning import TUNING as CUDA_TUNING
from resin.backends.rocm.tuning import TUNING as ROCM_TUNING
from resin.backends.triton.tuning import current
from resin.hal.fp8 import FP8_DTYPES

from attention_batches import paged_batch
from conftest import KERNEL_DEVICE
from resin import hal


@pytest.fixture(autouse=True)
def on_kernel_device():
    """Tensors made by the tests (and by native references) live where the kernels run."""
    torch.set_default_device(KERNEL_DEVICE)
    yield
    torch.set_default_device(None)

# Interpreted, both vendors' tunings run (the interpreter ignores warps/stages/waves_per_eu, so this checks their
# block shapes and split counts, not the compiler options); compiled, only this GPU's (NVIDIA rejects waves_per_eu).
TUNINGS = pytest.mark.parametrize(
    "tuning", [CUDA_TUNING, ROCM_TUNING] if KERNEL_DEVICE.type == "cpu" else [current()],
    ids=(["cuda-tuning", "rocm-tuning"] if KERNEL_DEVICE.type == "cpu" else ["this-gpu"]))
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Interpreted, both fp8 flavours; compiled, the GPU's own (Triton on NVIDIA has no e4m3fnuz, gfx942 no e4m3fn MFMA)
if KERNEL_DEVICE.type == "cpu":
    FP8_UNDER_TEST = list(FP8_DTYPES)
else:
    from resin.hal.platform import gpu_platform

    FP8_UNDER_TEST = [d for d in (gpu_platform().fp8_dtype,) if d is not None]
DOT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if KERNEL_DEVICE.type == "cuda" else [])


def close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 to 1e-5; half types to their rounding (the kernels round where the native op does, but a fused
    kernel may differ from the unfused op by an ulp)."""
    torch.testing.assert_close(got.float(), ref.float(), **(
        {"rtol": 1e-5, "atol": 1e-5} if ref.dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}))


REPLAY_SCRATCH_BLOCK = 39  # of 40 blocks of 16: the block padding rows write to


def replayed_batches(backend, bucket: int = 4, block_size: int = 16,
                     max_blocks: int = 12) -> Iterator[tuple[hal.AttentionMetadata, int]]:
    """The graph contract: yields (meta, tokens) for two decode batches (the second with longer contexts and other
    blocks) after loading each into the metadata tensors a captured graph owns. The first allocates them and plans
    the backend for replay, once; the second refills them in place, as DecodeGraphs.run does before a replay, and
    the backend is not planned again. Padding rows point at REPLAY_SCRATCH_BLOCK."""
    backend.capture_state(8)
    scratch, static = REPLAY_SCRATCH_BLOCK, None
    for shapes in ([(5, 1), (20, 1), (33, 1)], [(70, 1), (130, 1), (9, 1)]):
        meta, t = paged_batch(shapes, block_size, scratch)
        pad = bucket - len(shapes)
        tables = torch.full((bucket, max_blocks), scratch, dtype=torch.int32)
        tables[:len(shapes), :meta.block_tables.shape[1]] = meta.block_tables
        values = (torch.cat((meta.seq_lens, torch.ones(pad, dtype=torch.int32))), tables,
                  torch.cat((meta.slot_mapping, torch.full((pad,), scratch * block_size))))
        if static is None:
            static = [x.clone() for x in values]
            backend.plan_for_replay(bucket, hal.AttentionMetadata(
                query_start_loc=torch.arange(bucket + 1, dtype=torch.int32), seq_lens=static[0],
                block_tables=static[1], slot_mapping=static[2], max_query_len=1,
                max_seq_len=max_blocks * block_size))
        else:
            for buf, x in zip(static, values):
                buf.copy_(x)
        yield meta, t
