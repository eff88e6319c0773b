// A bf16 GEMM microkernel over weights laid out in panels, shared by the bf16 linear (bf16_linear.cpp: panels
// packed once per weight) and the batched quantised linear (quant_kernels.cpp: panels unpacked per call).
//
// A panel holds 16 * NV consecutive output rows (weight rows) of the (N, K) weight as K/2 pairs:
// panel[p * 16 NV + j] = weights 2p and 2p + 1 of output row r0 + j, one 32-bit word. One vdpbf16ps then multiplies
// a pair of an activation row (broadcast to every lane) with 16 output rows' pairs, exactly, summing in fp32 per
// output lane: no horizontal reductions, outputs stored 16 at a time, and the whole panel is one sequential stream
// (the hardware prefetcher keeps a memory-bound batch-1 pass at the memory's rate).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"  // immintrin.h

namespace resin_panels {

// acc[v][t] lane j = x[t] . (output row 16 v + j of the panel) for MR activation rows x[t] = x + t * ldx, over
// k inputs (k / 2 pairs; stride: words from one pair of the panel to the next, 16 NV for a whole panel). With pf,
// it also prefetches cache lines from pf on, one a pair, up to pf_lines of them (panel_rows says why).
template <int NV, int MR>
inline void dot_pairs(const uint32_t* panel, int64_t stride, int64_t k, const uint16_t* x, int64_t ldx,
                      __m512 (&acc)[NV][MR], const char* pf = nullptr, int64_t pf_lines = 0) {
  for (int v = 0; v < NV; ++v)
    for (int t = 0; t < MR; ++t) acc[v][t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + p * stride + 16 * v));
    if (p < pf_lines) _mm_prefetch(pf + 64 * p, _MM_HINT_T0);
    for (int t = 0; t < MR; ++t) {
      int32_t pair;
      std::memcpy(&pair, x + t * ldx + 2 * p, sizeof(pair));
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int v = 0; v < NV; ++v) acc[v][t] = _mm512_dpbf16_ps(acc[v][t], w[v], xv);
    }
  }
}

// out[t][r0 .. r0 + valid) = x[t] . (output rows of the panel) + bias, for MR activation rows x[t] = x + t * k:
// NV x MR sums in registers, rounded to bf16 once.
template <int NV, int MR>
inline void tile(const uint32_t* panel, int64_t k, const uint16_t* x, const float* bias, int64_t r0, int valid,
                 c10::BFloat16* out, int64_t n, const char* pf = nullptr, int64_t pf_lines = 0) {
  __m512 acc[NV][MR];
  dot_pairs<NV, MR>(panel, 16 * NV, k, x, k, acc, pf, pf_lines);
  for (int v = 0; v < NV; ++v) {
    const int lanes = std::max(0, std::min(16, valid - 16 * v));
    if (lanes == 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + r0 + 16 * v) : _mm512_setzero_ps();
    for (int t = 0; t < MR; ++t) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(acc[v][t], b));
      _mm256_mask_storeu_epi16(out + t * n + r0 + 16 * v, mask, reinterpret_cast<__m256i>(y));
    }
  }
}

// The same for mr <= MR activation rows (the last block of a batch).
template <int NV, int MR>
inline void tile_upto(int mr, const uint32_t* panel, int64_t k, const uint16_t* x, const float* bias, int64_t r0,
                      int valid, c10::BFloat16* out, int64_t n, const char* pf = nullptr, int64_t pf_lines = 0) {
  if constexpr (MR > 1) {
    if (mr < MR) return tile_upto<NV, MR - 1>(mr, panel, k, x, bias, r0, valid, out, n, pf, pf_lines);
  }
  tile<NV, MR>(panel, k, x, bias, r0, valid, out, n, pf, pf_lines);
}

// Every one of m activation rows (x (m, K), out (m, N) row-major) against one panel of output rows r0 ..: the
// panel stays in L1/L2 while the rows pass over it, MR at a time.
//
// next: the panel this thread multiplies after this one (null: none, or not known). The first tile of rows reads
// a panel from memory or L3 as it multiplies, and with 2-8 tiles that read is a large share of the call: so the
// tiles after the first prefetch the next panel, one line a pair (the rest of a 2-tile call's panel is left to
// the hardware). The hint is T0, though a panel (55-147 KiB here) is larger than L1: by the time a line is used
// it may have moved on to L2 (not measured; T1, straight to L2, measured no gain). 2-core Zen 4, every
// projection of the built-in model's 30 layers in bf16, weights from memory, old and new builds interleaved in
// one process, 21 repetitions: 16 rows 295 -> 315 GFLOP/s, 32 rows 350 -> 362, 48 even (shorter runs: 256 and
// 1,024 rows even). Spreading three lines a pair over a 2-tile call's second tile lost 7-15% at 16 rows.
template <int NV, int MR>
inline void panel_rows(const uint32_t* panel, int64_t m, int64_t k, const uint16_t* x, const float* bias, int64_t r0,
                       int valid, c10::BFloat16* out, int64_t n, const uint32_t* next = nullptr) {
  const int64_t pairs = k / 2, lines = pairs * NV;  // a pair of the panel is NV cache lines
  for (int64_t i = 0, t = 0; i < m; i += MR, ++t) {
    const int mr = static_cast<int>(std::min<int64_t>(MR, m - i));
    const int64_t line0 = t == 0 || next == nullptr ? lines : std::min(lines, (t - 1) * pairs);
    const char* pf = next == nullptr ? nullptr : reinterpret_cast<const char*>(next) + 64 * line0;
    tile_upto<NV, MR>(mr, panel, k, x + i * k, bias, r0, valid, out + i * n, n, pf, lines - line0);
  }
}

}  // namespace resin_panels
#endif
