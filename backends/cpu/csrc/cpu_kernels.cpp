// Resin's fused CPU kernels: the small per-layer ops of a decode step, each one pass over memory.
//
// Why they exist: at batch-1 decode each of these ops is microseconds of work behind tens of microseconds of
// dispatch when written as several torch ops (measured in bench/step_profile.py --per-op). Each kernel here
// computes what the HAL's native op computes, rounding where native rounds (rotary is bit-equal to native; norms
// and activations differ from native only by the order of an fp32 sum or the last bit of an fp32 exp), and is
// tested against it in tests/test_cpu_kernels.py. Compiled once per machine by backends/cpu/kernels.py with
// -march=native, so the loops below are written for the compiler to vectorise: fixed-size partial sums instead
// of one accumulator, bf16 converted by bit shifts, exp as a polynomial.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <tuple>
#include <type_traits>
#include "simd.h"  // immintrin.h
#include <vector>

namespace {

// Element I/O on raw bits. c10's BFloat16/Half conversions branch per element (NaN checks, out-of-line
// helpers), which keeps GCC from vectorising the loops; these are branch-free, so every loop below vectorises.
// Rounding is to nearest even, as torch's casts round.
template <typename T>
struct Io;
template <>
struct Io<float> {
  using raw = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};
template <>
struct Io<c10::BFloat16> {
  using raw = uint16_t;
  static float load(uint16_t x) {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static uint16_t store(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return f != f ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
  }
};
#if defined(__FLT16_MAX__)  // GCC >= 12, Clang >= 15 on x86
template <>
struct Io<c10::Half> {
  using raw = _Float16;  // same bits as c10::Half; F16C converts it in hardware
  static float load(_Float16 x) { return static_cast<float>(x); }
  static _Float16 store(float f) { return static_cast<_Float16>(f); }
};
#else  // older compilers: c10's conversions (correct, not vectorised)
template <>
struct Io<c10::Half> {
  using raw = c10::Half;
  static float load(c10::Half x) { return static_cast<float>(x); }
  static c10::Half store(float f) { return c10::Half(f); }
};
#endif

template <typename T>
using raw_t = typename Io<T>::raw;

// x rounded to T and back: where native rounds an intermediate to the activation dtype.
template <typename T>
inline float round_to(float x) {
  return Io<T>::load(Io<T>::store(x));
}

template <typename T>
raw_t<T>* raw_ptr(torch::Tensor& t) {
  return reinterpret_cast<raw_t<T>*>(t.data_ptr<T>());
}

template <typename T>
const raw_t<T>* raw_ptr(const torch::Tensor& t) {
  return reinterpret_cast<const raw_t<T>*>(t.const_data_ptr<T>());
}

// The dtypes every kernel takes; `body` gets a value of the scalar type, as AT_DISPATCH's lambdas get scalar_t.
template <typename F>
void dispatch_float(at::ScalarType type, const char* op, F&& body) {
  switch (type) {
    case at::kFloat:
      return body(float{});
    case at::kBFloat16:
      return body(c10::BFloat16{});
    case at::kHalf:
      return body(c10::Half{});
    default:
      TORCH_CHECK(false, op, ": float32, bfloat16 or float16 only, got ", type);
  }
}

constexpr int kLanes = 16;  // partial sums per reduction: one AVX-512 register of fp32

// Sum of 16 partial sums as a tree (log2 steps of vector adds), not a serial chain of 16 dependent adds.
inline float lane_sum(float* part) {
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) part[j] += part[j + width];
  return part[0];
}

inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float part[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) part[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) part[0] += a[i] * b[i];
  return lane_sum(part);
}


// ---------------------------------------------------------------------------------------------------------
// RMSNorm, optionally fused with the residual add: residual' = x + residual (rounded to T, as native's add),
// y = T(w * T(residual' * rsqrt(mean(residual'^2) + eps))): native rounds to T before the weight multiply.

template <typename T>
void rms_norm_kernel(raw_t<T>* out, raw_t<T>* res_out, const raw_t<T>* x, int64_t x_stride, const raw_t<T>* res,
                     int64_t res_stride, const raw_t<T>* w, int64_t rows, int64_t n, float eps) {
  using io = Io<T>;
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / n), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    float* __restrict__ v = buf.data();
    for (int64_t row = begin; row < end; ++row) {
      const raw_t<T>* __restrict__ xr = x + row * x_stride;
      if (res != nullptr) {
        const raw_t<T>* __restrict__ rr = res + row * res_stride;
        raw_t<T>* __restrict__ ro = res_out + row * n;
        for (int64_t i = 0; i < n; ++i) {
          ro[i] = io::store(io::load(xr[i]) + io::load(rr[i]));
          v[i] = io::load(ro[i]);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) v[i] = io::load(xr[i]);
      }
      const float inv = 1.0f / std::sqrt(dot(v, v, n) / static_cast<float>(n) + eps);
      raw_t<T>* __restrict__ o = out + row * n;
      for (int64_t i = 0; i < n; ++i) o[i] = io::store(io::load(w[i]) * round_to<T>(v[i] * inv));
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be (rows, hidden) with contiguous rows");
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  dispatch_float(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_kernel<scalar_t>(raw_ptr<scalar_t>(out), nullptr, raw_ptr<scalar_t>(x), x.stride(0), nullptr, 0,
                              raw_ptr<scalar_t>(weight), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> fused_add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                              const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  auto res_out = torch::empty({x.size(0), x.size(1)}, x.options());
  dispatch_float(x.scalar_type(), "fused_add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_kernel<scalar_t>(raw_ptr<scalar_t>(out), raw_ptr<scalar_t>(res_out), raw_ptr<scalar_t>(x), x.stride(0),
                              raw_ptr<scalar_t>(residual), residual.stride(0), raw_ptr<scalar_t>(weight), x.size(0),
                              x.size(1), static_cast<float>(eps));
  });
  return {out, res_out};
}

