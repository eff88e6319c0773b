// Causal prefill attention of one sequence on AVX2 + FMA: the counterpart of prefill_attention.cpp (same plan, same
// work items) for CPUs without AMX: fp32 models, and bf16 ones wherever there is no AMX (on a 2-core Zen 4 with
// AVX512-BF16, bf16 SDPA ran a 16 x 256-token prefill of the built-in model at ~46 GFLOP/s, a quarter of the
// prefill's time).
//
// Why not torch's SDPA: on a 2-core Zen 3 its fp32 flash kernel ran a 1,024-token causal prefill of the built-in
// model's layers (9 query heads on 3 KV heads, D = 64) at ~85 GFLOP/s of the ~186 the cores' FMA units give, a
// quarter of the prefill's time. Here the G query heads sharing a KV head are stacked as the rows of one GEMM
// (a 32-query block of a 3-group layer: 96 rows), each KV head's keys and values are packed once per call and
// shared by every query block, and both products run on one register-tiled kernel (6 rows x 16 columns: 12
// accumulators, a broadcast per row, two loads per step). A chunk after cached context is one call: query i sits
// at position seq_len - q_len + i and sees keys up to it.
// Numerics for fp32, as native computes it: fp32 products and sums (in another order), an exact online softmax
// (exp within ~1 ulp: poly_exp), fp32 probabilities, one division at the end. bf16 where the build has
// AVX512-BF16: both products by vdpbf16ps (prefill_bf16_tiles.h: 4,096-token prefill of the built-in model,
// attention 3.78 -> 2.34 s against widening to fp32), and the AMX kernel's softmax row (exps by a polynomial within
// 6e-5, probabilities rounded to bf16 before P.V as torch's flash kernel rounds them; a 1,024-token call 4.95 ->
// 3.84 ms a layer against a scalar max pass and the ~1-ulp exp); without it, q, keys and values widened to fp32
// (exactly) and the fp32 path above.
// The output is rounded to bf16 once. tests/test_cpu_prefill_attention.py compares both with exact attention.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "prefill_bf16_tiles.h"
#include "simd.h"  // immintrin.h, poly_exp

#if defined(__AVX2__) && defined(__FMA__)
namespace {

constexpr int64_t kQBlock = 32;  // queries per work item (times the group: the GEMM's rows)
constexpr int64_t kKBlock = 256;  // keys per score tile
constexpr int64_t kNR = 16;       // columns of the register tile: keys of a packed K panel, or value columns
constexpr int kMR = 6;            // rows of the register tile

// C (MR x 16, row stride ldc) = [C +] A (MR x kc, row stride lda) B (kc x 16, row stride ldb). Twelve named
// accumulators rather than an array: GCC kept an array's tile in memory across the loop (a third of the speed).
template <int MR>
void tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kc, float* c, int64_t ldc, bool add) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8);
    __m256 x = _mm256_broadcast_ss(a + k);
    c00 = _mm256_fmadd_ps(x, b0, c00), c01 = _mm256_fmadd_ps(x, b1, c01);
    if constexpr (MR > 1) {
      x = _mm256_broadcast_ss(a + lda + k);
      c10 = _mm256_fmadd_ps(x, b0, c10), c11 = _mm256_fmadd_ps(x, b1, c11);
    }
    if constexpr (MR > 2) {
      x = _mm256_broadcast_ss(a + 2 * lda + k);
      c20 = _mm256_fmadd_ps(x, b0, c20), c21 = _mm256_fmadd_ps(x, b1, c21);
    }
    if constexpr (MR > 3) {
      x = _mm256_broadcast_ss(a + 3 * lda + k);
      c30 = _mm256_fmadd_ps(x, b0, c30), c31 = _mm256_fmadd_ps(x, b1, c31);
    }
    if constexpr (MR > 4) {
      x = _mm256_broadcast_ss(a + 4 * lda + k);
      c40 = _mm256_fmadd_ps(x, b0, c40), c41 = _mm256_fmadd_ps(x, b1, c41);
    }
    if constexpr (MR > 5) {
      x = _mm256_broadcast_ss(a + 5 * lda + k);
      c50 = _mm256_fmadd_ps(x, b0, c50), c51 = _mm256_fmadd_ps(x, b1, c51);
    }
  }
  const __m256 rows[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h) {
      float* dst = c + i * ldc + 8 * h;
      _mm256_storeu_ps(dst, add ? _mm256_add_ps(rows[i][h], _mm256_loadu_ps(dst)) : rows[i][h]);
    }
}

