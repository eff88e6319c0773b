// Few activation rows (decode) times GGUF weights kept quantised, on AVX2 + FMA: the x86-64 CPUs without
// AVX512-BF16 (AMD Zen 2/3, Intel before Cooper Lake), in fp32 or bf16, and fp32 activations everywhere.
//
// Why: the portable path dequantises a weight row into an fp32 buffer and then dots it with each activation row;
// on a Zen 3 core that moved Q4_1 at ~2 GB/s, a tenth of what the memory gives, and a batch-1 step of the
// built-in model took 38 ms in quant_linear. Here each group of 32 quants becomes four vectors of exact small
// integers in fp32 (no buffer), multiplied with 32 activations by fma; the group's scale multiplies that partial
// sum and its min the group's activation sum (w = scale * q + min). The products q * x are native's products
// (exact for bf16 activations, one rounding for fp32), summed in another order: fp32 reassociation, which
// tests/test_quant_kernels.py bounds. Q4_0 is Q4_1 with min = -8 * scale.
#include "quant_blocks.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace resin_quant {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
namespace {

// A decoder reads a stored block's scales (head) and gives each of its kUnits groups of 32 quants as four
// vectors of 8 in weight order (unit); kMin: the type has a per-group term times the group's activation sum.
struct Q4_0Rows {
  static constexpr int kBytes = 18, kUnits = 1;
  static constexpr bool kMin = true;
  void head(const uint8_t* b, float* scale, float* mins) const { scale[0] = f16(b), mins[0] = -8.f * scale[0]; }
  void unit(const uint8_t* b, int, __m256* w) const { nibbles(b + 2, w); }
};

struct Q4_1Rows {
  static constexpr int kBytes = 20, kUnits = 1;
  static constexpr bool kMin = true;
  void head(const uint8_t* b, float* scale, float* mins) const {
    int32_t dm;  // (d, m): both fp16 scales by one conversion
    std::memcpy(&dm, b, 4);
    const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
    scale[0] = _mm_cvtss_f32(v), mins[0] = _mm_cvtss_f32(_mm_movehdup_ps(v));
  }
  void unit(const uint8_t* b, int, __m256* w) const { nibbles(b + 4, w); }
};

struct Q8_0Rows {
  static constexpr int kBytes = 34, kUnits = 1;
  static constexpr bool kMin = false;
  void head(const uint8_t* b, float* scale, float*) const { scale[0] = f16(b); }
  void unit(const uint8_t* b, int, __m256* w) const {
    for (int i = 0; i < 4; ++i) w[i] = i8x8(b + 2 + 8 * i);
  }
};

// Q4_K: 8 groups of 32 with 6-bit scales and mins; 32-byte chunk c holds group 2c in its low nibbles and group
// 2c + 1 in its high ones, byte l being weight l of each.
struct Q4_KRows {
  static constexpr int kBytes = 144, kUnits = 8;
  static constexpr bool kMin = true;
  void head(const uint8_t* b, float* scale, float* mins) const {
    k_scales(b + 4, f16(b), f16(b + 2), scale, mins);
    for (int j = 0; j < 8; ++j) mins[j] = -mins[j];
  }
  void unit(const uint8_t* b, int u, __m256* w) const {
    const uint8_t* q = b + 16 + 32 * (u / 2);
    const __m256i mask = _mm256_set1_epi32(0xF);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = u8x8(q + 8 * i);
      w[i] = _mm256_cvtepi32_ps((u & 1) ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, mask));
    }
  }
};

