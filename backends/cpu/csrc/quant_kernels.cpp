// Linear layers over weights kept quantised: GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) and per-channel int8.
//
// Why: a batch-1 decode step reads every weight once, so its time is the bytes of weights read; a Q4_1 weight is
// 5 bits instead of bf16's 16. The kernels dequantise a weight row into fp32 (the value the HAL's native
// dequantiser gives, up to an fma contraction) and dot it with each activation row in fp32, so they differ from
// native (dequantise, then an fp32 matmul) only in summation order. The row buffer stays in L1/L2 and serves every
// activation row, so a weight is unpacked once per call whatever the batch. Large batches go to `dequantize`
// (tiles of weights in the activation dtype) and torch's GEMM instead: see backends/cpu/quant.py.
//
// Block layouts are ggml's (ggml-common.h); hal/quant.py has the same decoders in torch and documents them.
// The decoders are plain loops over fixed-size blocks, written for -march=native auto-vectorisation.
#include <torch/extension.h>

#include "quant_blocks.h"
#include "bf16_panels.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <string>
#include <vector>

namespace {

using resin_quant::f16;
using resin_quant::k_scales;
#if defined(__AVX2__)
using resin_quant::i8x8;
using resin_quant::nibbles;
#endif

#if defined(__AVX512F__)
// 16 bytes -> 16 int32 lanes; the decoders below unpack 16 weights at a time with these.
inline __m512i u8x16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 low4(__m512i v) { return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF))); }
inline __m512 high4(__m512i v) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)); }
#endif

struct Q8_0 {
  static constexpr int kBlock = 32, kBytes = 34;
  static void dequant(const uint8_t* b, float* y) {
    const float d = f16(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
#if defined(__AVX512F__)
    const __m512 vd = _mm512_set1_ps(d);
    for (int i = 0; i < 32; i += 16) {
      const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
      _mm512_storeu_ps(y + i, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(v)));
    }
    return;
#elif defined(__AVX2__)
    const __m256 vd = _mm256_set1_ps(d);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(vd, i8x8(b + 2 + 8 * i)));
    return;
#endif
    for (int i = 0; i < 32; ++i) y[i] = d * q[i];
  }
};

struct Q4_0 {
  static constexpr int kBlock = 32, kBytes = 18;
  static void dequant(const uint8_t* b, float* y) {
    const float d = f16(b);
    const uint8_t* q = b + 2;
#if defined(__AVX512F__)
    const __m512 vd = _mm512_set1_ps(d), eight = _mm512_set1_ps(8.f);
    const __m512i v = u8x16(q);
    _mm512_storeu_ps(y, _mm512_mul_ps(vd, _mm512_sub_ps(low4(v), eight)));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(vd, _mm512_sub_ps(high4(v), eight)));
    return;
#elif defined(__AVX2__)
    const __m256 vd = _mm256_set1_ps(d), eight = _mm256_set1_ps(8.f);
    __m256 w[4];
    nibbles(q, w);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(vd, _mm256_sub_ps(w[i], eight)));
    return;
#endif
    for (int i = 0; i < 16; ++i) {
      y[i] = d * static_cast<float>((q[i] & 0xF) - 8);
      y[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
    }
  }
};

struct Q4_1 {
  static constexpr int kBlock = 32, kBytes = 20;
  static void dequant(const uint8_t* b, float* y) {
    const float d = f16(b), m = f16(b + 2);
    const uint8_t* q = b + 4;
#if defined(__AVX512F__)
    const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    const __m512i v = u8x16(q);
    _mm512_storeu_ps(y, _mm512_fmadd_ps(vd, low4(v), vm));
    _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(vd, high4(v), vm));
    return;
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    __m256 w[4];
    nibbles(q, w);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_fmadd_ps(vd, w[i], vm));
    return;
#endif
    for (int i = 0; i < 16; ++i) {
      y[i] = d * static_cast<float>(q[i] & 0xF) + m;
      y[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
    }
  }
};

