"""Micro-benchmark behind the cpu backend's `chunked` gated delta rule (backends/cpu/delta_rule.py): one prompt
of L tokens through one Gated DeltaNet layer of Qwen3-Next-80B's shape (16 key heads, 32 value heads, 128 x 128),
the token-by-token native recurrence against the chunked form, interleaved, median of --reps.

    python bench/delta_rule.py [--lengths 64 256 1024] [--reps 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from resin import hal
from resin.backends.cpu.delta_rule import chunked_gated_delta_rule


def inputs(length: int, h: int = 16, hv: int = 32, dk: int = 128, dv: int = 128):
    q, k = torch.randn(length, h, dk), torch.randn(length, h, dk)
    v = torch.randn(length, hv, dv)
    g, beta = -F.softplus(torch.randn(length, hv)), torch.rand(length, hv)
    state = torch.zeros(1, hv, dk, dv)
    meta = (torch.tensor([0, length], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.tensor([False]))
    return (q, k, v, g, beta, state, *meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    print(f"threads: {torch.get_num_threads()}")
    print("| L | native ms | chunked ms | chunked speed-up |\n|---|---|---|---|")
    for length in args.lengths:
        x = inputs(length)
        times: dict[str, list[float]] = {"native": [], "chunked": []}
        for _ in range(args.reps):
            for name, fn in (("native", hal.GATED_DELTA_RULE.native), ("chunked", chunked_gated_delta_rule)):
                start = time.perf_counter()
                fn(*x)
                times[name].append((time.perf_counter() - start) * 1e3)
        nat, chk = statistics.median(times["native"]), statistics.median(times["chunked"])
        print(f"| {length} | {nat:.1f} | {chk:.1f} | {nat / chk:.1f}x |")


if __name__ == "__main__":
    main()
