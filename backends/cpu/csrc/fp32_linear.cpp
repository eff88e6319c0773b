// fp32 linear for the few activation rows of a decode step (1 to 32 rows), on AVX2 + FMA, over the weight as it
// lies (N, K): no packed copy, so fp32 weight memory stays what the checkpoint holds.
//
// Why: on a 2-core Zen 3 oneDNN's fp32 GEMM ran the built-in model's projections at 16 rows at ~75-100 GFLOP/s
// and MKL's at less, of the ~157 the two cores' FMA units give; a 16-sequence decode step spent 68 of its 91 ms
// in linear layers. A few-row GEMM has too little work per weight byte for a packed-panel kernel to pay for its
// packing, so this one is a register tile of dot products: MR activation rows x NR weight rows, each an 8-lane
// fp32 accumulator over K, summed across lanes at the end. Per 8 columns it loads MR + NR vectors for MR * NR
// fmas (4 x 3: 7 loads, 12 fmas, 15 of the 16 ymm registers), so it runs at the fma units' rate with the
// weight rows in L1 and the activations in L2; the next weight rows are prefetched while the first tile runs,
// which is what lets a 49152-row lm_head overlap its stream from memory with compute. Numerics: each output is
// a plain fp32 sum of the native products in another order (fp32 reassociation, bounded by
// tests/test_cpu_kernels.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"  // immintrin.h, hsum8

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// out[i * n + j] = x[i, :] . w[j, :] + bias[j] for MR rows of x and NR rows of w (both row stride k). While it
// runs, `ahead` (or nothing) is fetched into cache, NR rows of k floats, spread over the loop.
template <int MR, int NR>
inline void tile(const float* x, const float* w, int64_t k, const float* bias, float* out, int64_t n,
                 const float* ahead) {
  const int64_t full = k / 8 * 8;
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < full; c += 8) {
    if (ahead) {  // NR * 32 bytes of the next rows per step: two 64-byte lines cover NR <= 4
      _mm_prefetch(reinterpret_cast<const char*>(ahead + NR * c), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + NR * c + 16), _MM_HINT_T0);
    }
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * k + c);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * k + c);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float v = hsum8(acc[i][j]);
      for (int64_t c = full; c < k; ++c) v += x[i * k + c] * w[j * k + c];
      out[i * n + j] = v + (bias ? bias[j] : 0.f);
    }
}

// All m rows of x against NR rows of w: 4 rows of x at a time, then the 1-3 left.
template <int NR>
void rows_against(const float* x, int64_t m, const float* w, int64_t k, const float* bias, float* out, int64_t n,
                  const float* ahead) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4, ahead = nullptr) tile<4, NR>(x + i * k, w, k, bias, out + i * n, n, ahead);
  switch (m - i) {
    case 3: tile<3, NR>(x + i * k, w, k, bias, out + i * n, n, ahead); break;
    case 2: tile<2, NR>(x + i * k, w, k, bias, out + i * n, n, ahead); break;
    case 1: tile<1, NR>(x + i * k, w, k, bias, out + i * n, n, ahead); break;
  }
}

// Weight rows [r0, r1) in groups of G (3, or 4 for 1-2 activation rows, where the tile has registers to spare).
template <int G>
void weight_rows(const float* x, int64_t m, const float* w, int64_t k, int64_t n, int64_t r0, int64_t r1,
                 const float* bias, float* out) {
  for (int64_t r = r0; r < r1; r += G) {
    const int64_t rows = std::min<int64_t>(G, r1 - r);
    const float* ahead = r + 2 * G <= n ? w + (r + G) * k : nullptr;  // the next group, when it is whole
    const float* b = bias ? bias + r : nullptr;
    if (rows == G) rows_against<G>(x, m, w + r * k, k, b, out + r, n, ahead);
    else if (rows == 3) rows_against<3>(x, m, w + r * k, k, b, out + r, n, ahead);
    else if (rows == 2) rows_against<2>(x, m, w + r * k, k, b, out + r, n, ahead);
    else rows_against<1>(x, m, w + r * k, k, b, out + r, n, ahead);
  }
}

template <int G>
void linear_rows(const float* x, int64_t m, const float* w, int64_t k, int64_t n, const float* bias, float* out) {
  // Threads split the weight rows (each streams its share once); at least ~64 KB of weight per task.
  const int64_t groups = (n + G - 1) / G;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(4 * k * G, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    weight_rows<G>(x, m, w, k, n, g0 * G, std::min(n, g1 * G), bias, out);
  });
}
#endif

}  // namespace

// x (m, K) float32, weight (N, K) float32 contiguous, bias (N,) float32 or none -> (m, N); 1 <= m <= 32. Returns
// an undefined tensor where this build lacks AVX2 + FMA (the caller's next provider serves).
torch::Tensor fp32_linear(const torch::Tensor& x, const torch::Tensor& weight,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat && weight.is_contiguous() && x.size(1) == weight.size(1),
              "fp32_linear: x (m, K) and weight (N, K) float32, weight contiguous");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 32, "fp32_linear takes 1 to 32 rows");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == weight.size(0),
                "bias must be contiguous float32 with one value per output row");
    b = bias->const_data_ptr<float>();
  }
#if defined(__AVX2__) && defined(__FMA__)
  const torch::Tensor xc = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  auto out = torch::empty({m, n}, x.options());
  const float* xp = xc.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  if (m <= 2) linear_rows<4>(xp, m, wp, k, n, b, out.data_ptr<float>());
  else linear_rows<3>(xp, m, wp, k, n, b, out.data_ptr<float>());
  return out;
#else
  return torch::Tensor();
#endif
}