// ---------------------------------------------------------------------------------------------------------
// Rotary embedding, in place on q and k. Native casts cos/sin to T and rounds each product and the sum to T;
// so does this, and fp-contract is off here so that fp32 products are not fused into an FMA (native's aren't).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

template <typename T>
void rotate_rows(raw_t<T>* x, int64_t row_stride, int64_t heads, int64_t head_size, const int64_t* positions,
                 const float* cache, int64_t rot_dim, bool is_neox, int64_t tokens) {
  const int64_t half = rot_dim / 2;
  at::parallel_for(0, tokens, std::max<int64_t>(1, 32768 / (heads * head_size)), [&](int64_t begin, int64_t end) {
    std::vector<float> table(rot_dim);
    float* __restrict__ cos_t = table.data();
    float* __restrict__ sin_t = cos_t + half;
    std::vector<float> pair(rot_dim);
    float* __restrict__ x1 = pair.data();
    float* __restrict__ x2 = x1 + half;
    for (int64_t t = begin; t < end; ++t) {
      const float* row = cache + positions[t] * rot_dim;
      for (int64_t i = 0; i < half; ++i) {
        cos_t[i] = round_to<T>(row[i]);
        sin_t[i] = round_to<T>(row[half + i]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        raw_t<T>* __restrict__ v = x + t * row_stride + h * head_size;
        // neox pairs element i with i + half; GPT-J pairs 2i with 2i + 1. Split into two planes, rotate, merge.
        if (is_neox) {
          for (int64_t i = 0; i < half; ++i) {
            x1[i] = Io<T>::load(v[i]);
            x2[i] = Io<T>::load(v[half + i]);
          }
        } else {
          for (int64_t i = 0; i < half; ++i) {
            x1[i] = Io<T>::load(v[2 * i]);
            x2[i] = Io<T>::load(v[2 * i + 1]);
          }
        }
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i], c = cos_t[i], s = sin_t[i];
          x1[i] = round_to<T>(round_to<T>(a * c) - round_to<T>(b * s));
          x2[i] = round_to<T>(round_to<T>(b * c) + round_to<T>(a * s));
        }
        if (is_neox) {
          for (int64_t i = 0; i < half; ++i) {
            v[i] = Io<T>::store(x1[i]);
            v[half + i] = Io<T>::store(x2[i]);
          }
        } else {
          for (int64_t i = 0; i < half; ++i) {
            v[2 * i] = Io<T>::store(x1[i]);
            v[2 * i + 1] = Io<T>::store(x2[i]);
          }
        }
      }
    }
  });
}

#pragma GCC pop_options

void rotary(const torch::Tensor& positions, torch::Tensor q, torch::Tensor k, const torch::Tensor& cos_sin_cache,
            int64_t head_size, bool is_neox) {
  check_rows(q, "q");
  check_rows(k, "k");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be contiguous int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be contiguous fp32");
  const int64_t rot_dim = cos_sin_cache.size(1), tokens = positions.size(0);
  TORCH_CHECK(q.size(0) == tokens && k.size(0) == tokens, "q and k need one row per position");
  TORCH_CHECK(rot_dim <= head_size && rot_dim % 2 == 0 && q.size(1) % head_size == 0 && k.size(1) % head_size == 0,
              "rotary dims must be even, at most head_size, and q/k whole heads");
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin_cache.size(0), "position ", pos[t], " is outside the rotary table (",
                cos_sin_cache.size(0), " positions)");
  dispatch_float(q.scalar_type(), "rotary", [&](auto tag) {
    using scalar_t = decltype(tag);
    for (torch::Tensor* x : {&q, &k})
      rotate_rows<scalar_t>(raw_ptr<scalar_t>(*x), x->stride(0), x->size(1) / head_size, head_size,
                            positions.const_data_ptr<int64_t>(), cos_sin_cache.const_data_ptr<float>(), rot_dim,
                            is_neox, tokens);
  });
}

// ---------------------------------------------------------------------------------------------------------
// silu(gate) * up: native rounds silu's fp32 result to T, then the product to T.

template <typename T>
void silu_and_mul_kernel(raw_t<T>* out, const raw_t<T>* x, int64_t x_stride, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const raw_t<T>* __restrict__ gate = x + r * x_stride;
      const raw_t<T>* __restrict__ up = gate + d;
      raw_t<T>* __restrict__ o = out + r * d;
      for (int64_t i = 0; i < d; ++i) {
        const float g = Io<T>::load(gate[i]);
        o[i] = Io<T>::store(round_to<T>(g / (1.0f + poly_exp(-g))) * Io<T>::load(up[i]));
      }
    }
  });
}