// The same product for `rows` rows of A and C, kMR at a time.
void gemm_rows(int64_t rows, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kc, float* c,
               int64_t ldc, bool add) {
  int64_t r = 0;
  for (; r + kMR <= rows; r += kMR) tile<kMR>(a + r * lda, lda, b, ldb, kc, c + r * ldc, ldc, add);
  switch (rows - r) {
    case 5: tile<5>(a + r * lda, lda, b, ldb, kc, c + r * ldc, ldc, add); break;
    case 4: tile<4>(a + r * lda, lda, b, ldb, kc, c + r * ldc, ldc, add); break;
    case 3: tile<3>(a + r * lda, lda, b, ldb, kc, c + r * ldc, ldc, add); break;
    case 2: tile<2>(a + r * lda, lda, b, ldb, kc, c + r * ldc, ldc, add); break;
    case 1: tile<1>(a + r * lda, lda, b, ldb, kc, c + r * ldc, ldc, add); break;
  }
}


// One row of a score tile (n keys): scale, mask keys from `visible` on, fold in the running max; the
// probabilities exp(s - max) replace the scores. Returns the new max and sets *block_sum to their sum. The
// running max is finite from the first tile on (every query sees key 0), so a row masked whole gives zeros.
inline float softmax_row(float* s, int64_t n, int64_t visible, float scale, float running_max, float* block_sum) {
  constexpr int kLanes = 16;
  float top[kLanes];
  std::fill(top, top + kLanes, running_max);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < n; c += kLanes)  // n is a multiple of kNR
    for (int j = 0; j < kLanes; ++j) {
      const float v = c + j < visible ? s[c + j] * scale : neg_inf;
      s[c + j] = v;
      top[j] = std::max(top[j], v);
    }
  float mx = top[0];
  for (int j = 1; j < kLanes; ++j) mx = std::max(mx, top[j]);
  float part[kLanes] = {0};
  for (int64_t c = 0; c < n; c += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      s[c + j] = poly_exp(s[c + j] - mx);
      part[j] += s[c + j];
    }
  float total = 0.0f;
  for (int j = 0; j < kLanes; ++j) total += part[j];
  *block_sum = total;
  return mx;
}

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }  // exact