struct Q4_K {
  static constexpr int kBlock = 256, kBytes = 144;
  static void dequant(const uint8_t* b, float* y) {
    float scale[8], mins[8];
    k_scales(b + 4, f16(b), f16(b + 2), scale, mins);
    const uint8_t* q = b + 16;
    for (int c = 0; c < 4; ++c, q += 32, y += 64) {  // a 32-byte chunk holds sub-blocks 2c (low) and 2c+1 (high)
      const float s0 = scale[2 * c], m0 = mins[2 * c], s1 = scale[2 * c + 1], m1 = mins[2 * c + 1];
#if defined(__AVX512F__)
      for (int l = 0; l < 32; l += 16) {
        const __m512i v = u8x16(q + l);
        _mm512_storeu_ps(y + l, _mm512_fmsub_ps(_mm512_set1_ps(s0), low4(v), _mm512_set1_ps(m0)));
        _mm512_storeu_ps(y + l + 32, _mm512_fmsub_ps(_mm512_set1_ps(s1), high4(v), _mm512_set1_ps(m1)));
      }
      continue;
#endif
      for (int l = 0; l < 32; ++l) {
        y[l] = s0 * static_cast<float>(q[l] & 0xF) - m0;
        y[l + 32] = s1 * static_cast<float>(q[l] >> 4) - m1;
      }
    }
  }
};

struct Q5_K {
  static constexpr int kBlock = 256, kBytes = 176;
  static void dequant(const uint8_t* b, float* y) {
    float scale[8], mins[8];
    k_scales(b + 4, f16(b), f16(b + 2), scale, mins);
    const uint8_t* qh = b + 16;  // bit j of byte l: the fifth bit of weight l of sub-block j
    const uint8_t* q = b + 48;
    for (int c = 0; c < 4; ++c, q += 32, y += 64) {
      const float s0 = scale[2 * c], m0 = mins[2 * c], s1 = scale[2 * c + 1], m1 = mins[2 * c + 1];
#if defined(__AVX512F__)
      const __m512i one = _mm512_set1_epi32(1), lo_mask = _mm512_set1_epi32(0xF);
      for (int l = 0; l < 32; l += 16) {
        const __m512i v = u8x16(q + l), h = u8x16(qh + l);
        const __m512i h0 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * c), one), 4);
        const __m512i h1 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * c + 1), one), 4);
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_and_si512(v, lo_mask), h0));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_srli_epi32(v, 4), h1));
        _mm512_storeu_ps(y + l, _mm512_fmsub_ps(_mm512_set1_ps(s0), w0, _mm512_set1_ps(m0)));
        _mm512_storeu_ps(y + l + 32, _mm512_fmsub_ps(_mm512_set1_ps(s1), w1, _mm512_set1_ps(m1)));
      }
      continue;
#endif
      for (int l = 0; l < 32; ++l) {
        const int h0 = ((qh[l] >> (2 * c)) & 1) << 4, h1 = ((qh[l] >> (2 * c + 1)) & 1) << 4;
        y[l] = s0 * static_cast<float>((q[l] & 0xF) | h0) - m0;
        y[l + 32] = s1 * static_cast<float>((q[l] >> 4) | h1) - m1;
      }
    }
  }
};

struct Q6_K {
  static constexpr int kBlock = 256, kBytes = 210;
  static void dequant(const uint8_t* b, float* y) {
    const float d = f16(b + 208);
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
#if defined(__AVX512F__)
      const __m512i three = _mm512_set1_epi32(3), lo_mask = _mm512_set1_epi32(0xF), bias = _mm512_set1_epi32(32);
      for (int l = 0; l < 32; l += 16) {  // the 16 weights of each output group share one scale
        const int is = l / 16;
        const __m512i a = u8x16(ql + l), b2 = u8x16(ql + l + 32), h = u8x16(qh + l);
        const __m512i q[4] = {
            _mm512_or_si512(_mm512_and_si512(a, lo_mask), _mm512_slli_epi32(_mm512_and_si512(h, three), 4)),
            _mm512_or_si512(_mm512_and_si512(b2, lo_mask),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2), three), 4)),
            _mm512_or_si512(_mm512_srli_epi32(a, 4),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 4), three), 4)),
            _mm512_or_si512(_mm512_srli_epi32(b2, 4),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 6), three), 4))};
        for (int g = 0; g < 4; ++g) {
          const __m512 scale = _mm512_set1_ps(d * static_cast<float>(sc[is + 2 * g]));
          _mm512_storeu_ps(y + l + 32 * g, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_sub_epi32(q[g], bias))));
        }
      }
      continue;
#endif
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
    }
  }
};

// Per-channel int8: the row's scale is applied to the dot product, not to each weight.
struct Int8 {
  static constexpr int kBlock = 32, kBytes = 32;
  static void dequant(const uint8_t* b, float* y) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b);
    for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(q[i]);
  }
};

