"""Long-lived host buffers (weights, the KV cache) on 2 MiB transparent huge pages.

A CPU decode step streams every weight and, at long contexts, every cached key and value once. On 4 KiB pages
each block of the paged KV cache (4 KiB at 16 tokens x 64 x fp32) is a page of its own, lying anywhere, and a
weight matrix spans hundreds of pages: a TLB miss per page that the prefetchers cannot run past. Measured, the
gain is small: on a 2-core Zen 4 VM an 8k-token fp32 decode step of the built-in model read 37.2-38.0 ms with huge
pages and 34.7-42.7 ms without (two runs each, interleaved), within that machine's noise. (An earlier "40-43 ->
38-40 ms" on a Zen 3 was noise too: the buffers were then shared anonymous mappings, which Linux backs with shmem,
and those never got huge pages.)

Linux's THP must be `always` or `madvise` (the usual default); with `never`, or off Linux, buffers are plain. Only
whole 2 MiB stretches are advised, so a buffer's ragged tail stays on small pages and costs no extra memory.
GPU tensors are left alone (the driver chooses their pages), and so are copies a provider makes at its first call
(bf16 weights oneDNN reorders into its own layout).
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.lru_cache(maxsize=1)
def huge_pages_available() -> bool:
    """Whether madvise(MADV_HUGEPAGE) gets huge pages here: Linux with THP `always` or `madvise`."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return "[never]" not in _THP.read_text()
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _advise(address: int, length: int) -> None:
    """Advice only: where the kernel declines it, the buffer simply stays on small pages."""
    _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE)


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose whole 2 MiB stretches are advised to be huge pages before anything
    touches them (a plain CPU torch.empty where huge pages are unavailable or the buffer is under 2 MiB)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < HUGE_PAGE or not huge_pages_available():
        return torch.empty(shape, dtype=dtype, device="cpu")
    # A fresh anonymous mapping, never touched: malloc may hand back heap memory already on small pages (glibc
    # serves blocks up to 32 MiB from its heap once such blocks were freed), where the advice would only wait for
    # khugepaged. Private: Python's default for mmap(-1) is a shared mapping, which Linux backs with shmem, whose
    # huge pages follow shmem_enabled (`never` by default) and ignore the advice; such a buffer stayed on 4 KiB
    # pages. The tensor holds the mapping (frombuffer keeps its buffer alive).
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -base.data_ptr() % HUGE_PAGE
    region = base[offset:offset + nbytes]
    _advise(region.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE)
    return region.view(dtype).view(shape)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on the CPU on huge pages (the KV cache). Zeroing also faults every page in now, not during the
    first steps that write the cache."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return empty_on_huge_pages(shape, dtype).zero_()


def move_to_huge_pages(model: torch.nn.Module) -> int:
    """Copy the model's CPU parameters and buffers of 2 MiB or more onto huge pages, in place of the originals
    (tied weights stay tied: parameters() and buffers() name each tensor once). Returns the bytes moved."""
    if not huge_pages_available():
        return 0
    moved = 0
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type != "cpu" or t.numel() * t.element_size() < HUGE_PAGE or not t.is_contiguous():
            continue
        t.data = empty_on_huge_pages(tuple(t.shape), t.dtype).copy_(t.detach())  # every holder sees the move
        moved += t.numel() * t.element_size()
    return moved