template <typename T>
at::Tensor prefill(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table, int64_t seq_len,
                   int64_t num_heads, double scale) {
  TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1 && kv_cache.dim() == 5 && kv_cache.is_contiguous(),
              "flash_prefill_attention_f32: q (q_len, H*D) with unit stride, a contiguous (2, Hk, blocks, bs, D) "
              "cache");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
              "flash_prefill_attention_f32: block_table must be contiguous int32");
  const int64_t q_len = q.size(0), kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2);
  const int64_t block_size = kv_cache.size(3), d = kv_cache.size(4);
  const int64_t group = num_heads / kv_heads;
  TORCH_CHECK(num_heads % kv_heads == 0 && q.size(1) == num_heads * d && d % kNR == 0 && q_len >= 1 &&
                  q_len <= seq_len && block_table.numel() * block_size >= seq_len,
              "flash_prefill_attention_f32: shapes do not agree");
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  for (int64_t i = 0; i < (seq_len + block_size - 1) / block_size; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "flash_prefill_attention_f32: block id outside the cache");
  const int64_t offset = seq_len - q_len;  // position of the chunk's first query
  const int64_t kblocks = (seq_len + kKBlock - 1) / kKBlock;
  const T* cache = kv_cache.const_data_ptr<T>();
  const int64_t head_rows = num_blocks * block_size, plane = kv_heads * head_rows * d;
  auto row = [&](int64_t h, int64_t t) {  // key row t of KV head h; the value row is `plane` further on
    return cache + (h * head_rows + table[t / block_size] * block_size + t % block_size) * d;
  };

  // Per KV head and key tile, the B operands of the two products: keys as fp32 panels of 16 keys, each (D, 16),
  // and values as fp32 (keys, D) rows (16 columns at a time); or, for bf16 products, both as pairs of bf16 in
  // prefill_bf16_tiles.h's layouts. Zero past the sequence's end (masked).
  constexpr bool bf16 = prefill_bf16::kAvailable && std::is_same_v<T, at::BFloat16>;
  const int64_t tile_words = bf16 ? kKBlock * d / 2 : kKBlock * d;  // 32-bit words per key or value tile
  auto packed = at::zeros({2, kv_heads, kblocks, tile_words}, kv_cache.options().dtype(at::kInt));
  auto* pk = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  uint32_t* pv = pk + kv_heads * kblocks * tile_words;
  at::parallel_for(0, kv_heads * kblocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first = item % kblocks * kKBlock;
      const int64_t n = std::min(kKBlock, seq_len - first);
      for (int64_t t = 0; t < n; ++t) {
        const T* src = row(item / kblocks, first + t);
        if constexpr (bf16) {
          const auto* bits = reinterpret_cast<const uint16_t*>(src);
          prefill_bf16::pack_key(bits, d, t, pk + item * tile_words);
          prefill_bf16::pack_value(bits + plane, d, t, pv + item * tile_words);
          continue;
        }
        float* panel = reinterpret_cast<float*>(pk + item * tile_words) + t / kNR * kNR * d + t % kNR;
        for (int64_t c = 0; c < d; ++c) panel[c * kNR] = widen(src[c]);
        float* value = reinterpret_cast<float*>(pv + item * tile_words) + t * d;
        for (int64_t c = 0; c < d; ++c) value[c] = widen(src[plane + c]);
      }
    }
  });

  auto out = at::empty({q_len, num_heads * d}, q.options());
  const T* q_raw = q.const_data_ptr<T>();
  T* o_raw = out.data_ptr<T>();
  const int64_t q_stride = q.stride(0), qblocks = (q_len + kQBlock - 1) / kQBlock;
  const float scale_f = static_cast<float>(scale);
  const float log2_scale = static_cast<float>(scale * 1.4426950408889634);  // bf16: scores in log2 units, exp2
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Work items: (KV head, query block), handed out one at a time, latest query blocks first (they see the most
  // keys; a static split would give one thread the long rows of a causal prefill and the other the short ones).
  const int64_t items = kv_heads * qblocks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    const int64_t rows_max = group * kQBlock;
    std::vector<float> qbuf(bf16 ? 0 : rows_max * d), scores(rows_max * kKBlock), acc(rows_max * d), mx(rows_max),
        sum(rows_max);
    // bf16 products: the query rows as they are, and the probabilities rounded to bf16
    std::vector<uint16_t> qbits(bf16 ? rows_max * d : 0), pbits(bf16 ? rows_max * kKBlock : 0);
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t h = item % kv_heads, qb = qblocks - 1 - item / kv_heads;
      const int64_t q0 = qb * kQBlock, nq = std::min(kQBlock, q_len - q0), rows = group * nq;
      // rows r = g * nq + i: query q0 + i of head h * group + g
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < nq; ++i) {
          const T* src = q_raw + (q0 + i) * q_stride + (h * group + g) * d;
          if constexpr (bf16)
            std::memcpy(&qbits[(g * nq + i) * d], src, d * sizeof(uint16_t));
          else
            for (int64_t c = 0; c < d; ++c) qbuf[(g * nq + i) * d + c] = widen(src[c]);
        }
      std::fill(mx.begin(), mx.begin() + rows, neg_inf);
      std::fill(sum.begin(), sum.begin() + rows, 0.0f);
      std::fill(acc.begin(), acc.begin() + rows * d, 0.0f);
      const int64_t last_key = offset + q0 + nq - 1;  // the block's last query sees keys up to here
      for (int64_t j = 0; j <= last_key / kKBlock; ++j) {
        const int64_t k0 = j * kKBlock;
        // keys of this tile any query of the block sees, rounded up to whole panels (the rest are zero padding
        // or masked): the diagonal tile of a causal block is cut short instead of computed whole
        const int64_t n = std::min(kKBlock, (last_key + 1 - k0 + kNR - 1) / kNR * kNR);
        const uint32_t* tile_k = pk + (h * kblocks + j) * tile_words;
        const uint32_t* tile_v = pv + (h * kblocks + j) * tile_words;
        if constexpr (bf16) prefill_bf16::score_rows(rows, qbits.data(), d, tile_k, n, scores.data(), kKBlock);
        if constexpr (!bf16)
          for (int64_t c = 0; c < n; c += kNR)
            gemm_rows(rows, qbuf.data(), d, reinterpret_cast<const float*>(tile_k) + c * d, kNR, d,
                      scores.data() + c, kKBlock, false);
        const bool masked = k0 + n - 1 > offset + q0;  // some key here is after some query's position
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t visible = masked ? std::min<int64_t>(n, offset + q0 + r % nq - k0 + 1) : n;
          float block_sum, correction, row_max;
          if constexpr (bf16) {  // maxima in log2 units, probabilities straight to bf16
            row_max = prefill_bf16::softmax_row(&scores[r * kKBlock], n, visible, log2_scale, mx[r],
                                                &pbits[r * kKBlock], &block_sum);
            correction = std::exp2(mx[r] - row_max);  // 0 on the first tile (mx = -inf)
          } else {
            row_max = softmax_row(&scores[r * kKBlock], n, visible, scale_f, mx[r], &block_sum);
            correction = poly_exp(mx[r] - row_max);
          }
          sum[r] = sum[r] * correction + block_sum;
          mx[r] = row_max;
          if (correction != 1.0f)
            for (int64_t c = 0; c < d; ++c) acc[r * d + c] *= correction;
        }
        if constexpr (bf16) prefill_bf16::value_rows(rows, pbits.data(), kKBlock, tile_v, d, n, acc.data());
        if constexpr (!bf16)
          for (int64_t c = 0; c < d; c += kNR)
            gemm_rows(rows, scores.data(), kKBlock, reinterpret_cast<const float*>(tile_v) + c, d, n,
                      acc.data() + c, d, true);
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t r = g * nq + i;
          const float inv = 1.0f / sum[r];
          T* o = o_raw + (q0 + i) * num_heads * d + (h * group + g) * d;
          for (int64_t c = 0; c < d; ++c) o[c] = static_cast<T>(acc[r * d + c] * inv);  // bf16: rounded once, RNE
        }
    }
  });
  return out;
}

}  // namespace

bool flash_prefill_f32_available() { return true; }

// q (q_len, H*D) float32 or bfloat16: one sequence's chunk of queries, the tail of its seq_len tokens, whose keys
// and values are already in the head-major paged cache (2, Hk, blocks, block_size, D) of q's dtype at the blocks
// `block_table` lists (int32). Returns (q_len, H*D) in q's dtype. D a multiple of 16.
at::Tensor flash_prefill_attention_f32(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                       int64_t seq_len, int64_t num_heads, double scale) {
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "flash_prefill_attention_f32: q and the cache both float32 or both bfloat16");
  return q.scalar_type() == at::kBFloat16
             ? prefill<at::BFloat16>(q, kv_cache, block_table, seq_len, num_heads, scale)
             : prefill<float>(q, kv_cache, block_table, seq_len, num_heads, scale);
}

#else  // built without AVX2 + FMA: the provider keeps fp32 prefill on SDPA

bool flash_prefill_f32_available() { return false; }

at::Tensor flash_prefill_attention_f32(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                       double) {
  TORCH_CHECK(false, "flash_prefill_attention_f32: this build has no AVX2 + FMA (flash_prefill_f32_available())");
}

#endif
