"""The ceiling the bf16 GEMMs run against: this CPU's vdpbf16ps rate, every core busy.

    python bench/cpu_peak.py

Compiles (g++ -O2 -march=native) a loop of 24 independent 512-bit vdpbf16ps (each 16 lanes x 2 multiply-adds, 64
FLOP) into a temporary folder and runs one copy per CPU this process may use, all at once, each ~1.5 s; prints
each copy's GFLOP/s and their sum (the copies start within milliseconds of each other). A GEMM's or a whole
prefill's GFLOP/s divided by the sum is the share of the peak it reaches (README, Performance). The rate per
cycle is not measured: 466 GFLOP/s on two Zen 4 cores is one vdpbf16ps a cycle at ~3.64 GHz. Needs Linux,
AVX512-BF16 and g++; says so and stops where one is missing.
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
  const long iters = 200000000;
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
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="copies run at once")
    args = ap.parse_args()
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or "avx512_bf16" not in cpuinfo.read_text():
        sys.exit("no AVX512-BF16 here (or no /proc/cpuinfo to say): no vdpbf16ps peak to measure")
    if shutil.which("g++") is None:
        sys.exit("no g++ on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp, "peak.cpp"), Path(tmp, "peak")
        src.write_text(SOURCE)
        built = subprocess.run(["g++", "-O2", "-march=native", str(src), "-o", str(exe)], capture_output=True,
                               text=True)
        if built.returncode:
            sys.exit(f"g++ could not build the vdpbf16ps loop (too old for AVX512-BF16?):\n{built.stderr[-2000:]}")
        procs = [subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True) for _ in range(args.cores)]
        outputs = [(p.communicate()[0], p.returncode) for p in procs]
    if any(code for _, code in outputs):
        sys.exit(f"a copy of the loop failed: exit statuses {[code for _, code in outputs]}")
    rates = [float(out.split()[0]) for out, _ in outputs]
    print("per copy: " + ", ".join(f"{r:.1f}" for r in rates) + f" GFLOP/s; all {len(rates)}: {sum(rates):.1f} GFLOP/s")


if __name__ == "__main__":
    main()