template <class F>
void dequant_row(const uint8_t* row, int64_t k, float* y) {
  const int64_t full = k / F::kBlock;
  for (int64_t b = 0; b < full; ++b) F::dequant(row + b * F::kBytes, y + b * F::kBlock);
  if constexpr (std::is_same_v<F, Int8>) {  // int8 rows need not fill whole 32-weight chunks
    for (int64_t i = full * F::kBlock; i < k; ++i) y[i] = static_cast<float>(reinterpret_cast<const int8_t*>(row)[i]);
  }
}

// dot(a, b) over k floats with 32 independent partial sums, so the compiler vectorises it.
inline float dot(const float* a, const float* b, int64_t k) {
  float acc[32] = {0};
  int64_t i = 0;
  for (; i + 32 <= k; i += 32)
    for (int j = 0; j < 32; ++j) acc[j] += a[i + j] * b[i + j];
  float tail = 0.f;
  for (; i < k; ++i) tail += a[i] * b[i];
  float s = 0.f;
  for (int j = 0; j < 32; ++j) s += acc[j];
  return s + tail;
}

template <class F, typename out_t>
void matmul_kernel(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t n,
                   const float* scales, const float* bias, out_t* out) {
  // ~64 KiB of weights per task: enough work to amortise a task, enough tasks to balance two to many cores.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> wrow(k);
    for (int64_t r = n0; r < n1; ++r) {
      dequant_row<F>(w + r * row_bytes, k, wrow.data());
      const float s = scales ? scales[r] : 1.f, b = bias ? bias[r] : 0.f;
      for (int64_t i = 0; i < m; ++i) out[i * n + r] = static_cast<out_t>(dot(wrow.data(), x + i * k, k) * s + b);
    }
  });
}

template <class F, typename out_t>
void dequant_kernel(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t k, const float* scales, out_t* out) {
  at::parallel_for(0, n, std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row_bytes, 1)),
                   [&](int64_t n0, int64_t n1) {
    std::vector<float> wrow(k);
    for (int64_t r = n0; r < n1; ++r) {
      dequant_row<F>(w + r * row_bytes, k, wrow.data());
      const float s = scales ? scales[r] : 1.f;
      for (int64_t i = 0; i < k; ++i) out[r * k + i] = static_cast<out_t>(wrow[i] * s);
    }
  });
}

template <typename Fn>
void dispatch_format(const std::string& qtype, Fn&& fn) {
  if (qtype == "q8_0") return fn(Q8_0{});
  if (qtype == "q4_0") return fn(Q4_0{});
  if (qtype == "q4_1") return fn(Q4_1{});
  if (qtype == "q4_k") return fn(Q4_K{});
  if (qtype == "q5_k") return fn(Q5_K{});
  if (qtype == "q6_k") return fn(Q6_K{});
  if (qtype == "int8") return fn(Int8{});
  TORCH_CHECK(false, "quantisation type ", qtype, " has no kernel");
}

int64_t in_features(const at::Tensor& qweight, const std::string& qtype) {
  int64_t k = 0;
  dispatch_format(qtype, [&](auto f) {
    using F = decltype(f);
    k = std::is_same_v<F, Int8> ? qweight.size(1) : qweight.size(1) / F::kBytes * F::kBlock;
  });
  return k;
}

const float* optional_floats(const c10::optional<at::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n, name,
              " must be contiguous float32 with one value per output row");
  return t->const_data_ptr<float>();
}


#if defined(__AVX512BF16__)
// The bf16 fast path for few rows, for Q4_0, Q4_1, Q8_0 (the built-in model's types) and Q4_K (most of a
// Q4_K_M file): each group of 32 quants becomes 32 exact bf16 values (a 4-bit code through a 32-entry table, an
// int8 through fp32) that vdpbf16ps multiplies with 32 bf16 activations, exactly, summing in fp32; the group's
// scale is applied to that partial sum and its min to the group's activation sum. So a weight costs a few
// instructions and no unpacked copy: the same products as native's fp32 matmul over bf16 inputs, summed in
// another order. Q8_0 and Q4_K go through fused_rows a block at a time; Q4_0 and Q4_1 through pair_rows, two
// blocks at a time.

// Entry i holds bf16((i & 15) + offset): vpermw reads 5 index bits, and a low-nibble lane may carry bit 4.
inline __m512i bf16_table(int offset) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = c10::BFloat16(static_cast<float>((i & 15) + offset)).x;
  return _mm512_load_si512(t);
}

