"""Tensor parallelism's processes: one per rank on torch.distributed, rank 0 schedules and serves.

Two ways in. `LLM(tensor_parallel_size=N)` / `resin run --tensor-parallel-size N` on one machine: this process is
rank 0 and spawns ranks 1..N-1 (multiprocessing, spawn), rendezvous over TCP on 127.0.0.1. Several machines: each
is started by `torchrun` with the same resin command; torch's env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) joins them, the process of rank 0 serves and every other runs `run_worker`. Every rank loads its own
slices of the weights (models/layers.py), runs the start-up self-check in lockstep with the others, then runs what
rank 0's StepChannel sends it.

Failure: rank 0 watches the processes it spawned; one that exits makes rank 0 fail (the server answers unhealthy
and exits 1). A spawned rank watches its parent and exits when it goes. A collective whose peer died fails in
gloo/NCCL: the step raises and the engine dies the same way, never a half-done step.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from resin.hal.distributed import ParallelGroup, parallel, set_parallel

log = logging.getLogger("resin.parallel")
# A device collective (NCCL/RCCL) that waits longer than this for a peer fails instead of hanging. gloo groups
# carry the step channel, whose receivers wait as long as the server is idle: they get no practical limit (a peer
# that dies closes its sockets, which fails gloo at once).
_TIMEOUT = timedelta(seconds=float(os.environ.get("RESIN_DIST_TIMEOUT", "300")))
_IDLE = timedelta(days=365)


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_group(rank: int, world: int, init_method: str, expert_parallel: bool) -> ParallelGroup:
    """Join the process group; GPUs: rank r drives its node's device LOCAL_RANK (r on one machine)."""
    backend = _device_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=_TIMEOUT if backend != "gloo" else _IDLE)
    cpu_group = dist.new_group(backend="gloo", timeout=_IDLE) if backend != "gloo" else dist.group.WORLD
    group = ParallelGroup(rank, world, dist.group.WORLD, cpu_group, expert_parallel)
    set_parallel(group)
    if backend == "gloo":  # the ranks of one machine share its cores, and can share memory
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        if local == world:
            from resin.backends.cpu.shm_collectives import open_exchange

            group = replace(group, host_exchange=open_exchange(group, _broadcast_name))
            set_parallel(group)
    return group


def _broadcast_name(name: str | None) -> str:
    """Rank 0's short ASCII string on every rank."""
    data = torch.zeros(128, dtype=torch.uint8)
    if name is not None:
        data[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
    dist.broadcast(data, 0, group=parallel().cpu_group)
    return bytes(data[data != 0].tolist()).decode()


def leave_group(together: bool = False) -> None:
    """Back to one rank: this process can build another engine. together: every rank is leaving now (a normal
    stop): wait for all at a barrier first, so none tears its connections down under another's last message."""
    if dist.is_initialized():
        if together:
            dist.barrier(group=parallel().cpu_group)
        for resource in parallel().device_resources.values():  # peer mappings go before the groups they used
            resource.close()
        dist.destroy_process_group()
    if parallel().host_exchange is not None:
        parallel().host_exchange.close()
    set_parallel(ParallelGroup())


def exchange_ints(values: list[int]) -> list[list[int]]:
    """Every rank's `values` (same length on every rank), in rank order."""
    g = parallel()
    mine = torch.tensor(values, dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(g.world)]
    dist.all_gather(parts, mine, group=g.cpu_group)
    return [p.tolist() for p in parts]


def broadcast_ints(values: list[int] | None, count: int) -> list[int]:
    """Rank 0's `values` on every rank (others pass None)."""
    t = torch.tensor(values, dtype=torch.int64) if values is not None else torch.empty(count, dtype=torch.int64)
    dist.broadcast(t, 0, group=parallel().cpu_group)
    return t.tolist()


class Workers:
    """The ranks rank 0 spawned (none under torchrun): started, watched, stopped.

    A rank that exits while the engine runs calls on_death (default: end this process, which cannot step
    without it). One that exits during start-up leaves rank 0 to fail on its own (a gloo collective with a
    dead peer raises at once) and raise the rank's error; only if rank 0 is still waiting after a grace period
    (an NCCL collective may not notice) does on_death run."""

    _STARTUP_GRACE = 10.0

    def __init__(self, processes: list[multiprocessing.Process], errors: list[multiprocessing.connection.Connection]):
        self.processes, self._errors = processes, errors
        self.on_death: Callable[[str], None] = _die
        self.started = False  # set once the engine is built
        self.deaths: list[str] = []
        self._closing = False
        self._watch = threading.Thread(target=self._watch_loop, name="resin-tp-watch", daemon=True)
        self._watch.start()

    def _watch_loop(self) -> None:
        alive = {p.sentinel: (p, err) for p, err in zip(self.processes, self._errors)}
        while alive and not self._closing:
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=0.5):
                p, err = alive.pop(sentinel)
                p.join(1)  # reap it: its exit code
                try:
                    error = err.recv() if err.poll() else None
                except (EOFError, OSError):  # it died without a word (killed)
                    error = None
                reason = f"tensor-parallel worker {p.name} exited with code {p.exitcode}" + (
                    f" ({error})" if error else "")
                self.deaths.append(reason)
                if not self.started:
                    deadline = time.monotonic() + self._STARTUP_GRACE
                    while not self._closing and time.monotonic() < deadline:
                        time.sleep(0.1)
                if not self._closing:
                    self.on_death(reason)
                return

    def deaths_within(self, timeout: float) -> list[str]:
        """The ranks that exited, waiting up to timeout for the watcher to see one."""
        deadline = time.monotonic() + timeout
        while not self.deaths and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(self.deaths)

    def expect_exit(self) -> None:
        """The ranks are about to be told to stop: their exits are no longer deaths."""
        self._closing = True

    def close(self, timeout: float = 10.0) -> None:
        """After rank 0 sent STOP: wait for the ranks to leave, then make sure they have."""
        self._closing = True
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def _die(reason: str) -> None:
    """Without a server to tell: a tensor-parallel engine that lost a rank cannot step again."""
    log.error("%s: exiting (the other ranks cannot go on without it)", reason)
    os._exit(1)