torch::Tensor silu_and_mul(const torch::Tensor& x) {
  check_rows(x, "x");
  const int64_t d = x.size(1) / 2;
  auto out = torch::empty({x.size(0), d}, x.options());
  dispatch_float(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_and_mul_kernel<scalar_t>(raw_ptr<scalar_t>(out), raw_ptr<scalar_t>(x), x.stride(0), x.size(0), d);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// KV cache write into the head-major cache (2, Hk, blocks, block_size, D): token t's head h goes to slot
// slot_mapping[t] of head h. A slot of -1 (a padding token) is skipped.

void write_kv(torch::Tensor kv_cache, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& slots) {
  check_rows(k, "k");
  check_rows(v, "v");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be contiguous (2, Hk, blocks, bs, D)");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(),
              "k and v must have the cache's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slot_mapping must be contiguous int64");
  const int64_t hk = kv_cache.size(1), d = kv_cache.size(4), slots_per_head = kv_cache.size(2) * kv_cache.size(3);
  TORCH_CHECK(k.size(1) == hk * d && v.size(1) == hk * d, "k and v must be (tokens, kv_heads * head_size)");
  TORCH_CHECK(k.size(0) == slots.size(0) && v.size(0) == slots.size(0), "one slot per new token");
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK(slots.const_data_ptr<int64_t>()[t] < slots_per_head, "slot outside the cache");
  const int64_t bytes = d * kv_cache.element_size();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.const_data_ptr());
  const char* vp = static_cast<const char*>(v.const_data_ptr());
  const int64_t k_row = k.stride(0) * k.element_size(), v_row = v.stride(0) * v.element_size();
  const int64_t plane = hk * slots_per_head * bytes;  // K and V halves of the cache
  const int64_t* s = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t) {
    if (s[t] < 0) continue;
    for (int64_t h = 0; h < hk; ++h) {
      char* dst = cache + (h * slots_per_head + s[t]) * bytes;
      std::memcpy(dst, kp + t * k_row + h * bytes, bytes);
      std::memcpy(dst + plane, vp + t * v_row + h * bytes, bytes);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Paged decode attention: one query token per sequence, keys and values read in place through the block
// table (no gather). A work item is (sequence, KV head): the G query heads sharing that KV head are scored
// together, so each K and V row is loaded and converted once. fp32 scores, an exact two-pass softmax and fp32
// accumulation, rounded to T once at the end, which is what native computes. D is a template constant for the
// common head sizes so that the row loops unroll into whole vector registers.

// Blocks lie anywhere in the cache, so the hardware prefetchers cannot run past a block boundary: without help each
// block's first rows are misses waiting on memory. Two software distances: kL1Ahead blocks ahead into L1 (the next
// blocks' rows), kL2Ahead into L2 (enough misses in flight to stream from memory). An item's first kL2Ahead blocks
// of K and of V are requested into L2 when it starts (prefetch_start), so its V pass starts on cached blocks too
// where its keys fit in L2 (decode batches; a long single sequence's V start is evicted by its K pass, harmlessly).
// Measured on a 2-core Zen 4, bf16, 30 layers' caches on huge pages (bench/decode_attention.py's method, old and
// new builds interleaved in one process): 32 x 132 keys 287 -> 200 us a layer, 32 x 1,000 keys 1,956 -> 1,251, one
// sequence at 8,000 keys 455 -> 305; with the L1 distance alone (2 blocks, as before) the kernel was latency-bound
// at 11-14 GB/s. Farther L2 distances (32, 64 blocks) measured slower.
constexpr int64_t kL1Ahead = 2, kL2Ahead = 16;

// The first row of the blk-th block of one KV head's rows (head: the head's row 0 in the cache).
template <typename R>
inline const R* block_rows(const R* head, const int32_t* table, int64_t blk, int64_t block_size, int64_t d) {
  return head + static_cast<int64_t>(table[blk]) * block_size * d;
}

// Locality 3: into L1; 2: into L2.
template <int Locality, typename R>
inline void prefetch_block(const R* head, const int32_t* table, int64_t blk, int64_t block_size, int64_t d) {
  const char* p = reinterpret_cast<const char*>(block_rows(head, table, blk, block_size, d));
  const int64_t bytes = block_size * d * sizeof(R);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, Locality);
}

// An item's start: its first kL2Ahead blocks of keys first..last-1 in K and in V into L2. Not inlined and opaque
// to GCC's interprocedural analysis: GCC 12's pure-const analysis found a function doing nothing but prefetches
// free of effects and deleted its calls (the prefetches inside for_each_block survive because fn has effects).
#if defined(__GNUC__) && !defined(__clang__)
#define RESIN_KEEP_CALL __attribute__((noipa))
#else
#define RESIN_KEEP_CALL __attribute__((noinline))
#endif
template <typename R>
RESIN_KEEP_CALL void prefetch_start(const R* k_head, const R* v_head, const int32_t* table, int64_t block_size,
                                    int64_t first, int64_t last, int64_t d) {
  if (last <= first) return;
  const int64_t b0 = first / block_size, b1 = std::min((last + block_size - 1) / block_size, b0 + kL2Ahead);
  for (const R* head : {k_head, v_head})
    for (int64_t blk = b0; blk < b1; ++blk) prefetch_block<2>(head, table, blk, block_size, d);
}

// Calls fn(first position, rows, count) for each block's slice of the cached rows first..last-1 of one KV head,
// walking the block table a block at a time (no division per row), prefetching ahead as above.
template <typename R, typename F>
inline void for_each_block(const R* head, const int32_t* table, int64_t block_size, int64_t first, int64_t last,
                           int64_t d, F&& fn) {
  const int64_t end = (last + block_size - 1) / block_size;
  for (int64_t blk = first / block_size; blk * block_size < last; ++blk) {
    if (blk + kL2Ahead < end) prefetch_block<2>(head, table, blk + kL2Ahead, block_size, d);
    if (blk + kL1Ahead < end) prefetch_block<3>(head, table, blk + kL1Ahead, block_size, d);
    const int64_t start = blk * block_size, lo = std::max(first, start), hi = std::min(last, start + block_size);
    fn(lo, block_rows(head, table, blk, block_size, d) + (lo - start) * d, hi - lo);
  }
}

// exp(s - max) of one query head's scores in place (a row of len); returns the sum, *mx gets the max.
inline float exp_row(float* __restrict__ s, int64_t len, float* mx_out) {
  // The max in kLanes lanes: one running max was a serial chain of scalar maxss, ~80% of this function and a
  // quarter of the fp32 decode kernel's time at 8,000 keys (perf).
  float top[kLanes];
  std::fill(top, top + kLanes, -INFINITY);
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes)
    for (int j = 0; j < kLanes; ++j) top[j] = std::max(top[j], s[i + j]);
  for (; i < len; ++i) top[0] = std::max(top[0], s[i]);
  float mx = top[0];
  for (int j = 1; j < kLanes; ++j) mx = std::max(mx, top[j]);
  float part[kLanes] = {0};
  i = 0;
  for (; i + kLanes <= len; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      s[i + j] = poly_exp(s[i + j] - mx);
      part[j] += s[i + j];
    }
  for (; i < len; ++i) {
    s[i] = poly_exp(s[i] - mx);
    part[0] += s[i];
  }
  *mx_out = mx;
  return lane_sum(part);
}

