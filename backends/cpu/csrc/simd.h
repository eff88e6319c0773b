// Small SIMD helpers shared by the kernel sources.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// exp(x) for x <= 0 .. 88: 2^n * p(r) with r = x - n ln2 (Cephes' single-precision coefficients, ~1 ulp).
// Plain arithmetic so that loops over it vectorise; libm's expf does not without -ffast-math. x below -87 gives 0;
// the clamp at -88 keeps -inf (a masked logit) from reaching the integer conversion, where it is undefined.
inline float poly_exp(float x) {
  const float clamped = std::clamp(x, -88.0f, 88.0f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

#if defined(__AVX2__)
// The sum of 8 fp32 lanes.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif
