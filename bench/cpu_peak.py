"""The ceiling the bf16 GEMMs run against: this CPU's vdpbf16ps rate, every core busy.

    python bench/cpu_peak.py

Compiles (g++ -O2 -march=native) a loop of 24 independent 512-bit vdpbf16ps (each 32 multiply-adds, 64 FLOP) into
a temporary folder and runs one copy per core at once; prints each copy's GFLOP/s and their sum. A GEMM's or a
whole prefill's GFLOP/s divided by the sum is the share of the peak it reaches (README, Performance). Needs
AVX512-BF16 and a C++ compiler; says so and stops where either is missing.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <cstdio>
#include <ctime>
int main() {
  __m512 acc[24];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
  const long iters = 40000000;
  timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a));  // keeps the loop from being folded
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  float s = 0;
  for (auto& v : acc) s += _mm512_reduce_add_ps(v);
  const double dt = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
  std::printf("%.1f %g\n", iters * 24 * 64.0 / dt / 1e9, s);
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="copies run at once")
    args = ap.parse_args()
    if "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        sys.exit("this CPU has no AVX512-BF16: no vdpbf16ps peak to measure")
    if shutil.which("g++") is None:
        sys.exit("no g++ on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp, "peak.cpp"), Path(tmp, "peak")
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
        procs = [subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True) for _ in range(args.cores)]
        rates = [float(p.communicate()[0].split()[0]) for p in procs]
    print("per core: " + ", ".join(f"{r:.1f}" for r in rates) + f" GFLOP/s; all {len(rates)}: {sum(rates):.1f} GFLOP/s")


if __name__ == "__main__":
    main()