// The fp32 softmax of each query head's scores, in place (a row of len per head).
inline void softmax_rows(float* scores, int64_t group, int64_t len) {
  for (int64_t g = 0; g < group; ++g) {
    float mx;
    const float inv = 1.0f / exp_row(scores + g * len, len, &mx);
    for (int64_t i = 0; i < len; ++i) scores[g * len + i] *= inv;
  }
}

// Portable: any head size, any float type (where no part kernel below serves).
template <typename T>
void decode_item(raw_t<T>* out, const raw_t<T>* q, float scale, const raw_t<T>* k_head, const raw_t<T>* v_head,
                 const int32_t* table, int64_t block_size, int64_t first, int64_t last, int64_t group, int64_t d,
                 std::vector<float>& scratch) {
  using io = Io<T>;
  const int64_t len = last - first;
  scratch.resize(group * len + 2 * group * d + d);
  float* __restrict__ scores = scratch.data();
  float* __restrict__ qf = scores + group * len;
  float* __restrict__ acc = qf + group * d;
  float* __restrict__ row = acc + group * d;
  prefetch_start(k_head, v_head, table, block_size, first, last, d);
  for (int64_t i = 0; i < group * d; ++i) {
    qf[i] = io::load(q[i]) * scale;
    acc[i] = 0.0f;
  }
  for_each_block(k_head, table, block_size, first, last, d, [&](int64_t pos, const raw_t<T>* rows, int64_t count) {
    for (int64_t t = 0; t < count; ++t) {
      for (int64_t i = 0; i < d; ++i) row[i] = io::load(rows[t * d + i]);
      for (int64_t g = 0; g < group; ++g) scores[g * len + pos + t - first] = dot(qf + g * d, row, d);
    }
  });
  softmax_rows(scores, group, len);
  for_each_block(v_head, table, block_size, first, last, d, [&](int64_t pos, const raw_t<T>* rows, int64_t count) {
    for (int64_t t = 0; t < count; ++t) {
      for (int64_t i = 0; i < d; ++i) row[i] = io::load(rows[t * d + i]);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * len + pos + t - first];
        float* __restrict__ a = acc + g * d;
        for (int64_t i = 0; i < d; ++i) a[i] += p * row[i];
      }
    }
  });
  for (int64_t i = 0; i < group * d; ++i) out[i] = io::store(acc[i]);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 on AVX512-BF16 (compiled where -march=native has it): q.k by vdpbf16ps straight from the cached bf16 rows
// (products exact, fp32 sums), p.v by fp32 FMAs over V rows widened in registers, several heads' accumulators
// kept in registers across a block. With its KV in the CPU's caches the loop is compute-bound (32 x 132 keys:
// ~27 GB/s of KV on a 2-core Zen 4, against ~16 from memory with the prefetches above), so its instruction count
// matters: sixteen keys' dot products are summed by one transpose-and-add tree (sum16) instead of a horizontal
// reduction each, and a V row is widened once per pass of heads instead of stored widened and read back per head.
// (Widening V by shift and mask into an [even, odd] layout, without vpmovzxwd, measured no faster.)
// One item's keys first..last-1 (all of them, or one part of a split range) for its G query heads, unnormalised:
// per head mx (the largest score), sum (of exp(score - mx)) and acc (sum of exp(score - mx) * v), fp32.

// Element i: the horizontal sum of v[i] (16 fp32 vectors), each in its own order of fp32 additions.
inline __m512 sum16(const __m512* v) {
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of vectors a, b
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j)  // per lane: one partial sum of each of vectors 4j .. 4j + 3
    w[j] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // add the four lanes: lane j of the result holds vectors 4j .. 4j + 3
  const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
  const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