def start(args) -> Workers | None:
    """In the process that will be rank 0 (or any rank under torchrun): join or create the process group for
    args.tensor_parallel_size ranks. Returns the spawned workers (None under torchrun, or with one rank)."""
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != args.tensor_parallel_size:
            raise ValueError(f"torchrun started {world} processes but --tensor-parallel-size is "
                             f"{args.tensor_parallel_size}: give the same number to both")
        init_group(int(os.environ["RANK"]), world, "env://", args.enable_expert_parallel)
        return None
    world = args.tensor_parallel_size
    if world == 1:
        return None
    url = f"tcp://127.0.0.1:{_free_port()}"
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(1, world)]
    processes = [ctx.Process(target=_worker_process, args=(rank, world, url, args, os.getpid(), send),
                             name=f"rank {rank}", daemon=True) for rank, (_, send) in zip(range(1, world), pipes)]
    for p in processes:
        p.start()
    for _, send in pipes:
        send.close()  # the child holds its end: a rank that dies closes the pipe
    workers = Workers(processes, [recv for recv, _ in pipes])
    try:
        init_group(0, world, url, args.enable_expert_parallel)
    except BaseException:
        workers.close(timeout=0)
        raise
    return workers


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)  # rank 0 is gone (killed): nothing will send another step


def _worker_process(rank: int, world: int, url: str, args, parent: int,
                    errors: multiprocessing.connection.Connection) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        init_group(rank, world, url, args.enable_expert_parallel)
        run_worker(args)
    except BaseException as e:
        errors.send(f"{type(e).__name__}: {e}")  # for rank 0's report; the traceback goes to stderr
        raise
    exit_now()


def exit_now(code: int = 0) -> None:
    """A rank done with its steps leaves without the interpreter's teardown: destructors of gloo's threads at
    exit can abort the process ("terminate called without an active exception") under load."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker(args) -> None:
    """A rank other than 0: load this rank's slices, build the runner rank 0 plans, run its steps until STOP."""
    from resin.core.step_channel import StepChannel
    from resin.core.tp_worker import serve_steps
    from resin.engine_builder import build_worker_runner

    runner = build_worker_runner(args)
    g = parallel()
    serve_steps(runner, StepChannel(g.cpu_group, g.rank, g.host_exchange))
    leave_group(together=True)