// The sum of a group of 32 bf16 activations, which a block's min multiplies.
inline float group_sum(const uint16_t* x) {
  float s = 0.f;
  for (int j = 0; j < 32; ++j) s += static_cast<float>(c10::BFloat16(x[j], c10::BFloat16::from_bits()));
  return s;
}

// A decoder turns one stored block into kUnits groups of 32 quants as bf16 (exact), each with its scale and the
// term that multiplies the group's activation sum (minus a Q4_K sub-block's min): w = scale * q + min.
struct FusedQ8_0 {
  static constexpr int kBytes = 34, kUnits = 1;
  static constexpr bool kMin = false;
  void block(const uint8_t* b, __m512i* wq, float* scale, float*) const {
    scale[0] = f16(b);
    const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    wq[0] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // int8 values are exact in bf16
  }
};

// Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins; a 32-byte chunk holds sub-blocks 2c (low nibbles, byte l
// is weight l) and 2c + 1 (high nibbles), so one widening load serves two sub-blocks.
struct FusedQ4_K {
  static constexpr int kBytes = 144, kUnits = 8;
  static constexpr bool kMin = true;
  __m512i table = bf16_table(0);
  void block(const uint8_t* b, __m512i* wq, float* scale, float* mins) const {
    k_scales(b + 4, f16(b), f16(b + 2), scale, mins);
    for (int j = 0; j < 8; ++j) mins[j] = -mins[j];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c)));
      wq[2 * c] = _mm512_permutexvar_epi16(v, table);
      wq[2 * c + 1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
    }
  }
};

template <class D, int MR, typename out_t>
void fused_rows(const D& dec, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint16_t* x,
                int64_t k, const float* xsum, const float* bias, out_t* out, int64_t n) {
  const int64_t nb = k / 32, blocks = nb / D::kUnits;
  // Two sums per activation row, for even and odd groups: with one, every group waited for the previous group's
  // fma (4 cycles), which was most of a one-row call's time.
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    __m512 acc[MR][2];
    float macc[MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps(), macc[i][0] = macc[i][1] = 0.f;
    auto run = [&](int64_t blk, int parity) {
      __m512i wq[D::kUnits];
      float scale[D::kUnits], mins[D::kUnits];
      dec.block(row + blk * D::kBytes, wq, scale, mins);
#pragma GCC unroll 8
      for (int u = 0; u < D::kUnits; ++u) {
        const int c = (parity + u) & 1;
        const int64_t unit = blk * D::kUnits + u;
        const __m512 vd = _mm512_set1_ps(scale[u]);
        for (int i = 0; i < MR; ++i) {
          const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + i * k + unit * 32));
          acc[i][c] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), reinterpret_cast<__m512bh>(wq[u]), xv),
                                      vd, acc[i][c]);
          if constexpr (D::kMin) macc[i][c] += mins[u] * xsum[i * nb + unit];
        }
      }
    };
    int64_t blk = 0;
    for (; blk + 2 <= blocks; blk += 2) run(blk, 0), run(blk + 1, 1);
    if (blk < blocks) run(blk, 0);
    const float bb = bias ? bias[r] : 0.f;
    for (int i = 0; i < MR; ++i)
      out[i * n + r] = static_cast<out_t>(_mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1])) +
                                          (macc[i][0] + macc[i][1]) + bb);
  }
}

template <class D>
void fused_matmul(const at::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t n, const float* bias,
                  at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), nb = k / 32;
  const auto* xb = reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>());
  std::vector<float> xsum(D::kMin ? m * nb : 0);  // a min multiplies its group's activation sum
  if constexpr (D::kMin)
    for (int64_t i = 0; i < m * nb; ++i) xsum[i] = group_sum(xb + i * 32);
  const D dec;
  auto* o = out.data_ptr<c10::BFloat16>();
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    int64_t i = 0;
    for (; i + 8 <= m; i += 8)  // rows in groups share each unpacked block
      fused_rows<D, 8>(dec, w, row_bytes, r0, r1, xb + i * k, k, xsum.data() + i * nb, bias, o + i * n, n);
    for (; i + 4 <= m; i += 4)
      fused_rows<D, 4>(dec, w, row_bytes, r0, r1, xb + i * k, k, xsum.data() + i * nb, bias, o + i * n, n);
    for (; i < m; ++i)
      fused_rows<D, 1>(dec, w, row_bytes, r0, r1, xb + i * k, k, xsum.data() + i * nb, bias, o + i * n, n);
  });
}

