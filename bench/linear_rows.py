"""The cpu backend's linear providers side by side at decode and prefill row counts, to choose cpp_linear.py's
row limits.

    python bench/linear_rows.py                         # bf16, the built-in model's shapes, 1 to 1,024 rows
    python bench/linear_rows.py --dtype float32 --rows 8,16,32,64

Every projection of the built-in model's layers (qkv, o, gate-up, down; random weights of its shapes) and its
lm_head in turn, so the weights stream from memory as in a decode step: the C++ provider (`cpp`), oneDNN over its
reordered weight (`onednn`) and native's F.linear, each the median of --reps passes, interleaved; ms per pass,
GFLOP/s and each provider's speed over oneDNN's. A provider that declines a row count prints "-".
"""
from __future__ import annotations

import argparse
import time

import torch

from resin.backends.cpu import cpp_linear, linear
from resin.hal.ops import LINEAR


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,1024")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--kv-dim", type=int, default=192, help="KV heads x head size")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dtype, h = getattr(torch, args.dtype), args.hidden
    shapes = [(h + 2 * args.kv_dim, h), (h, h), (2 * args.intermediate, h), (h, args.intermediate)]
    weights = [torch.randn(n, k).to(dtype) * 0.05 for _ in range(args.layers) for n, k in shapes]
    weights.append(torch.randn(args.vocab, h).to(dtype) * 0.05)
    providers = {"cpp": (cpp_linear.supports_args, cpp_linear.cpp_linear),
                 "onednn": (linear.supports_args, linear.onednn_linear),
                 "native": (lambda *a: None, LINEAR.native)}
    print(f"{args.dtype}, {len(weights)} weights, {sum(w.numel() for w in weights) * weights[0].element_size() / 1e6:.0f} MB")
    print(f"{'rows':>6}" + "".join(f"{name + ' ms':>12}{'GFLOP/s':>9}{'vs onednn':>10}" for name in providers))
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k).to(dtype) for k in {w.shape[1] for w in weights}}
        flops = 2 * m * sum(w.numel() for w in weights)
        usable = {name: fn for name, (check, fn) in providers.items()
                  if all(check(xs[w.shape[1]], w) is None for w in weights)}
        times: dict[str, list[float]] = {name: [] for name in usable}
        for rep in range(args.reps + 1):  # the first pass warms up (and packs the weights)
            for name, fn in usable.items():
                start = time.perf_counter()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                if rep:
                    times[name].append(time.perf_counter() - start)
        med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        row = f"{m:>6}"
        for name in providers:
            if name not in med:
                row += f"{'-':>12}{'-':>9}{'-':>10}"
                continue
            ratio = med["onednn"] / med[name] if "onednn" in med else float("nan")
            row += f"{med[name] * 1e3:>12.2f}{flops / med[name] / 1e9:>9.0f}{ratio:>9.2f}x"
        print(row, flush=True)


if __name__ == "__main__":
    main()