inline __m512 widen_bf16(const uint16_t* row, int j) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(row + 16 * j)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// acc[h] += sum_t p[h][t] v_t for G heads (rows: count V rows; p[h] their weights; acc rows D apart).
template <int D, int G>
inline void add_weighted_rows(float* acc, const float* p, int64_t p_stride, const uint16_t* rows, int64_t count) {
  constexpr int kF32Regs = D / 16;
  __m512 a[G][kF32Regs];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < kF32Regs; ++j) a[h][j] = _mm512_loadu_ps(acc + h * D + 16 * j);
  for (int64_t t = 0; t < count; ++t) {
    __m512 v[kF32Regs];
    for (int j = 0; j < kF32Regs; ++j) v[j] = widen_bf16(rows + t * D, j);
    for (int h = 0; h < G; ++h) {
      const __m512 pv = _mm512_set1_ps(p[h * p_stride + t]);
      for (int j = 0; j < kF32Regs; ++j) a[h][j] = _mm512_fmadd_ps(pv, v[j], a[h][j]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < kF32Regs; ++j) _mm512_storeu_ps(acc + h * D + 16 * j, a[h][j]);
}

template <int D>
void decode_part_bf16(float* acc, float* mx, float* sum, const uint16_t* q, float scale, const uint16_t* k_head,
                      const uint16_t* v_head, const int32_t* table, int64_t block_size, int64_t first, int64_t last,
                      int64_t group, std::vector<float>& scratch) {
  constexpr int kBf16Regs = D / 32, kHeadsPerPass = 256 / D;  // a pass's accumulators: 16 registers
  const int64_t len = last - first;
  std::fill(acc, acc + group * D, 0.0f);
  if (len <= 0) {  // an empty part of a split range: weighs nothing in the merge
    std::fill(mx, mx + group, -INFINITY);
    std::fill(sum, sum + group, 0.0f);
    return;
  }
  prefetch_start(k_head, v_head, table, block_size, first, last, D);
  scratch.resize(group * len);
  float* scores = scratch.data();
  const __m512 scale_v = _mm512_set1_ps(scale);
  for_each_block(k_head, table, block_size, first, last, D, [&](int64_t pos, const uint16_t* rows, int64_t count) {
    for (int64_t g = 0; g < group; ++g) {
      __m512bh qv[kBf16Regs];
      for (int j = 0; j < kBf16Regs; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * j);
      float* s = scores + g * len + pos - first;
      int64_t t = 0;
      for (; t + 16 <= count; t += 16) {
        __m512 a[16];
        for (int i = 0; i < 16; ++i) {
          a[i] = _mm512_setzero_ps();
          for (int j = 0; j < kBf16Regs; ++j)
            a[i] = _mm512_dpbf16_ps(a[i], qv[j], (__m512bh)_mm512_loadu_si512(rows + (t + i) * D + 32 * j));
        }
        _mm512_storeu_ps(s + t, _mm512_mul_ps(sum16(a), scale_v));
      }
      for (; t < count; ++t) {  // a block's ragged tail
        __m512 a = _mm512_setzero_ps();
        for (int j = 0; j < kBf16Regs; ++j)
          a = _mm512_dpbf16_ps(a, qv[j], (__m512bh)_mm512_loadu_si512(rows + t * D + 32 * j));
        s[t] = _mm512_reduce_add_ps(a) * scale;
      }
    }
  });
  for (int64_t g = 0; g < group; ++g) sum[g] = exp_row(scores + g * len, len, mx + g);
  for_each_block(v_head, table, block_size, first, last, D, [&](int64_t pos, const uint16_t* rows, int64_t count) {
    for (int64_t g = 0; g < group; g += kHeadsPerPass) {
      const float* p = scores + g * len + pos - first;
      const int64_t heads = std::min<int64_t>(kHeadsPerPass, group - g);
      if constexpr (kHeadsPerPass == 4) {
        if (heads == 4) add_weighted_rows<D, 4>(acc + g * D, p, len, rows, count);
        if (heads == 3) add_weighted_rows<D, 3>(acc + g * D, p, len, rows, count);
      }
      if (heads == 2) add_weighted_rows<D, 2>(acc + g * D, p, len, rows, count);
      if (heads == 1) add_weighted_rows<D, 1>(acc + g * D, p, len, rows, count);
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Any float cache on AVX2 + FMA (fp32 models on CPUs without native bf16 above all: Zen 2/3, pre-AVX512 Intel).
// The same plan as the bf16 kernel, in 8-lane registers: q.k by fp32 FMAs over eight keys at a time, summed into
// one vector of eight scores by a horizontal-add tree (sum8); p.v by FMAs into one head's accumulators, 64 lanes
// of D per pass, V rows re-read from L1 for each pass. Rows are widened to fp32 as they load (bf16 by a shift,
// fp16 by F16C), so every product and sum is fp32, as native computes.
template <typename R>
inline __m256 load8(const R* p);
template <>
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8(const uint16_t* p) {  // bf16
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#if defined(__F16C__) && defined(__FLT16_MAX__)
template <>
inline __m256 load8(const _Float16* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#endif

// Element i: the horizontal sum of v[i] (8 fp32 vectors).
inline __m256 sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

template <typename R, int D>
void decode_part_avx2(float* acc, float* mx, float* sum, const R* q, float scale, const R* k_head, const R* v_head,
                      const int32_t* table, int64_t block_size, int64_t first, int64_t last, int64_t group,
                      std::vector<float>& scratch) {
  constexpr int kRegs = D / 8;
  const int64_t len = last - first;
  std::fill(acc, acc + group * D, 0.0f);
  if (len <= 0) {
    std::fill(mx, mx + group, -INFINITY);
    std::fill(sum, sum + group, 0.0f);
    return;
  }
  prefetch_start(k_head, v_head, table, block_size, first, last, D);
  scratch.resize(group * len + group * D);
  float* scores = scratch.data();
  float* qf = scores + group * len;  // q widened once
  for (int64_t i = 0; i < group * D; i += 8) _mm256_storeu_ps(qf + i, load8(q + i));
  const __m256 scale_v = _mm256_set1_ps(scale);
  for_each_block(k_head, table, block_size, first, last, D, [&](int64_t pos, const R* rows, int64_t count) {
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * D;
      float* s = scores + g * len + pos - first;
      int64_t t = 0;
      for (; t + 8 <= count; t += 8) {
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
        for (int j = 0; j < kRegs; ++j) {
          const __m256 qv = _mm256_loadu_ps(qg + 8 * j);
          for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, load8(rows + (t + i) * D + 8 * j), a[i]);
        }
        _mm256_storeu_ps(s + t, _mm256_mul_ps(sum8(a), scale_v));
      }
      for (; t < count; ++t) {  // a block's ragged tail
        __m256 a = _mm256_setzero_ps();
        for (int j = 0; j < kRegs; ++j) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j), load8(rows + t * D + 8 * j), a);
        s[t] = hsum8(a) * scale;
      }
    }
  });
  for (int64_t g = 0; g < group; ++g) sum[g] = exp_row(scores + g * len, len, mx + g);
  constexpr int kPass = std::min(D, 64) / 8;  // accumulators per pass: 8 registers
  for_each_block(v_head, table, block_size, first, last, D, [&](int64_t pos, const R* rows, int64_t count) {
    for (int64_t g = 0; g < group; ++g) {
      const float* p = scores + g * len + pos - first;
      for (int c = 0; c < D; c += 8 * kPass) {
        __m256 a[kPass];
        for (int j = 0; j < kPass; ++j) a[j] = _mm256_loadu_ps(acc + g * D + c + 8 * j);
        for (int64_t t = 0; t < count; ++t) {
          const __m256 pv = _mm256_broadcast_ss(p + t);
          for (int j = 0; j < kPass; ++j) a[j] = _mm256_fmadd_ps(pv, load8(rows + t * D + c + 8 * j), a[j]);
        }
        for (int j = 0; j < kPass; ++j) _mm256_storeu_ps(acc + g * D + c + 8 * j, a[j]);
      }
    }
  });
}
#endif

constexpr int64_t kMinPartKeys = 256;  // keys per part at least: below that the split costs more than it gains
constexpr int64_t kMaxParts = 64;

// One step's decode attention from a part kernel (decode_part_bf16, decode_part_avx2): each (sequence, KV head)
// item's keys in one part, or, with fewer items than twice the threads (batch-1 decode: 3 KV heads on 2 cores left
// one core a third idle), its key range split into parts that run on all threads and merge by their maxima
// (flash-decoding): out = sum_p e^(mx_p - M) acc_p / sum_p e^(mx_p - M) sum_p, rounded once to T.
template <typename T, int D, typename Part>
void decode_split(raw_t<T>* out, const raw_t<T>* q, int64_t q_stride, const raw_t<T>* cache, const int32_t* tables,
                  int64_t table_stride, const int32_t* seq_lens, int64_t batch, int64_t heads, int64_t kv_heads,
                  int64_t blocks, int64_t block_size, float scale, int64_t window, Part&& part_kernel) {
  const int64_t group = heads / kv_heads, items = batch * kv_heads;
  const int64_t head_stride = blocks * block_size * D, plane = kv_heads * head_stride;
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max<int64_t>(longest, seq_lens[b]);
  if (window > 0) longest = std::min(longest, window);
  const int64_t threads = at::get_num_threads();
  const int64_t parts = items >= 2 * threads ? 1
                        : std::clamp<int64_t>(std::min((2 * threads + items - 1) / items, longest / kMinPartKeys), 1,
                                              kMaxParts);
  const int64_t units = items * parts, width = group * D;
  std::vector<float> acc(units * width), mx(units * group), sum(units * group);
  const auto merge = [&](int64_t item) {
    raw_t<T>* o = out + ((item / kv_heads) * heads + (item % kv_heads) * group) * D;
    for (int64_t g = 0; g < group; ++g) {
      float top = -INFINITY, total = 0.0f, weight[kMaxParts];
      for (int64_t p = 0; p < parts; ++p) top = std::max(top, mx[(item * parts + p) * group + g]);
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t u = (item * parts + p) * group + g;
        weight[p] = sum[u] > 0.0f ? std::exp(mx[u] - top) : 0.0f;
        total += weight[p] * sum[u];
      }
      const float inv = 1.0f / total;
      for (int64_t i = 0; i < D; ++i) {
        float v = 0.0f;
        for (int64_t p = 0; p < parts; ++p) v += weight[p] * acc[(item * parts + p) * width + g * D + i];
        o[g * D + i] = Io<T>::store(v * inv);
      }
    }
  };
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t item = unit / parts, part = unit % parts, b = item / kv_heads, h = item % kv_heads;
      const int64_t len = seq_lens[b], first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t span = (len - first + parts - 1) / parts;
      const int64_t lo = std::min(len, first + part * span), hi = std::min(len, lo + span);
      part_kernel(acc.data() + unit * width, mx.data() + unit * group, sum.data() + unit * group,
                  q + b * q_stride + h * width, scale, cache + h * head_stride, cache + plane + h * head_stride,
                  tables + b * table_stride, block_size, lo, hi, group, scratch);
      if (parts == 1) merge(item);  // a whole range: finish it while its accumulators are still in cache
    }
  });
  if (parts > 1) at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) merge(item);
  });
}

