"""all_reduce through torch's symmetric memory (NVIDIA, sm_90+): every rank maps every other rank's buffer and
the reduction runs as one kernel over NVLink (two-shot: each rank reduces a slice, then gathers the slices),
without NCCL's launch and protocol overhead, which dominates at decode sizes (a batch's hidden state is KBs to a
few MB). Larger tensors, other dtypes and single-rank groups go to NCCL (native).

The buffer is bf16 (what GPU models run in), created and peer-mapped (a collective) on the first eager call, never
inside graph capture: until it exists a captured step keeps NCCL. Every rank makes the same choice for the same
call (the choice depends only on the tensor and the buffer), so the ranks never mix collectives.

UNTESTED ON HARDWARE: this project has had no multi-GPU machine. Selection and the argument checks are tested on
the cpu; tests/gpu/test_collectives_gpu.py runs it against NCCL where two GPUs are present.
"""
from __future__ import annotations

import torch

from resin.hal.distributed import parallel
from resin.hal.platform import Platform

NAME = "symm_mem"
BUFFER_BYTES = 16 << 20  # a 4096-token chunk of an 2048-wide bf16 hidden state; larger goes to NCCL
WORLD_SIZES = (2, 4, 6, 8)  # what torch's two-shot kernel takes


def supported(platform: Platform) -> tuple[bool, str]:
    if platform.kind != "cuda":
        return False, "torch symmetric memory is NVIDIA-only"
    if int(platform.arch.removeprefix("sm_") or 0) < 90:
        return False, f"{platform.arch}: symmetric-memory all-reduce needs sm_90 or newer (NVLink peers)"
    if not torch.distributed.is_available() or not hasattr(torch.ops.symm_mem, "two_shot_all_reduce_"):
        return False, "this torch build has no symmetric memory (torch.ops.symm_mem)"
    return True, ""


class SymmetricBuffer:
    """A bf16 buffer every rank of the group has mapped."""

    def __init__(self, device: torch.device):
        from torch.distributed import _symmetric_memory as symm

        g = parallel()
        self.group_name = g.device_group.group_name
        self.buffer = symm.empty(BUFFER_BYTES // 2, dtype=torch.bfloat16, device=device)
        try:
            symm.rendezvous(self.buffer, g.device_group)
        except RuntimeError as e:
            raise RuntimeError(f"symmetric memory could not map the peers' buffers ({e}); run with "
                               f"--ops all_reduce=native to reduce through NCCL") from e

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        part = self.buffer[:x.numel()]
        part.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(part, "sum", self.group_name)
        x.view(-1).copy_(part)
        return x

    def close(self) -> None:
        self.buffer = None


def supports_args(x: torch.Tensor) -> str | None:
    g = parallel()
    if g.world not in WORLD_SIZES:
        return f"{g.world} ranks: the two-shot kernel takes {', '.join(map(str, WORLD_SIZES))}"
    if not x.is_cuda or x.dtype != torch.bfloat16 or not x.is_contiguous():
        return "contiguous bf16 CUDA tensors only"
    if x.numel() * 2 > BUFFER_BYTES:
        return f"{x.numel() * 2} bytes exceed the {BUFFER_BYTES}-byte symmetric buffer"
    if NAME not in g.device_resources and torch.cuda.is_current_stream_capturing():
        return "the symmetric buffer is mapped on the first eager call, not inside graph capture"
    return None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    resources = parallel().device_resources
    if NAME not in resources:
        resources[NAME] = SymmetricBuffer(x.device)
    return resources[NAME].all_reduce(x)