// Q4_0 and Q4_1 two blocks at a time: the 16 quant bytes of blocks a and b widen into one vector of 32 words, and
// two table lookups give a's and b's low nibbles (weights 0-15 of each) and their high nibbles (weights 16-31).
// The activations are reordered once per call to match ([a 0-15, b 0-15], [a 16-31, b 16-31]), so after two
// vdpbf16ps sums lanes 0-7 belong to a and 8-15 to b, and one multiply by [d_a x8, d_b x8] scales both. Half the
// instructions per block of the one-block loop above, which was compute-bound (13-15 GB/s from cache).
template <bool kMin>  // Q4_1 (scale, min, quants) when true, Q4_0 (scale, quants) when false
struct NibblePairs {
  static constexpr int kHead = kMin ? 4 : 2, kBytes = kHead + 16;
  const __m512i table = bf16_table(kMin ? 0 : -8);
  const __m512i spread = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  // b is null for a row's odd last block (its lanes then hold zero weights with zero scale).
  void decode(const uint8_t* a, const uint8_t* b, __m512i& lo, __m512i& hi, __m512& scale, __m128& dm) const {
    const __m128i qa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + kHead));
    const __m128i qb = b ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kHead)) : _mm_setzero_si128();
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1));
    lo = _mm512_permutexvar_epi16(w, table);
    hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
    int32_t ha = 0, hb = 0;
    std::memcpy(&ha, a, kHead);
    if (b) std::memcpy(&hb, b, kHead);
    dm = _mm_cvtph_ps(_mm_set_epi32(0, 0, hb, ha));  // (d_a, m_a, d_b, m_b); m = 0 for Q4_0
    scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(dm));
  }
};

template <class D, int MR, typename out_t>
void pair_rows(const D& dec, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint16_t* xp,
               int64_t kp, const float* xs, const float* bias, out_t* out, int64_t n, int64_t nb) {
  const int64_t pairs = (nb + 1) / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    __m512 acc[MR][2];
    __m128 macc[MR][2];
    for (int i = 0; i < MR; ++i)
      acc[i][0] = acc[i][1] = _mm512_setzero_ps(), macc[i][0] = macc[i][1] = _mm_setzero_ps();
    auto run = [&](int64_t p, int c) {
      __m512i lo, hi;
      __m512 scale;
      __m128 dm;
      const uint8_t* a = row + 2 * p * D::kBytes;
      dec.decode(a, 2 * p + 1 < nb ? a + D::kBytes : nullptr, lo, hi, scale, dm);
      for (int i = 0; i < MR; ++i) {
        const uint16_t* x = xp + i * kp + p * 64;
        const __m512 t = _mm512_dpbf16_ps(
            _mm512_dpbf16_ps(_mm512_setzero_ps(), reinterpret_cast<__m512bh>(lo),
                             reinterpret_cast<__m512bh>(_mm512_loadu_si512(x))),
            reinterpret_cast<__m512bh>(hi), reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + 32)));
        acc[i][c] = _mm512_fmadd_ps(t, scale, acc[i][c]);
        if constexpr (D::kHead == 4) macc[i][c] = _mm_fmadd_ps(dm, _mm_loadu_ps(xs + (i * pairs + p) * 4), macc[i][c]);
      }
    };
    int64_t p = 0;
    for (; p + 2 <= pairs; p += 2) run(p, 0), run(p + 1, 1);
    if (p < pairs) run(p, 0);
    const float bb = bias ? bias[r] : 0.f;
    for (int i = 0; i < MR; ++i) {
      const __m128 m4 = _mm_add_ps(macc[i][0], macc[i][1]);
      const __m128 m2 = _mm_add_ps(m4, _mm_movehl_ps(m4, m4));
      out[i * n + r] = static_cast<out_t>(_mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1])) +
                                          _mm_cvtss_f32(_mm_add_ss(m2, _mm_movehdup_ps(m2))) + bb);
    }
  }
}