// Whether this build has a part kernel for T at head size D (then decode_split serves; else decode_item).
template <typename T, int D>
constexpr bool kHasPartKernel =
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16> ||
#endif
#if defined(__AVX2__) && defined(__FMA__)
    std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> ||
#if defined(__F16C__) && defined(__FLT16_MAX__)
    std::is_same_v<T, c10::Half> ||
#endif
#endif
    false;

template <typename T, int D>
void decode_split_for(raw_t<T>* out, const raw_t<T>* q, int64_t q_stride, const raw_t<T>* cache,
                      const int32_t* tables, int64_t table_stride, const int32_t* seq_lens, int64_t batch,
                      int64_t heads, int64_t kv_heads, int64_t blocks, int64_t block_size, float scale,
                      int64_t window) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return decode_split<T, D>(out, q, q_stride, cache, tables, table_stride, seq_lens, batch, heads, kv_heads, blocks,
                              block_size, scale, window, decode_part_bf16<D>);
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kHasPartKernel<T, D>) {
    return decode_split<T, D>(out, q, q_stride, cache, tables, table_stride, seq_lens, batch, heads, kv_heads, blocks,
                              block_size, scale, window, decode_part_avx2<raw_t<T>, D>);
  }
#endif
}

template <typename T>
void decode_kernel(raw_t<T>* out, const raw_t<T>* q, int64_t q_stride, const raw_t<T>* cache, const int32_t* tables,
                   int64_t table_stride, const int32_t* seq_lens, int64_t batch, int64_t heads, int64_t kv_heads,
                   int64_t blocks, int64_t block_size, int64_t d, float scale, int64_t window) {
  if constexpr (kHasPartKernel<T, 64>) {
    if (d == 64 || d == 128)
      return (d == 64 ? decode_split_for<T, 64> : decode_split_for<T, 128>)(
          out, q, q_stride, cache, tables, table_stride, seq_lens, batch, heads, kv_heads, blocks, block_size, scale,
          window);
  }
  const int64_t group = heads / kv_heads;
  const int64_t head_stride = blocks * block_size * d, plane = kv_heads * head_stride;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const raw_t<T>* k_head = cache + h * head_stride;
      const raw_t<T>* qh = q + b * q_stride + h * group * d;
      raw_t<T>* oh = out + (b * heads + h * group) * d;
      const int32_t* table = tables + b * table_stride;
      decode_item<T>(oh, qh, scale, k_head, k_head + plane, table, block_size, first, len, group, d, scratch);
    }
  });
}

