"""hal/memory.py: long-lived CPU buffers (weights, the KV cache) advised onto 2 MiB huge pages before first touch,
with their values, shapes and weight tying unchanged; plain buffers where the machine has no THP."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resin.hal import memory

pytestmark = pytest.mark.unit


def _mapping(t: torch.Tensor) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds t (VmFlags, AnonHugePages, ...)."""
    address, fields, inside = t.data_ptr(), {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                if inside:
                    return fields
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside:
                fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


def _faults_compact() -> bool:
    """Whether a first touch of advised memory may compact to find a huge page (THP defrag `always`, `madvise` or
    `defer+madvise`); with `never` or `defer` it takes small pages when none is free, so holding one is luck."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/defrag").read_text()
    except OSError:
        return False
    return "[never]" not in mode and "[defer]" not in mode


def _advised(t: torch.Tensor) -> bool:
    """Whether t lies in a private mapping with the hugepage advice (VmFlags `hg`, no `sh`: a shared anonymous
    mapping is shmem, which ignores the advice) that holds huge pages once touched (AnonHugePages), where the
    kernel's defrag setting makes that more than luck."""
    fields = _mapping(t)
    flags = fields.get("VmFlags", "").split()
    huge = int(fields.get("AnonHugePages", "0 kB").split()[0]) > 0
    return "hg" in flags and "sh" not in flags and (huge or not _faults_compact())


def test_cache_buffer_is_zeroed_aligned_and_advised():
    z = memory.zeros_on_huge_pages((3, 1 << 20), torch.float32, torch.device("cpu"))  # 12 MiB
    assert z.shape == (3, 1 << 20) and z.dtype == torch.float32 and not z.any()
    if not memory.huge_pages_available():
        pytest.skip("requires Linux transparent huge pages (always or madvise); this machine has none")
    assert z.data_ptr() % memory.HUGE_PAGE == 0 and _advised(z)
    small = memory.zeros_on_huge_pages((100,), torch.float32, torch.device("cpu"))  # under 2 MiB: plain
    assert not small.any() and small.shape == (100,)


def test_weights_move_with_values_and_tying_kept():
    emb = torch.nn.Embedding(1024, 1024)  # 4 MiB: moves
    head = torch.nn.Linear(1024, 1024, bias=False)
    head.weight = emb.weight  # tied, as a small model's lm_head
    norm = torch.nn.LayerNorm(1024)  # 4 KiB: stays
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "norm": norm})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    norm_ptr = norm.weight.data_ptr()
    moved = memory.move_to_huge_pages(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert head.weight is emb.weight and norm.weight.data_ptr() == norm_ptr
    if not memory.huge_pages_available():
        assert moved == 0
        pytest.skip("requires Linux transparent huge pages (always or madvise); this machine has none")
    assert moved == 1024 * 1024 * 4 and emb.weight.data_ptr() % memory.HUGE_PAGE == 0 and _advised(emb.weight)
