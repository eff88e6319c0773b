"""quant_linear's cpu paths side by side, to choose the thresholds in backends/cpu/quant.py.

    python bench/quant_linear.py                      # the built-in model's shapes, bf16, 1 to 256 rows
    python bench/quant_linear.py --types q4_k,q6_k --rows 1,16,64

For each (type, weight shape, rows): the row kernel (`quant_matmul`: exact products, fused for Q4_0/Q4_1/Q8_0 in
bf16, and Q4_K), the panel GEMM (`quant_matmul_bf16`: panels of 32 weight rows unpacked to bf16, register-blocked
vdpbf16ps), and the tiled GEMM (tiles unpacked into torch's GEMM: fp32, and CPUs without AVX512-BF16), in ms per call (median of --reps), plus the packed bytes read per second by the
path that quant_linear picks. Random packed blocks; the numbers do not depend on the values.
"""
from __future__ import annotations

import argparse

import torch

from resin.backends.cpu import kernels, quant
from resin.tiny import random_packed
from timers import median_seconds

SHAPES = {"q4_1": [(1536, 576), (576, 1536), (960, 576)], "q8_0": [(49152, 576)]}


def timed(fn, reps: int) -> float:
    return median_seconds(fn, reps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=None, help="comma list (default: the built-in model's q4_1 and q8_0); "
                                                  "other types are timed at 1536x512")
    ap.add_argument("--rows", default="1,8,16,32,64,128,256")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    ext = kernels.extension()
    if ext is None:
        raise SystemExit(f"Resin's CPU kernels are not built here: {kernels.load()[1]}")
    dtype = getattr(torch, args.dtype)
    types = args.types.split(",") if args.types else list(SHAPES)
    print(f"{'type':<6}{'N x K':>12}{'rows':>6}{'row kernel':>12}{'panel GEMM':>11}{'AMX panels':>11}"
          f"{'tiled GEMM':>12}{'picked GB/s':>13}")
    for qtype in types:
        for n, k in SHAPES.get(qtype, [(1536, 512)]):
            w = random_packed(qtype, n, k)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k).to(dtype)
                exact = timed(lambda: ext.quant_matmul(x, w, qtype, None, None), args.reps)
                rows = (timed(lambda: ext.quant_matmul_bf16(x, w, qtype, None, None), args.reps)
                        if dtype == torch.bfloat16 else float("nan"))
                amx = (timed(lambda: ext.quant_matmul_bf16(x, w, qtype, None, None, amx=True), args.reps)
                       if dtype == torch.bfloat16 and kernels.amx_gemm() else float("nan"))
                tiled = timed(lambda: quant._tiled_gemm(x, w, qtype, None, None), args.reps)
                picked = timed(lambda: quant.quant_linear(x, w, qtype), args.reps)
                print(f"{qtype:<6}{f'{n}x{k}':>12}{m:>6}{exact:>12.3f}{rows:>11.3f}{amx:>11.3f}{tiled:>12.3f}"
                      f"{w.numel() / picked / 1e6:>13.1f}")


if __name__ == "__main__":
    main()