template <class D>
void pair_matmul(const at::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t n, const float* bias,
                 at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), nb = k / 32, pairs = (nb + 1) / 2, kp = pairs * 64;
  const auto* xb = reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>());
  // Each row reordered pair by pair to the decoded weights' order (zeros past an odd last block), and for Q4_1
  // the block sums (0, s_a, 0, s_b) that meet (d_a, m_a, d_b, m_b): a min multiplies its block's activation sum.
  std::vector<uint16_t> xp(m * kp, 0);
  std::vector<float> xs(D::kHead == 4 ? m * pairs * 4 : 0, 0.f);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t blk = 0; blk < nb; ++blk) {
      const uint16_t* src = xb + i * k + blk * 32;
      uint16_t* dst = xp.data() + i * kp + (blk / 2) * 64 + (blk % 2) * 16;
      std::memcpy(dst, src, 32);
      std::memcpy(dst + 32, src + 16, 32);
      if constexpr (D::kHead == 4) xs[(i * pairs + blk / 2) * 4 + (blk % 2) * 2 + 1] = group_sum(src);
    }
  const D dec;
  auto* o = out.data_ptr<c10::BFloat16>();
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    int64_t i = 0;
    for (; i + 4 <= m; i += 4)  // rows in groups share each decoded pair
      pair_rows<D, 4>(dec, w, row_bytes, r0, r1, xp.data() + i * kp, kp, xs.data() + i * pairs * 4, bias,
                      o + i * n, n, nb);
    for (; i + 2 <= m; i += 2)
      pair_rows<D, 2>(dec, w, row_bytes, r0, r1, xp.data() + i * kp, kp, xs.data() + i * pairs * 4, bias,
                      o + i * n, n, nb);
    for (; i < m; ++i)
      pair_rows<D, 1>(dec, w, row_bytes, r0, r1, xp.data() + i * kp, kp, xs.data() + i * pairs * 4, bias,
                      o + i * n, n, nb);
  });
}

bool try_fused(const at::Tensor& x, const at::Tensor& qweight, const std::string& qtype, const float* scales,
               const float* bias, at::Tensor& out) {
  if (x.scalar_type() != at::kBFloat16 || scales != nullptr || !x.is_contiguous()) return false;
  const auto* w = static_cast<const uint8_t*>(qweight.const_data_ptr());
  if (qtype == "q4_0") pair_matmul<NibblePairs<false>>(x, w, qweight.size(1), qweight.size(0), bias, out);
  else if (qtype == "q4_1") pair_matmul<NibblePairs<true>>(x, w, qweight.size(1), qweight.size(0), bias, out);
  else if (qtype == "q8_0") fused_matmul<FusedQ8_0>(x, w, qweight.size(1), qweight.size(0), bias, out);
  else if (qtype == "q4_k") fused_matmul<FusedQ4_K>(x, w, qweight.size(1), qweight.size(0), bias, out);
  else return false;
  return true;
}
#else
bool try_fused(const at::Tensor&, const at::Tensor&, const std::string&, const float*, const float*, at::Tensor&) {
  return false;
}
#endif

#if defined(__AVX512BF16__)
// Batches of rows (decode at 8-63 sequences): a register-blocked GEMM over panels of 32 weight rows. Each panel is
// unpacked once per call into bf16 (rounded, as the GEMM path's unpacked tiles are) and laid out as (K/2) x 32 pairs
// of adjacent weights, so one vdpbf16ps multiplies a pair of an activation row (broadcast) with 16 output rows and
// sums stay per output lane: no horizontal reductions and outputs stored 16 at a time. 24 sums in registers
// (12 activation rows x 32 outputs) per pass; the panel (36-98 KiB at these K) stays in L2 while every activation
// row passes over it. torch's GEMM instead reorders its whole weight operand on every call, which at these batch
// sizes costs more than the products.
constexpr int kPanel = 32;      // weight rows per panel: two vectors of 16 outputs
constexpr int kRowsBlock = 12;  // activation rows per pass

// r[i] lane j -> r[j] lane i, for 16 vectors of 16 32-bit lanes: pairs within 128-bit lanes, then 128-bit lanes.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // r[g + j], per 128-bit lane L: rows g..g+3 of column 4L + j
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // column 4L + j gathers lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
    const __m512i s0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), s1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// A Q4_0 / Q4_1 row of k weights straight to bf16 (times s, rounded once): each block's 16 possible values
// computed as its dequantiser computes them (d (q - 8), or d q + m by one fma), scaled and rounded into a table,
// then its 32 quants looked up by one vpermw. The same bits as dequantising every weight and rounding it, with
// half the arithmetic and no fp32 copy of the row (2-core Zen 4, the built-in model's 30 layers of projections at
// 32 rows, random blocks, one process: Q4_1 25.1 -> 24.2 ms a pass, Q4_0 25.1 -> 23.3).
template <class F>
void lookup_row(const uint8_t* row, int64_t k, __m512 s, uint16_t* dst) {
  constexpr int64_t kQuantsAt = std::is_same_v<F, Q4_1> ? 4 : 2;  // a block: d (and m) as fp16, then the quants
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint8_t* block = row + b * F::kBytes;
    const __m512 d = _mm512_set1_ps(f16(block));
    const __m512 values = std::is_same_v<F, Q4_1> ? _mm512_fmadd_ps(d, iota, _mm512_set1_ps(f16(block + 2)))
                                                  : _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    const __m512i table =
        _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(values, s))));
    // byte i holds quant i (low nibble) and quant i + 16 (high): as words, quants 0-15 then 16-31
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kQuantsAt)));
    const __m512i quants = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(0xF))), _mm256_srli_epi16(bytes, 4), 1);
    _mm512_storeu_si512(dst + 32 * b, _mm512_permutexvar_epi16(quants, table));
  }
}