// q (B, H*D) with contiguous rows; kv_cache (2, Hk, blocks, block_size, D); block_tables (B, >= blocks needed)
// int32; seq_lens (B,) int32. window <= 0: none. Returns (B, H*D).
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                                     int64_t num_heads, double scale, int64_t window) {
  check_rows(q, "q");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be contiguous (2, Hk, blocks, bs, D)");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q must have the cache's dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1, "block_tables must be int32 rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens must be contiguous int32");
  const int64_t batch = q.size(0), kv_heads = kv_cache.size(1), d = kv_cache.size(4);
  TORCH_CHECK(q.size(1) == num_heads * d && num_heads % kv_heads == 0, "q must be (B, num_heads * head_size)");
  TORCH_CHECK(block_tables.size(0) >= batch && seq_lens.size(0) == batch, "one block table and length per sequence");
  const int64_t width = block_tables.size(1), block_size = kv_cache.size(3), blocks = kv_cache.size(2);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = seq_lens.const_data_ptr<int32_t>()[b];
    TORCH_CHECK(len >= 1 && len <= width * block_size, "sequence length ", len, " outside its block table");
    const int32_t* row = block_tables.const_data_ptr<int32_t>() + b * block_tables.stride(0);
    for (int64_t j = 0; j < (len + block_size - 1) / block_size; ++j)
      TORCH_CHECK(row[j] >= 0 && row[j] < blocks, "block id ", row[j], " outside the cache");
  }
  auto out = torch::empty({batch, num_heads * d}, q.options());
  dispatch_float(q.scalar_type(), "paged_decode_attention", [&](auto tag) {
    using scalar_t = decltype(tag);
    decode_kernel<scalar_t>(raw_ptr<scalar_t>(out), raw_ptr<scalar_t>(q), q.stride(0), raw_ptr<scalar_t>(kv_cache),
                            block_tables.const_data_ptr<int32_t>(), block_tables.stride(0),
                            seq_lens.const_data_ptr<int32_t>(), batch, num_heads, kv_heads, kv_cache.size(2),
                            kv_cache.size(3), d, static_cast<float>(scale), window);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Greedy choice: the first index of each row's largest value, a NaN counting as largest (torch.argmax's rule).
// torch's CPU argmax is a scalar loop, 45 us for one 49152-entry row of logits and 0.67 ms for 32 rows; here one
// vector pass finds the maximum (and whether a NaN is present) and a second stops at its first occurrence.
int64_t argmax_row(const float* v, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 a = _mm512_loadu_ps(v + i);
    unordered |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    vm = _mm512_max_ps(vm, a);
  }
  m = _mm512_reduce_max_ps(vm);
  nan = unordered != 0;
#endif
  for (; i < n; ++i) {
    nan |= std::isnan(v[i]);
    m = v[i] > m ? v[i] : m;
  }
  i = 0;
#if defined(__AVX512F__)
  if (!nan) {
    const __m512 target = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
      const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + i), target, _CMP_EQ_OQ);
      if (hit) return i + __builtin_ctz(hit);
    }
  }
#endif
  for (; i < n; ++i)
    if (nan ? std::isnan(v[i]) : v[i] == m) return i;
  return 0;
}

// x (rows, n) float32 with contiguous rows -> (rows,) int64.
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "x must be float32 (rows, n) with contiguous, non-empty rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  const float* p = x.const_data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(p + r * stride, n);
  });
  return out;
}


// One draw per row from softmax(logits) at a uniform u (hal/ops.py's random_sample): weights exp(l - max) in fp32,
// summed in fp64 a block of 16 at a time (4 chains per block, so the sum is not one serial chain of adds); the
// total is the sum of the block sums, and the draw walks the block sums to the block where the cumulative weight
// passes u x total, then that block's weights. A block whose own walk falls short of the target by rounding (its
// weights added in another order than its sum) gives its last token of nonzero weight.
constexpr int64_t kSampleBlock = 16;

