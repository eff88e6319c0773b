// The two products of prefill_attention_f32.cpp for bf16 q and caches on CPUs with AVX512-BF16: scores (q . k) and
// P.V by vdpbf16ps over bf16_panels.h's pair layout, twice the products per instruction of the fp32 tile; and the
// bf16 softmax row both bf16 prefill kernels use (this one and the AMX one, prefill_attention.cpp).
//
// Numerics: a product of two bf16 values is exact in fp32, so the scores are what the fp32 tile computes, summed
// in another order. The probabilities are rounded to bf16 (round to nearest even: at most 2^-8 of each weight)
// for P.V, as torch's CPU flash kernel and Resin's AMX kernel (prefill_attention.cpp) round them; their sum, the
// softmax's denominator, stays fp32 over the unrounded values, as theirs does. The exps come from a polynomial
// within 6e-5 of exact (exp2_16), well below that rounding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "bf16_panels.h"

namespace prefill_bf16 {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool kAvailable = true;

constexpr int64_t kKeyPanel = 32;  // keys per panel of the score product
constexpr int kScoreRows = 8;      // query rows per register tile of the score product (2 x 8 sums)
constexpr int kValueRows = 6;      // rows per register tile of P.V (4 x 6 sums: 64 value columns)

// Key t of a tile, its D bf16 values -> words [t / 32][c][t % 32] = (k[2c], k[2c + 1]): panels of 32 keys.
inline void pack_key(const uint16_t* k, int64_t d, int64_t t, uint32_t* tile) {
  uint32_t* panel = tile + t / kKeyPanel * kKeyPanel * (d / 2) + t % kKeyPanel;
  for (int64_t c = 0; c < d / 2; ++c) panel[c * kKeyPanel] = k[2 * c] | uint32_t{k[2 * c + 1]} << 16;
}

// Value row t of a tile -> half-words of words [t / 2][c]: (v_t[c], v_t+1[c]), keys paired for P.V.
inline void pack_value(const uint16_t* v, int64_t d, int64_t t, uint32_t* tile) {
  auto* half = reinterpret_cast<uint16_t*>(tile + t / 2 * d) + t % 2;
  for (int64_t c = 0; c < d; ++c) half[2 * c] = v[c];
}

template <int NV, int MR>
inline void score_tile(int mr, const uint16_t* q, int64_t d, const uint32_t* keys, float* s, int64_t lds) {
  if constexpr (MR > 1) {
    if (mr < MR) return score_tile<NV, MR - 1>(mr, q, d, keys, s, lds);
  }
  __m512 acc[NV][MR];
  resin_panels::dot_pairs<NV, MR>(keys, kKeyPanel, d, q, d, acc);
  for (int v = 0; v < NV; ++v)
    for (int t = 0; t < MR; ++t) _mm512_storeu_ps(s + t * lds + 16 * v, acc[v][t]);
}

// s (rows x n, row stride lds) = q (rows x D bf16) . the first n keys of a packed tile (n a multiple of 16).
inline void score_rows(int64_t rows, const uint16_t* q, int64_t d, const uint32_t* keys, int64_t n, float* s,
                       int64_t lds) {
  for (int64_t c = 0; c < n; c += kKeyPanel) {
    const uint32_t* panel = keys + c / kKeyPanel * kKeyPanel * (d / 2);
    for (int64_t r = 0; r < rows; r += kScoreRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kScoreRows, rows - r));
      if (n - c >= kKeyPanel)
        score_tile<2, kScoreRows>(mr, q + r * d, d, panel, s + r * lds + c, lds);
      else
        score_tile<1, kScoreRows>(mr, q + r * d, d, panel, s + r * lds + c, lds);
    }
  }
}

