// Causal prefill attention of one sequence on torch's small-GEMM ukernels (at::native::cpublas::brgemm: oneDNN's
// AMX tile kernels on CPUs that have them), flash style: fp32 scores, an exact online softmax, probabilities
// rounded to bf16 for the P.V product (as torch's CPU flash kernel rounds them), one rounding of the output.
//
// Why not torch's SDPA, which does the same: for grouped-query layers SDPA repacks each KV head's keys for every
// query head and query block, and its blocks are sized for one head. Here the G query heads sharing a KV head are
// stacked as the rows of one GEMM (a 32-query block of a 3-group layer is 96 rows, a full AMX tile height six
// times), and each KV head's keys and values are packed into the kernel's layout once per call and shared by all.
// A chunk after cached context is one call: query i sits at position (seq_len - q_len + i) and sees keys up to it,
// so no separate prefix pass and no log-sum-exp merge. Built where -march=native has AVX-512 BF16 (all AMX CPUs);
// elsewhere flash_prefill_available() is false and prefill stays on SDPA.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BF16__)  // every CPU with AMX tiles has both
#include <immintrin.h>

#include "prefill_bf16_tiles.h"  // softmax_row

namespace {

using at::native::cpublas::brgemm;

constexpr int64_t kQBlock = 32;   // queries per work item (times the group: the GEMM's rows)
constexpr int64_t kPanel = 64;    // widest packed B matrix the ukernel takes (keys, or value columns)
constexpr int64_t kKeyStep = 32;  // a diagonal tile is cut to a multiple of this many keys
constexpr int64_t kKBlock = 256;  // keys per score tile (oneDNN's per-call cost wants big tiles: 64 ran 2x slower)

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's casts
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

}  // namespace

bool flash_prefill_available() { return at::native::cpublas::could_pack(at::kBFloat16); }  // AMX

