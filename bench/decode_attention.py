"""The cpp provider's paged decode attention kernel as a decode step meets it: each layer's cache a separate
buffer on huge pages (as the engine allocates them), the layers called in turn, so every call reads its keys and
values from memory rather than from a cache warmed by the call before.

    python bench/decode_attention.py                       # 32 x 132 keys, 32 x 1,000, 1 x 8,000
    python bench/decode_attention.py --shapes 32x132 --order sequential

Shape: the built-in model's heads (9 query heads, 3 KV heads, head size 64), bf16, 16-token blocks, one cache of
--blocks blocks a layer (a 1 GiB KV budget gives the built-in model 2,912). Blocks are handed out in random order
by default (a server's cache after hours of traffic) or in order (a fresh engine). Reported: microseconds a layer
(median over --reps passes over all layers) and the rate at which the kernel read the keys and values it needed;
`--warm` adds the same calls on one layer's cache again and again (its KV then comes from the CPU's caches where
it fits: 3.2 MB at 32 x 132 keys, 24.6 MB at 32 x 1,000). Each run measures the build it finds; to compare kernels,
run it at two commits (the machine's drift between runs is often 10-20%), or build both into one process.
"""
from __future__ import annotations

import argparse
import time

import torch

from resin.backends.cpu.kernels import extension
from resin.hal.memory import empty_on_huge_pages

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 9, 3, 64, 16


def run(ext, caches, batch: int, ctx: int, order: str, reps: int, warm: bool) -> dict[str, float]:
    blocks = caches[0].shape[2]
    per_seq = -(-ctx // BLOCK)
    if batch * per_seq > blocks:
        raise SystemExit(f"{batch} x {ctx} keys need {batch * per_seq} blocks; raise --blocks")
    ids = torch.randperm(blocks) if order == "random" else torch.arange(blocks)
    tables = ids[:batch * per_seq].view(batch, per_seq).to(torch.int32).contiguous()
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, HEADS * HEAD_SIZE).to(torch.bfloat16)
    scale = HEAD_SIZE ** -0.5

    def timed(layer_caches) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for cache in layer_caches:
                ext.paged_decode_attention(q, cache, tables, lens, HEADS, scale, 0)
            times.append((time.perf_counter() - start) / len(layer_caches))
        return sorted(times)[len(times) // 2] * 1e6

    timed(caches)  # warm-up
    kv_bytes = batch * KV_HEADS * ctx * HEAD_SIZE * 2 * 2
    result = {"layers_us": timed(caches)}
    result["layers_gb_s"] = kv_bytes / result["layers_us"] / 1e3
    if warm:
        result["warm_us"] = timed(caches[:1] * len(caches))
        result["warm_gb_s"] = kv_bytes / result["warm_us"] / 1e3
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="32x132,32x1000,1x8000", help="comma-separated BATCHxKEYS")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--blocks", type=int, default=2912, help="blocks in each layer's cache")
    ap.add_argument("--order", choices=("random", "sequential"), default="random")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warm", action="store_true")
    args = ap.parse_args()
    ext = extension()
    if ext is None:
        raise SystemExit("Resin's C++ CPU kernels are not built here (see `resin backends`)")
    torch.manual_seed(0)
    caches = [empty_on_huge_pages((2, KV_HEADS, args.blocks, BLOCK, HEAD_SIZE), torch.bfloat16).normal_()
              for _ in range(args.layers)]
    print(f"{'shape':>10} {'us/layer':>9} {'GB/s':>6}" + (f" {'warm us':>8} {'GB/s':>6}" if args.warm else ""))
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        r = run(ext, caches, batch, ctx, args.order, args.reps, args.warm)
        line = f"{shape:>10} {r['layers_us']:9.1f} {r['layers_gb_s']:6.1f}"
        if args.warm:
            line += f" {r['warm_us']:8.1f} {r['warm_gb_s']:6.1f}"
        print(line)


if __name__ == "__main__":
    main()
