"""all_reduce through aiter's custom all-reduce (MI300X/MI355X over XGMI): peer-mapped IPC buffers and one kernel,
instead of RCCL's launch and protocol overhead at decode sizes. aiter decides per call (`should_custom_ar`: size a
multiple of 16 bytes, under its buffer, a supported world size); what it declines goes to RCCL (native).

The communicator is built (an exchange of IPC handles over the gloo group) on the first eager call, never inside
graph capture: until it exists a captured step keeps RCCL. In a captured step aiter copies the input into its
pre-registered buffer (its unregistered path), which a HIP graph records like any copy and kernel. Every rank
makes the same choice for the same call, so the ranks never mix collectives.

UNTESTED ON HARDWARE (see backends/rocm/aiter/__init__.py): the calls follow aiter's CustomAllreduce, whose module
moved between versions (aiter.dist.custom_all_reduce, then aiter.dist.device_communicators.custom_all_reduce).
"""
from __future__ import annotations

import torch

from resin.backends.rocm.aiter import first_module
from resin.hal.distributed import parallel

NAME = "aiter"
BUFFER_BYTES = 64 << 20


def _communicator():
    resources = parallel().device_resources
    if NAME not in resources:
        module = first_module("aiter.dist.device_communicators.custom_all_reduce", "aiter.dist.custom_all_reduce")
        g = parallel()
        resources[NAME] = module.CustomAllreduce(g.cpu_group, torch.device("cuda", torch.cuda.current_device()),
                                                 max_size=BUFFER_BYTES)
    return resources[NAME]


def supports_args(x: torch.Tensor) -> str | None:
    g = parallel()
    if g.world == 1:
        return "one rank: nothing to reduce"
    if not x.is_cuda or not x.is_contiguous():
        return "contiguous GPU tensors only"
    if NAME not in g.device_resources and torch.cuda.is_current_stream_capturing():
        return "the IPC buffers are exchanged on the first eager call, not inside graph capture"
    ca = _communicator()
    if ca.disabled or not ca.should_custom_ar(x):
        return "aiter's custom all-reduce declines it (size, alignment, world size or ranks on several nodes)"
    return None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _communicator().custom_all_reduce(x)