// Weight rows [r0, r0 + 32) (zeros past n) -> panel[p * 32 + j] = bf16 weights 2p, 2p + 1 of row r0 + j.
template <class F>
void pack_panel(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t r0, int64_t k, const float* scales,
                float* f, uint16_t* rows, uint32_t* panel) {
  for (int j = 0; j < kPanel; ++j) {
    uint16_t* dst = rows + j * k;
    if (r0 + j >= n) {
      std::memset(dst, 0, k * sizeof(uint16_t));
      continue;
    }
    const __m512 s = _mm512_set1_ps(scales ? scales[r0 + j] : 1.f);
    if constexpr (std::is_same_v<F, Q4_1> || std::is_same_v<F, Q4_0>) {
      lookup_row<F>(w + (r0 + j) * row_bytes, k, s, dst);
      continue;
    }
    dequant_row<F>(w + (r0 + j) * row_bytes, k, f);
    for (int64_t kk = 0; kk < k; kk += 32) {
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(f + kk), s);
      const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(f + kk + 16), s);
      _mm512_storeu_si512(dst + kk, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
  __m512i r[16];
  for (int64_t c = 0; c < k / 32; ++c)  // 16 pairs of 16 rows at a time
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows + (16 * h + i) * k + 32 * c);
      transpose16(r);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(panel + (16 * c + p) * kPanel + 16 * h, r[p]);
    }
}

template <class F>
void bf16_rows_kernel(const uint16_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t n,
                      const float* scales, const float* bias, c10::BFloat16* out) {
  at::parallel_for(0, (n + kPanel - 1) / kPanel, 1, [&](int64_t q0, int64_t q1) {
    std::vector<float> f(k);
    std::vector<uint16_t> rows(kPanel * k);
    std::vector<uint32_t> panel(kPanel * k / 2);
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t r0 = q * kPanel;
      pack_panel<F>(w, row_bytes, n, r0, k, scales, f.data(), rows.data(), panel.data());
      const int valid = static_cast<int>(std::min<int64_t>(kPanel, n - r0));
      resin_panels::panel_rows<kPanel / 16, kRowsBlock>(panel.data(), m, k, x, bias, r0, valid, out, n);
    }
  });
}

// The same panels multiplied on AMX tiles: a panel is already in the layout torch's brgemm ukernel takes for a
// bf16 B matrix (pairs of K interleaved per output, [K/2][kPanel][2]), so each is one brgemm call per block of
// activation rows, fp32 sums rounded to bf16 once with the bias. Only where cpublas packs bf16 (AMX).
constexpr int64_t kAmxRows = 256;  // activation rows per brgemm call

template <typename F>
void amx_rows_kernel(const uint16_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t n,
                     const float* scales, const float* bias, c10::BFloat16* out) {
  at::parallel_for(0, (n + kPanel - 1) / kPanel, 1, [&](int64_t q0, int64_t q1) {
    std::vector<float> f(k), c(std::min(m, kAmxRows) * kPanel);
    std::vector<uint16_t> rows(kPanel * k);
    std::vector<uint32_t> panel(kPanel * k / 2);
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t r0 = q * kPanel;
      pack_panel<F>(w, row_bytes, n, r0, k, scales, f.data(), rows.data(), panel.data());
      const int64_t valid = std::min<int64_t>(kPanel, n - r0);
      for (int64_t i = 0; i < m; i += kAmxRows) {
        const int64_t mr = std::min(kAmxRows, m - i);
        at::native::cpublas::brgemm(mr, kPanel, k, k, kPanel, kPanel, false,
                                    reinterpret_cast<const at::BFloat16*>(x + i * k),
                                    reinterpret_cast<const at::BFloat16*>(panel.data()), c.data());
        for (int64_t t = 0; t < mr; ++t)
          for (int64_t j = 0; j < valid; ++j)
            out[(i + t) * n + r0 + j] = c10::BFloat16(c[t * kPanel + j] + (bias ? bias[r0 + j] : 0.f));
      }
    }
    at::native::cpublas::brgemm_release();
  });
}
#endif

}  // namespace

