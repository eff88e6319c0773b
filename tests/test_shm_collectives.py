"""The shared-memory collectives of CPU ranks on one machine (backends/cpu/shm_collectives.py), in real
processes joined by a real gloo group: sums and gathers equal the reference on fresh random tensors, every rank
gets bit-identical results, broadcasts carry rank 0's bytes, and a dead peer fails the wait instead of hanging."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from server_utils import free_port

pytestmark = pytest.mark.distributed

SCRIPT = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    from resin.hal.distributed import ParallelGroup, set_parallel
    from resin.backends.cpu.shm_collectives import open_exchange

    rank, world, port, seed, mode = (int(a) for a in sys.argv[1:6])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = ParallelGroup(rank, world, dist.group.WORLD, dist.group.WORLD)

    def name(n):
        t = torch.zeros(128, dtype=torch.uint8)
        if n is not None:
            t[:len(n)] = torch.tensor(list(n.encode()), dtype=torch.uint8)
        dist.broadcast(t, 0)
        return bytes(t[t != 0].tolist()).decode()

    ex = open_exchange(group, name)
    if mode == 1:  # a peer that dies: rank 1 leaves, the others must raise within seconds
        if rank == 1:
            os._exit(0)
        start = time.monotonic()
        try:
            ex.all_reduce(torch.ones(4))
        except RuntimeError as e:
            assert "rank 1" in str(e) and time.monotonic() - start < 5, e
            print("RAISED", flush=True)
            os._exit(0)
        os._exit(3)
    for step in range(40):  # many steps: both slot sets reused, shapes changing
        g = torch.Generator().manual_seed(seed + step)
        full = [torch.randn(step % 5 + 1, 7 + step % 3, generator=g) for _ in range(world)]
        for dtype in (torch.float32, torch.bfloat16):
            mine = full[rank].to(dtype)
            got = ex.all_reduce(mine.clone())
            ref = mine.clone(); dist.all_reduce(ref)
            assert torch.allclose(got.float(), sum(f.to(dtype).float() for f in full), atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
            everyone = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(everyone, got)
            assert all(torch.equal(e, got) for e in everyone)  # bit-identical on every rank
        sizes = tuple(3 + r for r in range(world))  # uneven widths
        part = full[rank][:, :1].expand(-1, sizes[rank]).contiguous() + rank
        got = ex.all_gather(part, sizes)
        want = torch.cat([full[r][:, :1].expand(-1, sizes[r]) + r for r in range(world)], dim=-1)
        assert torch.equal(got, want)
        payload = torch.randint(0, 255, (step * 13 + 1,), dtype=torch.uint8, generator=g)
        got = ex.broadcast(payload if rank == 0 else None, payload.numel())
        assert torch.equal(got, payload)
    ex.close()
    dist.barrier()
    dist.destroy_process_group()
    print("OK", flush=True)
    os._exit(0)  # as Resin's ranks leave: no interpreter teardown (gloo's thread destructors can abort it)
""")


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_equal_reference(world, tmp_path):
    script = tmp_path / "shm.py"
    script.write_text(SCRIPT)
    port, seed = free_port(), int(torch.randint(0, 1 << 20, (1,)))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port), str(seed), "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0 and "OK" in out, err
    assert not list(Path("/dev/shm").glob("resin-tp-*"))  # unlinked once every rank had mapped it


def test_a_dead_peer_fails_the_wait(tmp_path):
    script = tmp_path / "shm.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "3", str(port), "0", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    outs = [p.communicate(timeout=180) for p in procs]
    for r in (0, 2):
        assert procs[r].returncode == 0 and "RAISED" in outs[r][0], outs[r][1]


def test_large_tensors_go_to_gloo():
    from resin.backends.cpu import shm_collectives
    from resin.hal.distributed import ParallelGroup, parallel, set_parallel

    class Exchange:
        slot_bytes = 1024

        def fits(self, x):
            return x.numel() * x.element_size() <= self.slot_bytes

    before = parallel()
    set_parallel(ParallelGroup(0, 2, host_exchange=Exchange()))
    try:
        assert shm_collectives.all_reduce_args(torch.zeros(256)) is None
        assert "exceed" in shm_collectives.all_reduce_args(torch.zeros(257))
    finally:
        set_parallel(before)
    assert "no shared-memory segment" in shm_collectives.all_reduce_args(torch.zeros(1))
