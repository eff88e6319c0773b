// bf16 linear over weights packed once into panels (bf16_panels.h), for every row count on CPUs with AVX512-BF16
// and no AMX (backends/cpu/cpp_linear.py decides, and packs the panels).
//
// Why: oneDNN's avx512_bf16 GEMM over its own prepacked weight is slow for the few rows of decode (2-core Zen 4,
// every projection of the built-in model's 30 layers and its lm_head in turn, weights from memory,
// bench/linear_rows.py: this kernel 1.4-1.6x as fast at 1-16 rows, 1.22x at 32, 1.02-1.04x at 512-1,024), and
// the row-major GEMV this replaced read the weights at ~21 GB/s where this reads ~31 (each output row was a
// separate stream). Here each panel is one sequential stream read once per
// call, and its products are what oneDNN's are (vdpbf16ps: exact products, fp32 sums), in another order.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "bf16_panels.h"

namespace {
constexpr int kVectors = 3;             // 16-lane vectors of output rows per panel: 48 rows
constexpr int kRowsPerTile = 8;         // activation rows per register tile: 24 sums in registers
constexpr int64_t kRowsPerPass = 256;   // activation rows that pass over each panel before the next
}  // namespace

int64_t bf16_panel_width() { return 16 * kVectors; }

bool bf16_panels_available() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x (m, K) bf16 contiguous; panels (ceil(N / W), K / 2, W) int32 (backends/cpu/cpp_linear.py packs them: W =
// bf16_panel_width(), rows past N zero); bias (N,) fp32 (added before the one rounding) or none -> (m, N) bf16.
at::Tensor bf16_panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                             const c10::optional<at::Tensor>& bias) {
  const int64_t width = bf16_panel_width();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_panel_linear: x must be a contiguous (m, K) bf16 matrix");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kInt && panels.is_contiguous() &&
                  panels.size(2) == width && panels.size(1) * 2 == x.size(1) && n > (panels.size(0) - 1) * width &&
                  n <= panels.size(0) * width,
              "bf16_panel_linear: panels must be (ceil(N / ", width, "), K / 2, ", width, ") int32 for x's K");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "bf16_panel_linear: bias must be contiguous fp32 with one value per output");
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const int64_t m = x.size(0), k = x.size(1), count = panels.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  const float* bp = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint32_t*>(panels.const_data_ptr<int32_t>());
  auto* op = out.data_ptr<c10::BFloat16>();
  // Work items (block of rows, panel), panels inner: a thread's items share a block of rows, and a projection
  // with fewer panels than threads still splits over rows on a many-core machine.
  const int64_t blocks = (m + kRowsPerPass - 1) / kRowsPerPass;
  at::parallel_for(0, blocks * count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / count * kRowsPerPass, q = item % count;
      const int valid = static_cast<int>(std::min(width, n - q * width));
      resin_panels::panel_rows<kVectors, kRowsPerTile>(wp + q * (k / 2) * width, std::min(kRowsPerPass, m - i), k,
                                                       xp + i * k, bp, q * width, valid, op + i * n, n,
                                                       item + 1 < end && q + 1 < count ? wp + (q + 1) * (k / 2) * width
                                                                                        : nullptr);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "bf16_panel_linear: this build has no AVX512-BF16 (bf16_panels_available() is false)");
#endif
}
