// What the quantised-linear kernels share: a block's fp16 scale, the K-quants' packed (scale, min) pairs, and the
// entry point of the AVX2/FMA row kernel (quant_fma_rows.cpp), which quant_kernels.cpp's dispatcher calls.
#pragma once

#include <torch/extension.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <string>
#if defined(__F16C__)
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
