"""all_reduce and all_gather for CPU ranks on one machine, through a shared-memory segment instead of gloo.

gloo moves even a 576-float all-reduce over loopback TCP, ~1.4 ms on a 2-core machine: with two all-reduces a
layer that is most of a tensor-parallel decode step. Here every rank writes its tensor into its own slot of a
segment in /dev/shm, raises its sequence number, waits until every rank has raised it, then reads all slots (sum
for all_reduce, concatenation for all_gather) in rank order, so every rank computes bit-identical results.

Two slot sets alternate by sequence parity: a rank that writes set s % 2 knows every other rank has finished
reading it at s - 2, because each raised its number for s - 1 only after that read. Ordering relies on x86's
store and load ordering (a slot's bytes are stored before the number that publishes them; read after it), so
the provider is offered on x86-64 only. A tensor larger than a slot goes to gloo (large prefill chunks, where
latency does not matter). A waiting rank checks that its peers still live, so a dead one raises instead of
spinning forever; past 5 ms it sleeps 1 ms between looks, so ranks waiting for an idle server's next step
cost next to nothing. The step channel (core/step_channel.py) broadcasts through the same segment.
"""
from __future__ import annotations

import mmap
import os
import platform
import time
import uuid

import torch

from resin.hal.distributed import ParallelGroup, parallel
from resin.hal.platform import Platform

_LINE = 8  # int64 words per rank in the header (a cache line each: no false sharing between ranks)
SLOT_BYTES = 4 << 20  # per rank per set: a 2048-token chunk of a 576-wide bf16 hidden state fits (2.4 MB)
_TIMEOUT = float(os.environ.get("RESIN_DIST_TIMEOUT", "300"))
_NOTHING = torch.zeros(0, dtype=torch.uint8)


class ShmExchange:
    def __init__(self, path: str, rank: int, world: int, slot_bytes: int = SLOT_BYTES, create: bool = False):
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        header = 2 * world * _LINE * 8  # sequence numbers, then process ids
        size = header + 2 * world * slot_bytes
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        raw = torch.frombuffer(self._mm, dtype=torch.uint8)
        words = raw[:header].view(torch.int64)
        self._seqs = words[:world * _LINE:_LINE]
        self._pids = words[world * _LINE::_LINE]
        self._slots = raw[header:].view(2, world, slot_bytes)
        self._pids[rank] = os.getpid()
        self._seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes

    def _exchange(self, x: torch.Tensor, nbytes: int | None = None, idle: bool = False) -> torch.Tensor:
        """Publish x, wait for every rank's, return the (world, nbytes) slots that hold them (nbytes: x's size
        unless given). idle: this wait may last as long as the server is idle (no time limit)."""
        self._seq += 1
        seq, data = self._seq, x.detach().contiguous().view(-1).view(torch.uint8)
        slots = self._slots[seq % 2]
        slots[self.rank, :data.numel()].copy_(data)
        self._seqs[self.rank] = seq
        self._wait(seq, idle)
        return slots[:, :data.numel() if nbytes is None else nbytes]

    def _wait(self, seq: int, idle: bool) -> None:
        """Spin a little, then yield the core for 5 ms, then sleep 1 ms between looks (an idle server's ranks
        then cost ~nothing, and its next step starts at most 1 ms late)."""
        spins, start, checked = 0, 0.0, 0.0
        while int(self._seqs.min()) < seq:
            spins += 1
            if spins < 256:
                continue
            now = time.monotonic()
            if not start:
                start = checked = now
            if now - start > 0.005:
                time.sleep(0.001)
            else:
                os.sched_yield()  # ranks may share cores with each other and with rank 0's server
            if now - checked > 0.5:
                checked = now
                self._check_peers(seq, None if idle else start + _TIMEOUT)

    def _check_peers(self, seq: int, deadline: float | None) -> None:
        for r, pid in enumerate(self._pids.tolist()):
            if int(self._seqs[r]) < seq and not _alive(pid):
                raise RuntimeError(f"tensor-parallel rank {r} (pid {pid}) is gone: the collective cannot complete")
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"a shared-memory collective waited over {_TIMEOUT:.0f} s for another rank "
                               f"(RESIN_DIST_TIMEOUT)")

    def broadcast(self, data: torch.Tensor | None, nbytes: int, idle: bool = False) -> torch.Tensor:
        """Rank 0's nbytes bytes (data on rank 0, None elsewhere) on every rank, as a uint8 tensor."""
        slots = self._exchange(data if data is not None else _NOTHING, nbytes, idle)
        return slots[0].clone()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        slots = self._exchange(x)
        parts = slots.view(x.dtype).view(self.world, *x.shape)
        torch.sum(parts, dim=0, out=x) if x.is_contiguous() else x.copy_(parts.sum(0))
        return x

    def all_gather(self, x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """Rank r's x (its last dim sizes[r] wide) concatenated along the last dim in rank order."""
        width = max(sizes)
        if x.shape[-1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        parts = self._exchange(x).view(x.dtype).view(self.world, *x.shape)
        return torch.cat([parts[r, ..., :n] for r, n in enumerate(sizes)], dim=-1)

    def close(self) -> None:
        self._slots = self._seqs = self._pids = None
        try:
            self._mm.close()
        except BufferError:  # a tensor still views it: the mapping goes with the last one
            pass


def _alive(pid: int) -> bool:
    """Running (an exited process not yet reaped by its parent is a zombie: gone too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def open_exchange(group: ParallelGroup, broadcast_name) -> ShmExchange:
    """Rank 0 creates the segment and tells the others its name (broadcast_name(name or None) -> name); once
    every rank has it mapped (a barrier), rank 0 unlinks the file, so nothing is left in /dev/shm."""
    if group.rank != 0:
        exchange = ShmExchange(broadcast_name(None), group.rank, group.world)
        torch.distributed.barrier(group=group.cpu_group)
        return exchange
    name = f"/dev/shm/resin-tp-{uuid.uuid4().hex}"
    try:
        exchange = ShmExchange(name, 0, group.world, create=True)
        broadcast_name(name)
        torch.distributed.barrier(group=group.cpu_group)  # every rank has mapped it
    finally:
        os.unlink(name)
    return exchange


def supported(platform_: Platform) -> tuple[bool, str]:
    if platform_.kind != "cpu":
        return False, "for CPU ranks (GPUs reduce with NCCL/RCCL)"
    if platform.machine() not in ("x86_64", "AMD64"):
        return False, f"relies on x86-64 memory ordering; this CPU is {platform.machine()}"
    return True, ""


def _args(x: torch.Tensor, *_) -> str | None:
    exchange = parallel().host_exchange
    if exchange is None:
        return "no shared-memory segment: ranks on several machines (or one rank)"
    if not exchange.fits(x):
        return f"{x.numel() * x.element_size()} bytes exceed a {exchange.slot_bytes}-byte slot"
    return None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    return parallel().host_exchange.all_reduce(x)


def all_gather(x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    return parallel().host_exchange.all_gather(x, sizes)


all_reduce_args = gather_args = _args