// q (q_len, H*D): one sequence's chunk of queries, the tail of its seq_len tokens, whose keys and values are
// already in the head-major paged cache (2, Hk, blocks, block_size, D) at the blocks `block_table` lists (int32).
// Returns (q_len, H*D). bf16 only; D a multiple of kPanel.
at::Tensor flash_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                   int64_t seq_len, int64_t num_heads, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16,
              "flash_prefill_attention: bf16 only");
  TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1 && kv_cache.dim() == 5 && kv_cache.is_contiguous(),
              "flash_prefill_attention: q (q_len, H*D) with unit stride, a contiguous (2, Hk, blocks, bs, D) cache");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
              "flash_prefill_attention: block_table must be contiguous int32");
  const int64_t q_len = q.size(0), kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2);
  const int64_t block_size = kv_cache.size(3), d = kv_cache.size(4);
  const int64_t group = num_heads / kv_heads;
  TORCH_CHECK(num_heads % kv_heads == 0 && q.size(1) == num_heads * d && d % kPanel == 0 && q_len <= seq_len &&
                  block_table.numel() * block_size >= seq_len,
              "flash_prefill_attention: shapes do not agree");
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  for (int64_t i = 0; i < (seq_len + block_size - 1) / block_size; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "flash_prefill_attention: block id outside the cache");
  const int64_t offset = seq_len - q_len;  // position of the chunk's first query
  const int64_t kblocks = (seq_len + kKBlock - 1) / kKBlock;
  const auto* cache = reinterpret_cast<const uint16_t*>(kv_cache.const_data_ptr<at::BFloat16>());
  const int64_t head_rows = num_blocks * block_size, plane = kv_heads * head_rows * d;
  auto row = [&](int64_t h, int64_t t) {  // key row t of KV head h; the value row is `plane` further on
    return cache + (h * head_rows + table[t / block_size] * block_size + t % block_size) * d;
  };

  // Keys transposed to (D, keys) and values as (keys, D), packed into the ukernel's layout once per KV head and
  // shared by every query head of its group and every query block; packed B matrices are at most kPanel columns
  // wide, so keys go in panels of kPanel keys and values in panels of kPanel of their D columns. A sequence's last
  // tile is zero-padded (those scores are masked).
  auto packed_k = at::empty({kv_heads, kblocks, kKBlock * d}, kv_cache.options());
  auto packed_v = at::empty({kv_heads, kblocks, kKBlock * d}, kv_cache.options());
  auto* pk = reinterpret_cast<uint16_t*>(packed_k.data_ptr<at::BFloat16>());
  auto* pv = reinterpret_cast<uint16_t*>(packed_v.data_ptr<at::BFloat16>());
  at::parallel_for(0, kv_heads * kblocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> kt(d * kPanel), vb(kKBlock * kPanel);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / kblocks, j = item % kblocks;
      const int64_t first = j * kKBlock, n = std::min(kKBlock, seq_len - first);
      for (int64_t panel = 0; panel < kKBlock / kPanel; ++panel) {  // keys panel*kPanel.. as a (D, kPanel) matrix
        std::fill(kt.begin(), kt.end(), 0);
        for (int64_t t = panel * kPanel; t < std::min(n, (panel + 1) * kPanel); ++t) {
          const uint16_t* src = row(h, first + t);
          for (int64_t c = 0; c < d; ++c) kt[c * kPanel + t - panel * kPanel] = src[c];
        }
        at::native::cpublas::pack(d, kPanel, kPanel, kPanel, at::kBFloat16, at::kBFloat16, kt.data(),
                                  pk + (item * kKBlock + panel * kPanel) * d);
      }
      for (int64_t panel = 0; panel < d / kPanel; ++panel) {  // columns panel*kPanel.. of the tile's values
        std::fill(vb.begin(), vb.end(), 0);
        for (int64_t t = 0; t < n; ++t)
          std::memcpy(&vb[t * kPanel], row(h, first + t) + plane + panel * kPanel, kPanel * sizeof(uint16_t));
        at::native::cpublas::pack(kKBlock, kPanel, kPanel, kPanel, at::kBFloat16, at::kBFloat16, vb.data(),
                                  pv + (item * d + panel * kPanel) * kKBlock);
      }
    }
  });

  auto out = at::empty({q_len, num_heads * d}, q.options());
  const auto* q_raw = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* o_raw = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t q_stride = q.stride(0), qblocks = (q_len + kQBlock - 1) / kQBlock;
  const float log2_scale = static_cast<float>(scale * 1.4426950408889634);  // scores in log2 units: exp2
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Work items: (KV head, query block), handed out one at a time, latest query blocks first (they see the most
  // keys; a static split gave one thread the long rows of a causal prefill and the other the short ones).
  const int64_t items = kv_heads * qblocks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    const int64_t rows_max = group * kQBlock;
    std::vector<uint16_t> qbuf(rows_max * d), pbuf(rows_max * kKBlock);
    std::vector<float> scores(rows_max * kKBlock), acc(rows_max * d), mx(rows_max), sum(rows_max);
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t h = item % kv_heads, qb = qblocks - 1 - item / kv_heads;
      const int64_t q0 = qb * kQBlock, nq = std::min(kQBlock, q_len - q0), rows = group * nq;
      // rows r = g * nq + i: query q0 + i of head h * group + g
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < nq; ++i)
          std::memcpy(&qbuf[(g * nq + i) * d], q_raw + (q0 + i) * q_stride + (h * group + g) * d,
                      d * sizeof(uint16_t));
      std::fill(mx.begin(), mx.begin() + rows, neg_inf);
      std::fill(sum.begin(), sum.begin() + rows, 0.0f);
      std::fill(acc.begin(), acc.begin() + rows * d, 0.0f);
      const int64_t last_key = offset + q0 + nq - 1;  // the block's last query sees keys up to here
      const int64_t nkb = last_key / kKBlock + 1;
      for (int64_t j = 0; j < nkb; ++j) {
        const int64_t k0 = j * kKBlock;
        // keys of this tile any query of the block sees, rounded up to whole steps (the rest are zero padding or
        // masked): the diagonal tile of a causal block is cut short instead of computed whole
        const int64_t n = std::min(kKBlock, (last_key + 1 - k0 + kKeyStep - 1) / kKeyStep * kKeyStep);
        const uint16_t* tile_k = pk + (h * kblocks + j) * kKBlock * d;
        for (int64_t c = 0; c < n; c += kPanel)
          brgemm(rows, std::min(kPanel, n - c), d, d, kPanel, kKBlock, false,
                 reinterpret_cast<const at::BFloat16*>(qbuf.data()),
                 reinterpret_cast<const at::BFloat16*>(tile_k + c * d), scores.data() + c);
        const bool masked = k0 + n - 1 > offset + q0;  // some key here is after some query's position
        for (int64_t r = 0; r < rows; ++r) {
          float* s = &scores[r * kKBlock];
          const int64_t visible = masked ? std::min<int64_t>(n, offset + q0 + r % nq - k0 + 1) : n;
          float block_sum;
          const float row_max =
              prefill_bf16::softmax_row(s, n, visible, log2_scale, mx[r], &pbuf[r * kKBlock], &block_sum);
          const float correction = std::exp2(mx[r] - row_max);  // maxima in log2 units
          sum[r] = sum[r] * correction + block_sum;
          mx[r] = row_max;
          float* a = &acc[r * d];
          if (correction != 1.0f)
            for (int64_t c = 0; c < d; ++c) a[c] *= correction;
        }
        const uint16_t* tile_v = pv + (h * kblocks + j) * kKBlock * d;
        for (int64_t c = 0; c < d; c += kPanel)
          brgemm(rows, kPanel, n, kKBlock, kPanel, d, true, reinterpret_cast<const at::BFloat16*>(pbuf.data()),
                 reinterpret_cast<const at::BFloat16*>(tile_v + c * kKBlock), acc.data() + c);
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t r = g * nq + i;
          const float inv = 1.0f / sum[r];
          uint16_t* o = o_raw + (q0 + i) * num_heads * d + (h * group + g) * d;
          for (int64_t c = 0; c < d; ++c) o[c] = float_to_bf16(acc[r * d + c] * inv);
        }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}

#else  // built without AVX-512 BF16 (no CPU with AMX lacks it): the provider keeps prefill on SDPA

bool flash_prefill_available() { return false; }

at::Tensor flash_prefill_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, double) {
  TORCH_CHECK(false, "flash_prefill_attention: this build has no AVX-512 BF16 (flash_prefill_available() is false)");
}

#endif
