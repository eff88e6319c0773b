"""all_reduce through torch's symmetric memory (NVIDIA, sm_90+): every rank maps every other rank's buffer and
the reduction runs as one kernel over NVLink (two-shot: each rank reduces a slice, then gathers the slices),
without NCCL's launch and protocol overhead, which dominates at decode sizes (a batch's hidden state is KBs to a
few MB). Larger tensors, other dtypes and single-rank groups go to NCCL (native).

The buffer is bf16 (what GPU models run in), created and peer-mapped (a collective) on the first eager call, never
inside graph capture: until it exists a captured step keeps NCCL. Before mapping, the ranks agree (an all-reduce on
the host group) that all of them share one machine and reach each other's GPUs; if any cannot, all of them keep
NCCL for good, rather than one rank failing in the mapping while the others wait on it. Every rank makes the same
choice for the same call (it depends only on the tensor and the buffer's state), so the ranks never mix
collectives.

UNTESTED ON HARDWARE: this project has had no multi-GPU machine. Selection and the argument checks are tested on
the cpu; tests/gpu/test_collectives_gpu.py runs it against NCCL where two GPUs are present.
"""
from __future__ import annotations

import os

import torch

from resin.hal.distributed import parallel
from resin.hal.platform import Platform

NAME = "symm_mem"
BUFFER_BYTES = 16 << 20  # a 4096-token chunk of a 2048-wide bf16 hidden state; larger goes to NCCL
WORLD_SIZES = (2, 4, 6, 8)  # NVLink domains of one node (vLLM offers the path for the same sizes)
ARCHS = ("sm_90", "sm_100")  # Hopper and Blackwell datacenter parts: NVLink peers, as vLLM gates it


def supported(platform: Platform) -> tuple[bool, str]:
    if platform.kind != "cuda":
        return False, "torch symmetric memory is NVIDIA-only"
    if platform.arch not in ARCHS:
        return False, f"{platform.arch}: the symmetric-memory all-reduce is offered on {', '.join(ARCHS)} (NVLink peers)"
    if not torch.distributed.is_available() or not hasattr(torch.ops.symm_mem, "two_shot_all_reduce_"):
        return False, "this torch build has no symmetric memory (torch.ops.symm_mem)"
    return True, ""


class SymmetricBuffer:
    """A bf16 buffer every rank of the group has mapped; `usable` False where the ranks agreed they cannot."""

    def __init__(self, device: torch.device):
        from torch.distributed import _symmetric_memory as symm

        g = parallel()
        self.group_name, self.buffer = g.device_group.group_name, None
        self.usable = _everyone(_peers_reachable(device), g.cpu_group)
        if not self.usable:
            return
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


def _peers_reachable(device: torch.device) -> bool:
    """Every rank on this machine (LOCAL_WORLD_SIZE, as torchrun sets it, equals the group) and this GPU able to
    reach every other GPU here directly."""
    world = parallel().world
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        return False
    me = device.index if device.index is not None else torch.cuda.current_device()
    return all(torch.cuda.can_device_access_peer(me, other) for other in range(torch.cuda.device_count())
               if other != me)


def _everyone(ok: bool, cpu_group) -> bool:
    flag = torch.tensor([int(ok)])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=cpu_group)
    return bool(flag.item())


def supports_args(x: torch.Tensor) -> str | None:
    g = parallel()
    if g.world not in WORLD_SIZES:
        return f"{g.world} ranks: offered for {', '.join(map(str, WORLD_SIZES))}"
    if not x.is_cuda or x.dtype != torch.bfloat16 or not x.is_contiguous():
        return "contiguous bf16 CUDA tensors only"
    if x.numel() % 8:
        return "a multiple of 8 elements (16-byte rows) only"
    if x.numel() * 2 > BUFFER_BYTES:
        return f"{x.numel() * 2} bytes exceed the {BUFFER_BYTES}-byte symmetric buffer"
    buffer = g.device_resources.get(NAME)
    if buffer is None and torch.cuda.is_current_stream_capturing():
        return "the symmetric buffer is mapped on the first eager call, not inside graph capture"
    if buffer is not None and not buffer.usable:
        return "the ranks do not all reach each other's GPUs on one machine"
    return None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    resources = parallel().device_resources
    if NAME not in resources:
        resources[NAME] = SymmetricBuffer(x.device)
    if not resources[NAME].usable:  # decided together on the first call: every rank reduces through NCCL
        torch.distributed.all_reduce(x, group=parallel().device_group)
        return x
    return resources[NAME].all_reduce(x)