// out (M, N) = x (M, K) @ dequantize(qweight).T * scales + bias, in x's dtype; scales and bias float32.
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& qweight, const std::string& qtype,
                        const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && qweight.is_contiguous(), "x (M, K), qweight (N, row bytes)");
  const int64_t m = x.size(0), n = qweight.size(0), k = in_features(qweight, qtype);
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " features, the weight ", k);
  at::Tensor out = at::empty({m, n}, x.options());
  const float* s = optional_floats(scales, n, "scales");
  const float* b = optional_floats(bias, n, "bias");
  if (try_fused(x, qweight, qtype, s, b, out)) return out;
  if (s == nullptr && resin_quant::fma_rows_matmul(x, qweight, qtype, b, out)) return out;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  dispatch_format(qtype, [&](auto f) {
    using F = decltype(f);
    const auto* w = static_cast<const uint8_t*>(qweight.const_data_ptr());
    if (out.scalar_type() == at::kFloat)
      matmul_kernel<F>(xf.const_data_ptr<float>(), m, k, w, qweight.size(1), n, s, b, out.data_ptr<float>());
    else if (out.scalar_type() == at::kBFloat16)
      matmul_kernel<F>(xf.const_data_ptr<float>(), m, k, w, qweight.size(1), n, s, b, out.data_ptr<c10::BFloat16>());
    else
      TORCH_CHECK(false, "quant_matmul: x must be float32 or bfloat16");
  });
  return out;
}

// (N, K) weights in `dtype` (float32 or bfloat16), rows scaled by scales where given.
at::Tensor quant_dequantize(const at::Tensor& qweight, const std::string& qtype,
                            const c10::optional<at::Tensor>& scales, at::ScalarType dtype) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight (N, row bytes), contiguous");
  const int64_t n = qweight.size(0), k = in_features(qweight, qtype);
  at::Tensor out = at::empty({n, k}, qweight.options().dtype(dtype));
  const float* s = optional_floats(scales, n, "scales");
  dispatch_format(qtype, [&](auto f) {
    using F = decltype(f);
    const auto* w = static_cast<const uint8_t*>(qweight.const_data_ptr());
    if (dtype == at::kFloat)
      dequant_kernel<F>(w, qweight.size(1), n, k, s, out.data_ptr<float>());
    else if (dtype == at::kBFloat16)
      dequant_kernel<F>(w, qweight.size(1), n, k, s, out.data_ptr<c10::BFloat16>());
    else
      TORCH_CHECK(false, "quant_dequantize: dtype must be float32 or bfloat16");
  });
  return out;
}

// out (M, N) bf16 = x (M, K) bf16 @ bf16(dequantize(qweight) * scales).T + bias, for batches of rows; returns an
// undefined tensor where the CPU lacks AVX512-BF16 or K is not a multiple of 32 (the caller then uses the GEMM).
// amx: multiply the panels on AMX tiles through torch's brgemm (undefined where cpublas cannot pack bf16).
at::Tensor quant_matmul_bf16(const at::Tensor& x, const at::Tensor& qweight, const std::string& qtype,
                             const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias,
                             bool amx) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && qweight.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x (M, K) bfloat16, qweight (N, row bytes)");
  const int64_t m = x.size(0), n = qweight.size(0), k = in_features(qweight, qtype);
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " features, the weight ", k);
#if defined(__AVX512BF16__)
  if (amx && !at::native::cpublas::could_pack(at::kBFloat16)) return at::Tensor();
  if (k % 32 == 0) {
    const at::Tensor xc = x.contiguous();
    at::Tensor out = at::empty({m, n}, x.options());
    const float* s = optional_floats(scales, n, "scales");
    const float* b = optional_floats(bias, n, "bias");
    dispatch_format(qtype, [&](auto f) {
      using F = decltype(f);
      (amx ? amx_rows_kernel<F> : bf16_rows_kernel<F>)(
          reinterpret_cast<const uint16_t*>(xc.const_data_ptr<c10::BFloat16>()), m, k,
          static_cast<const uint8_t*>(qweight.const_data_ptr()), qweight.size(1), n, s, b,
          out.data_ptr<c10::BFloat16>());
    });
    return out;
  }
#endif
  return at::Tensor();
}