int64_t sample_row(const float* logits, int64_t n, double u, std::vector<float>& w, std::vector<double>& sums) {
  w.assign(logits, logits + n);
  float mx;
  exp_row(w.data(), n, &mx);
  const int64_t blocks = (n + kSampleBlock - 1) / kSampleBlock;
  sums.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kSampleBlock, hi = std::min(n, lo + kSampleBlock);
    double part[4] = {0.0, 0.0, 0.0, 0.0};
    for (int64_t i = lo; i < hi; ++i) part[i & 3] += w[i];
    sums[b] = (part[0] + part[1]) + (part[2] + part[3]);
    total += sums[b];
  }
  const double target = u * total;
  double acc = 0.0;
  int64_t last = n - 1;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kSampleBlock, hi = std::min(n, lo + kSampleBlock);
    if (sums[b] > 0.0) last = hi - 1;
    if (acc + sums[b] <= target) {
      acc += sums[b];
      continue;
    }
    int64_t pick = lo;
    for (int64_t i = lo; i < hi; ++i) {
      if (w[i] > 0.0f) pick = i;
      acc += w[i];
      if (acc > target) return i;
    }
    return pick;
  }
  while (last > 0 && w[last] == 0.0f) --last;  // u x total not passed at all (rounding): the last token of weight
  return last;
}

torch::Tensor random_sample(const torch::Tensor& logits, const torch::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be float32 (rows, n) with contiguous, non-empty rows");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.scalar_type() == at::kDouble && uniforms.size(0) == logits.size(0),
              "uniforms must be float64, one per row");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(at::kLong));
  const float* p = logits.const_data_ptr<float>();
  const auto u = uniforms.contiguous();
  const double* up = u.const_data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> w;
    std::vector<double> sums;
    for (int64_t r = r0; r < r1; ++r) o[r] = sample_row(p + r * stride, n, up[r], w, sums);
  });
  return out;
}

}  // namespace

// quant_kernels.cpp: linear layers over weights kept quantised (GGUF blocks, per-channel int8).
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& qweight, const std::string& qtype,
                        const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias);
at::Tensor quant_dequantize(const at::Tensor& qweight, const std::string& qtype,
                            const c10::optional<at::Tensor>& scales, at::ScalarType dtype);
at::Tensor quant_matmul_bf16(const at::Tensor& x, const at::Tensor& qweight, const std::string& qtype,
                             const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias,
                             bool amx);

// prefill_attention_f32.cpp: the same in fp32 on AVX2 + FMA (register-tiled GEMMs, no AMX).
bool flash_prefill_f32_available();
at::Tensor flash_prefill_attention_f32(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                       int64_t seq_len, int64_t num_heads, double scale);

// bf16_linear.cpp: bf16 linear over a weight packed once into panels.
int64_t bf16_panel_width();
bool bf16_panels_available();
at::Tensor bf16_panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                             const c10::optional<at::Tensor>& bias);
// fp32_linear.cpp: fp32 linear for the few rows of a decode step, over the weight as it lies.
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// prefill_attention.cpp: causal prefill attention of one sequence on torch's brgemm ukernels (AMX tiles).
bool flash_prefill_available();
at::Tensor flash_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                   int64_t seq_len, int64_t num_heads, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over rows");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual add then RMSNorm; returns (normed, residual)");
  m.def("rotary", &rotary, "rotary embedding of q and k, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :d]) * x[:, d:]");
  m.def("write_kv", &write_kv, "store new keys and values at their slots of the head-major cache");
  m.def("fp32_linear", &fp32_linear, "fp32 x @ weight.T + bias for 1-32 rows (AVX2 + FMA)");
  m.def("paged_decode_attention", &paged_decode_attention, "one-query-per-sequence attention over a paged cache");
  m.def("flash_prefill_available", &flash_prefill_available, "whether torch's brgemm packs bf16 here (AMX)");
  m.def("flash_prefill_attention", &flash_prefill_attention,
        "causal attention of one sequence's chunk over its paged keys and values, bf16, flash style on brgemm");
  m.def("flash_prefill_f32_available", &flash_prefill_f32_available, "whether this build has AVX2 + FMA");
  m.def("flash_prefill_attention_f32", &flash_prefill_attention_f32,
        "causal attention of one sequence's chunk over its paged keys and values, fp32, or bf16 (its products by vdpbf16ps on AVX512-BF16), "
        "flash style (AVX2)");
  m.def("bf16_panel_width", &bf16_panel_width, "output rows per panel of bf16_panel_linear's weight");
  m.def("bf16_panels_available", &bf16_panels_available, "whether this build has AVX512-BF16");
  m.def("bf16_panel_linear", &bf16_panel_linear, "bf16 x @ weight.T + bias over a weight packed into panels");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (NaN counts as largest)");
  m.def("random_sample", &random_sample, "one draw per row from softmax(logits) at a uniform (inverse CDF)");
  m.def("quant_matmul", &quant_matmul, "x @ dequantize(qweight).T * scales + bias, weights unpacked row by row");
  m.def("quant_dequantize", &quant_dequantize, "quantised rows -> (N, K) float32 or bfloat16");
  m.def("quant_matmul_bf16", &quant_matmul_bf16, "bf16 x @ bf16-rounded unpacked weights, for batches of rows",
        py::arg("x"), py::arg("qweight"), py::arg("qtype"), py::arg("scales"), py::arg("bias"), py::arg("amx") = false);
}
