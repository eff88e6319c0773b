// What the quantised-linear kernels share: a block's fp16 scale, the K-quants' packed (scale, min) pairs, and the
// entry point of the AVX2/FMA row kernel (quant_fma_rows.cpp), which quant_kernels.cpp's dispatcher calls.
#pragma once

#include <torch/extension.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <string>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace resin_quant {

// A block's fp16 scale. One F16C instruction where the CPU has it: c10's portable conversion is a dozen integer
// operations, which at two scales per 32 weights was most of a Q4_1 block's cost.
inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

#if defined(__AVX2__)
// 8 bytes -> 8 int32 lanes.
inline __m256i u8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Q4_0 / Q4_1 quants as exact fp32 integers, in weight order: byte j holds weight j in its low nibble and weight
// j + 16 in its high one.
inline void nibbles(const uint8_t* q, __m256* w) {
  const __m256i mask = _mm256_set1_epi32(0xF), a = u8x8(q), b = u8x8(q + 8);
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
  w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
  w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
  w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

// Q8_0 quants: 8 signed bytes -> 8 exact fp32 integers.
inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// The 8 six-bit (scale, min) pairs of a Q4_K / Q5_K super-block, packed into 12 bytes.
inline void k_scales(const uint8_t* s, float d, float dmin, float* scale, float* mins) {
  for (int j = 0; j < 4; ++j) {
    scale[j] = d * static_cast<float>(s[j] & 63);
    mins[j] = dmin * static_cast<float>(s[j + 4] & 63);
    scale[j + 4] = d * static_cast<float>((s[j + 8] & 0xF) | ((s[j] >> 6) << 4));
    mins[j + 4] = dmin * static_cast<float>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
  }
}

// out = x @ dequantize(qweight).T + bias for few rows of x (float32 or bfloat16, contiguous), Q4_0, Q4_1, Q8_0 and
// Q4_K, on AVX2 + FMA: false (out untouched) where this build lacks them or the type has no kernel here.
bool fma_rows_matmul(const at::Tensor& x, const at::Tensor& qweight, const std::string& qtype, const float* bias,
                     at::Tensor& out);

}  // namespace resin_quant