// 2^x on 16 lanes for x <= 0 (scores already in log2 units): 2^round(x) times a degree-4 polynomial of the
// fraction (Taylor of e^(f ln2), |f| <= 1/2: relative error under 5.6e-5). Each probability is then rounded to bf16
// (2^-8) for P.V, so the polynomial's error is lost below that rounding; it costs 4 FMAs where the ~1-ulp
// natural-base exp (simd.h's poly_exp) costs 8, and the exps are what the softmax spends its time on. Lanes below
// -126 give 0.
inline __m512 exp2_16(__m512 x) {
  const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 n = _mm512_roundscale_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(clamped, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  return _mm512_maskz_scalef_ps(live, p, n);
}

// One row of a score tile (n keys, a multiple of 16): scale (into log2 units: `scale` includes log2(e)), mask keys
// from `visible` on, fold into the running max (log2 units); the probabilities to p as bf16 (round to nearest
// even); returns the new max and sets *block_sum to the row's sum of exps (before the rounding, as torch's flash
// kernel sums them). The scores are overwritten with their scaled values.
inline float softmax_row(float* s, int64_t n, int64_t visible, float scale, float running_max, uint16_t* p,
                         float* block_sum) {
  __m512 m = _mm512_set1_ps(running_max);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < n; c += 16) {
    const int64_t left = visible - c;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    const __m512 v = _mm512_mask_mul_ps(neg_inf, mask, _mm512_loadu_ps(s + c), _mm512_set1_ps(scale));
    _mm512_storeu_ps(s + c, v);
    m = _mm512_max_ps(m, v);
  }
  const float row_max = _mm512_reduce_max_ps(m);
  const __m512 mx = _mm512_set1_ps(row_max);
  __m512 total = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 16) {
    const __m512 e = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s + c), mx));
    total = _mm512_add_ps(total, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + c), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  *block_sum = _mm512_reduce_add_ps(total);
  return row_max;
}

template <int NV, int MR>
inline void value_tile(int mr, const uint16_t* p, int64_t ldp, const uint32_t* values, int64_t d, int64_t n,
                       float* acc) {
  if constexpr (MR > 1) {
    if (mr < MR) return value_tile<NV, MR - 1>(mr, p, ldp, values, d, n, acc);
  }
  __m512 sums[NV][MR];
  resin_panels::dot_pairs<NV, MR>(values, d, n, p, ldp, sums);
  for (int v = 0; v < NV; ++v)
    for (int t = 0; t < MR; ++t) {
      float* dst = acc + t * d + 16 * v;
      _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), sums[v][t]));
    }
}

template <int NV>
inline void value_columns(int64_t rows, const uint16_t* p, int64_t ldp, const uint32_t* values, int64_t d,
                          int64_t n, float* acc) {
  for (int64_t r = 0; r < rows; r += kValueRows) {
    const int mr = static_cast<int>(std::min<int64_t>(kValueRows, rows - r));
    value_tile<NV, kValueRows>(mr, p + r * ldp, ldp, values, d, n, acc + r * d);
  }
}

// acc (rows x D fp32) += p (rows x n bf16, row stride ldp) . the first n value rows of a packed tile (n even),
// 64 columns at a time (D a multiple of 16).
inline void value_rows(int64_t rows, const uint16_t* p, int64_t ldp, const uint32_t* values, int64_t d, int64_t n,
                       float* acc) {
  for (int64_t c = 0; c < d; c += 64) {
    switch (std::min<int64_t>(4, (d - c) / 16)) {
      case 4: value_columns<4>(rows, p, ldp, values + c, d, n, acc + c); break;
      case 3: value_columns<3>(rows, p, ldp, values + c, d, n, acc + c); break;
      case 2: value_columns<2>(rows, p, ldp, values + c, d, n, acc + c); break;
      default: value_columns<1>(rows, p, ldp, values + c, d, n, acc + c); break;
    }
  }
}

#else  // no AVX512-BF16: kAvailable keeps the callers' `if constexpr` branches from calling these
constexpr bool kAvailable = false;
inline void pack_key(const uint16_t*, int64_t, int64_t, uint32_t*) {}
inline void pack_value(const uint16_t*, int64_t, int64_t, uint32_t*) {}
inline void score_rows(int64_t, const uint16_t*, int64_t, const uint32_t*, int64_t, float*, int64_t) {}
inline float softmax_row(float*, int64_t, int64_t, float, float, uint16_t*, float*) { return 0.0f; }
inline void value_rows(int64_t, const uint16_t*, int64_t, const uint32_t*, int64_t, int64_t, float*) {}
#endif

}  // namespace prefill_bf16