// out[i * n + r] for weight rows [r0, r1) and MR activation rows (x: MR x k fp32; xs: their group sums).
template <class D, int MR, typename out_t>
void fma_rows(const D& dec, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const float* x, int64_t k,
              const float* xs, const float* bias, out_t* out, int64_t n) {
  const int64_t groups = k / 32, blocks = groups / D::kUnits;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    // Two sums per activation row, for even and odd groups, so consecutive groups' fmas do not wait on each other.
    __m256 acc[MR][2];
    float macc[MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps(), macc[i][0] = macc[i][1] = 0.f;
    auto run = [&](int64_t blk, int parity) {
      const uint8_t* b = row + blk * D::kBytes;
      float scale[D::kUnits], mins[D::kUnits];
      dec.head(b, scale, mins);
#pragma GCC unroll 8
      for (int u = 0; u < D::kUnits; ++u) {
        __m256 wv[4];
        dec.unit(b, u, wv);
        const int c = (parity + u) & 1;
        const int64_t g = blk * D::kUnits + u;
        const __m256 vd = _mm256_set1_ps(scale[u]);
        for (int i = 0; i < MR; ++i) {
          const float* xi = x + i * k + g * 32;
          __m256 t = _mm256_mul_ps(wv[0], _mm256_loadu_ps(xi));
          t = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xi + 8), t);
          t = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xi + 16), t);
          t = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xi + 24), t);
          acc[i][c] = _mm256_fmadd_ps(t, vd, acc[i][c]);
          if constexpr (D::kMin) macc[i][c] += mins[u] * xs[i * groups + g];
        }
      }
    };
    int64_t blk = 0;
    for (; blk + 2 <= blocks; blk += 2) run(blk, 0), run(blk + 1, 1);
    if (blk < blocks) run(blk, 0);
    const float bb = bias ? bias[r] : 0.f;
    for (int i = 0; i < MR; ++i)
      out[i * n + r] = static_cast<out_t>(hsum8(_mm256_add_ps(acc[i][0], acc[i][1])) + (macc[i][0] + macc[i][1]) + bb);
  }
}

template <class D, typename out_t>
void matmul(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t n, const float* bias,
            out_t* out) {
  const int64_t groups = k / 32;
  std::vector<float> xs(D::kMin ? m * groups : 0);  // a group's min multiplies its activation sum
  if constexpr (D::kMin)
    for (int64_t g = 0; g < m * groups; ++g) {
      __m256 s = _mm256_loadu_ps(x + g * 32);
      for (int j = 8; j < 32; j += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + g * 32 + j));
      xs[g] = hsum8(s);
    }
  const D dec;
  // ~64 KiB of weights per task: enough to amortise a task, enough tasks to balance the cores.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    int64_t i = 0;
    for (; i + 4 <= m; i += 4)  // activation rows in groups share each decoded group of quants
      fma_rows<D, 4>(dec, w, row_bytes, r0, r1, x + i * k, k, xs.data() + i * groups, bias, out + i * n, n);
    for (; i + 2 <= m; i += 2)
      fma_rows<D, 2>(dec, w, row_bytes, r0, r1, x + i * k, k, xs.data() + i * groups, bias, out + i * n, n);
    for (; i < m; ++i)
      fma_rows<D, 1>(dec, w, row_bytes, r0, r1, x + i * k, k, xs.data() + i * groups, bias, out + i * n, n);
  });
}

template <class D>
void run(const at::Tensor& x, const at::Tensor& qweight, const float* bias, at::Tensor& out) {
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);  // bf16 -> fp32 is exact
  const auto* w = static_cast<const uint8_t*>(qweight.const_data_ptr());
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0), row_bytes = qweight.size(1);
  if (out.scalar_type() == at::kFloat)
    matmul<D>(xf.const_data_ptr<float>(), m, k, w, row_bytes, n, bias, out.data_ptr<float>());
  else
    matmul<D>(xf.const_data_ptr<float>(), m, k, w, row_bytes, n, bias, out.data_ptr<c10::BFloat16>());
}

}  // namespace

bool fma_rows_matmul(const at::Tensor& x, const at::Tensor& qweight, const std::string& qtype, const float* bias,
                     at::Tensor& out) {
  if (!x.is_contiguous() || (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16)) return false;
  if (qtype == "q4_0") run<Q4_0Rows>(x, qweight, bias, out);
  else if (qtype == "q4_1") run<Q4_1Rows>(x, qweight, bias, out);
  else if (qtype == "q8_0") run<Q8_0Rows>(x, qweight, bias, out);
  else if (qtype == "q4_k") run<Q4_KRows>(x, qweight, bias, out);
  else return false;
  return true;
}
#else
bool fma_rows_matmul(const at::Tensor&, const at::Tensor&, const std::string&, const float*, at::Tensor&) {
  return false;
}
#endif

}  // namespace resin_quant
