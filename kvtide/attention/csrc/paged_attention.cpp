// Paged attention on CPU: each query reads its request's K/V in place from the paged cache through
// the block table (no gather copy), with an online softmax over blocks.
//
//   float cache:     kv_cache (2, H_kv, num_blocks, block_size, D)    the torch backend's head-major
//                    layout, in float32, bfloat16 or float16 whatever the query's dtype
//   quantized cache: kv_cache (H_kv, num_blocks, block_bytes) uint8   kv_compression/formats.py's
//                    layout: per KV head and block [K codes | V codes | K params | V params]
//   query, out: (T, H, D), tokens packed; row r owns tokens [qsl[r], qsl[r+1])
//
// One work item is (row, KV head, partition): the H / H_kv query heads of the group and every query
// token of the row share each K/V block read. A partition is a run of the blocks the row visits (its
// sink blocks, then its window's); rows are split into several only when there are too few
// (row, KV head) items to keep every thread busy, and the partitions are merged by log-sum-exp
// afterwards. A block that is not float32 is converted (dequantized) into the thread's float
// workspace when it is read, then attended by the same code that reads float32 blocks in place.
//
// write_kv copies this step's K/V into a float cache; write_kv_quant quantizes this step's K/V into
// the quantized layout, byte for byte as formats.py's reference codec does.
//
// The same source is compiled once per ISA (cpu_extension.py): CPU_CAPABILITY selects at::vec's
// implementation and KVTIDE_OPS_NS names both the C++ namespace and the op library, so builds for
// several ISAs can live in one process.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#ifndef KVTIDE_OPS_NS
#define KVTIDE_OPS_NS kvtide_default
#endif
// TORCH_LIBRARY pastes its namespace argument: expand the macro first.
#define KVTIDE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace KVTIDE_OPS_NS {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kV = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Weights below e^-64 of the running max become exactly 0: as subnormal floats they would make
// every later multiply a microcode assist on x86.
constexpr float kCutoff = 64.f;
// Fewest tokens a partition holds, and items per thread aimed at when splitting. Measured on batch-1
// decode with 3 KV heads on 2 threads: a context of 384 is faster whole (the merge's second parallel
// region costs more than the imbalance), one of 4096 about 10% faster in partitions of 1-2k tokens.
constexpr int64_t kMinPartitionTokens = 512;
constexpr int64_t kItemsPerThread = 4;
// Queries that share one load of a K or V vector.
constexpr int kTile = 4;

// Code kinds of a quantized cache, numbered as formats.KIND_IDS.
constexpr int64_t kFp8E4m3 = 0, kFp8E5m2 = 1, kInt8 = 2, kInt4 = 3;

// ---- conversions to float ------------------------------------------------------------------------
// Written branch-free and without a subnormal float operand, so that the loops over a block vectorize
// and never take a microcode assist; each is exact.

inline float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline uint32_t to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// float16 bits -> float (the FP16 library's method, which c10 uses without F16C): normals and inf/NaN
// by rebiasing the exponent, subnormals as a difference of two floats.
inline float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normal = from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1p-112f;
  const float subnormal = from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return from_bits(sign | to_bits(two_w < (1u << 27) ? subnormal : normal));
}

// fp8 e5m2 is the high byte of a float16.
inline float e5m2_to_float(uint8_t b) { return half_to_float(static_cast<uint16_t>(b << 8)); }

// fp8 e4m3fn: normals by rebiasing the exponent (7 -> 127), subnormals (m * 2^-9) as 2^14 + m * 2^-9
// less 2^14; 0x7f / 0xff are its only NaNs (it has no infinity).
inline float e4m3_to_float(uint8_t b) {
  const uint32_t u = b & 0x7fu, sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const float normal = from_bits((u << 20) + (120u << 23));
  const float subnormal = from_bits(u | (141u << 23)) - 0x1p14f;
  const uint32_t magnitude = u == 0x7fu ? 0x7fc00000u : to_bits(u < 8 ? subnormal : normal);
  return from_bits(sign | magnitude);
}

using IVec = at::vec::Vectorized<int32_t>;
static_assert(IVec::size() == kV, "int32 and float lanes must pair up");

// kV bytes at p widened into int32 lanes: sign-extended (int8 codes) or zero-extended.
template <bool kSigned>
inline IVec widen_bytes(const uint8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
#else
  int32_t lanes[kV];
  for (int64_t i = 0; i < kV; ++i) lanes[i] = kSigned ? static_cast<int8_t>(p[i]) : p[i];
  return IVec::loadu(lanes);
#endif
}

// kV fp8 codes at p -> float(code) * scale, where scale256 = 256 * scale (exact). Through the
// hardware's float16 conversion: e5m2 is a float16's high byte, and an e4m3 code whose magnitude
// bits sit at float16 bits 7-13 is the float16 of its value / 256, subnormals included (0x7f, its
// NaN, is patched). Both products round once, as the reference's float(code) * scale.
template <int64_t kind>
inline Vec fp8_to_vec(const uint8_t* p, float scale, float scale256) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if constexpr (kind == kFp8E5m2) return Vec(_mm512_cvtph_ps(_mm256_slli_epi16(w, 8))) * Vec(scale);
  const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
  const __m512 x = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(_mm256_slli_epi16(mag, 7), sign)),
                                 _mm512_set1_ps(scale256));
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
  return _mm512_mask_blend_ps(nan, x, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if constexpr (kind == kFp8E5m2) return Vec(_mm256_cvtph_ps(_mm_slli_epi16(w, 8))) * Vec(scale);
  const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7f));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
  const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(mag, 7), sign)),
                                 _mm256_set1_ps(scale256));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f))));
  return _mm256_blendv_ps(x, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
#else
  float lanes[kV];
  for (int64_t i = 0; i < kV; ++i)
    lanes[i] = (kind == kFp8E4m3 ? e4m3_to_float(p[i]) : e5m2_to_float(p[i])) * scale;
  return Vec::loadu(lanes);
#endif
}

inline float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return half_to_float(h);
}

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(bits[i]);
}

inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void from_float(const float* src, c10::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
inline float hsum(const Vec& v) { return v.reduce_add(); }
inline float hmax(const Vec& v) { return v.reduce_max(); }
#else
inline float hsum(const Vec& v) {  // the generic Vectorized's reduce_add does not compile
  float lanes[kV];
  v.store(lanes);
  float s = 0.f;
  for (int64_t i = 0; i < kV; ++i) s += lanes[i];
  return s;
}
inline float hmax(const Vec& v) {
  float lanes[kV];
  v.store(lanes);
  float m = lanes[0];
  for (int64_t i = 1; i < kV; ++i) m = std::max(m, lanes[i]);
  return m;
}
#endif

// The lines of the block a query reads next, asked for a few at a time while it attends this one:
// K's in dots, per vector of keys and query (step<0>), V's in weighted_sum, per key (step<1>).
// Asked for all at once, they filled the core's line-fill buffers, and the FMAs of the block being
// attended waited behind them: a decode step's attention took as long as reading its K/V plus
// computing on it, not the larger of the two. Into L2 (prefetcht1): a block is used once, within the
// next block's time. A step asks for the same number of lines all block long (no running fraction):
// the loop's count is then one the branch predictor knows, and the accounting costs little (a
// fractional version cost ~40% of the kernel's time on cached K/V). dots and weighted_sum step a
// local copy, kept in registers.
struct Lines {
  const char* at[2] = {nullptr, nullptr};  // the next line of K and of V (halves of a quantized block)
  const char* end[2] = {nullptr, nullptr};
  int64_t per[2] = {0, 0};                  // lines per step<i>

  // step<0> is called k_steps times (in dots), step<1> v_steps times (in weighted_sum).
  void spread(int64_t k_steps, int64_t v_steps) {
    const int64_t steps[2] = {k_steps, v_steps};
    for (int i = 0; i < 2; ++i) {
      const int64_t lines = (end[i] - at[i]) / 64;
      per[i] = steps[i] > 0 ? (lines + steps[i] - 1) / steps[i] : 0;
    }
  }
  // Branch-free but for a loop count fixed for the whole block: past the end, the last line again.
  template <int i>
  inline void step() {
    for (int64_t n = 0; n < per[i]; ++n) {
      __builtin_prefetch(at[i], 0, 2);
      at[i] = std::min(at[i] + 64, end[i] - 64);
    }
  }
  void finish() {  // whatever the steps left
    for (int i = 0; i < 2; ++i) {
      for (; at[i] < end[i]; at[i] += 64) __builtin_prefetch(at[i], 0, 2);
    }
  }
};

// ---- attention -----------------------------------------------------------------------------------

#if defined(CPU_CAPABILITY_AVX512)
// Lane i of the result = the sum of v[i]'s lanes, for kV = 16 vectors: pairs and quads are added
// within 128-bit lanes, then across them: ~3 shuffles and an add per vector where a reduce_add
// each would take ~8 dependent steps.
inline Vec transpose_sum(const Vec* v) {
  __m512 q[4];
  for (int g = 0; g < 4; ++g) {
    const __m512 a = v[4 * g], b = v[4 * g + 1], c = v[4 * g + 2], d = v[4 * g + 3];
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    q[g] = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // [a b c d] per 128-bit lane
  }
  const __m512 r01 = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 r23 = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(q[2], q[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r01, r23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(r01, r23, _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(CPU_CAPABILITY_AVX2)
// As above for kV = 8 vectors of 8.
inline Vec transpose_sum(const Vec* v) {
  __m256 q[2];
  for (int g = 0; g < 2; ++g) {
    const __m256 a = v[4 * g], b = v[4 * g + 1], c = v[4 * g + 2], d = v[4 * g + 3];
    const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    q[g] = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(q[0], q[1], 0x20), _mm256_permute2f128_ps(q[0], q[1], 0x31));
}
#endif

// scores[t][j] = q_t . k_j for N queries and keys j in [ja, jb) of a (block_size, D) block. With
// AVX2/AVX-512, kV keys at a time: one accumulator per key, reduced together by transpose_sum.
template <int N>
inline void dots(const float* const* q, const float* k, int64_t ja, int64_t jb, int64_t D,
                 float* const* scores, Lines& lines) {
  Lines pf = lines;  // in registers, not stored back at every step
  int64_t j = ja;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const int64_t dv = D - D % kV;
  for (; j + kV <= jb; j += kV) {
    const float* kj = k + j * D;
    for (int t = 0; t < N; ++t) {
      Vec acc[kV];
#pragma GCC unroll 16
      for (int64_t i = 0; i < kV; ++i) acc[i] = Vec(0.f);
      pf.step<0>();
      for (int64_t c = 0; c < dv; c += kV) {
        const Vec qc = Vec::loadu(q[t] + c);
#pragma GCC unroll 16
        for (int64_t i = 0; i < kV; ++i) acc[i] = at::vec::fmadd(qc, Vec::loadu(kj + i * D + c), acc[i]);
      }
      transpose_sum(acc).store(scores[t] + j);
      for (int64_t c = dv; c < D; ++c) {
        for (int64_t i = 0; i < kV; ++i) scores[t][j + i] += q[t][c] * kj[i * D + c];
      }
    }
  }
#endif
  for (; j < jb; ++j) {
    const float* kj = k + j * D;
    Vec acc[N];
    for (int t = 0; t < N; ++t) acc[t] = Vec(0.f);
    int64_t c = 0;
    for (; c + kV <= D; c += kV) {
      Vec kc = Vec::loadu(kj + c);
      for (int t = 0; t < N; ++t) acc[t] = at::vec::fmadd(Vec::loadu(q[t] + c), kc, acc[t]);
    }
    for (int t = 0; t < N; ++t) {
      float s = hsum(acc[t]);
      for (int64_t d = c; d < D; ++d) s += q[t][d] * kj[d];
      scores[t][j] = s;
    }
  }
  lines = pf;
}

// acc_t = acc_t * alpha_t + sum_j p_t[j] v_j for N queries over keys [ja, jb). kC chunks of D a pass
// keep N * kC independent FMA chains going (one chunk a pass left N, latency-bound); each element
// still sums its terms in key order.
constexpr int64_t kValueChunks = kV >= 16 ? 4 : 2;  // N * kC accumulators and kC values stay in registers

template <int N>
inline void weighted_sum(float* const* acc, const float* alpha, const float* const* p, const float* v,
                         int64_t ja, int64_t jb, int64_t D, Lines& lines) {
  Lines pf = lines;  // in registers, not stored back at every step
  constexpr int64_t kC = kValueChunks;
  int64_t c = 0;
  for (; c + kC * kV <= D; c += kC * kV) {
    Vec a[N][kC];
#pragma GCC unroll 4
    for (int t = 0; t < N; ++t)
#pragma GCC unroll 4
      for (int64_t u = 0; u < kC; ++u) a[t][u] = Vec::loadu(acc[t] + c + u * kV) * Vec(alpha[t]);
    for (int64_t j = ja; j < jb; ++j) {
      pf.step<1>();
      Vec vc[kC];
#pragma GCC unroll 4
      for (int64_t u = 0; u < kC; ++u) vc[u] = Vec::loadu(v + j * D + c + u * kV);
#pragma GCC unroll 4
      for (int t = 0; t < N; ++t) {
        const Vec pt(p[t][j]);
#pragma GCC unroll 4
        for (int64_t u = 0; u < kC; ++u) a[t][u] = at::vec::fmadd(pt, vc[u], a[t][u]);
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < N; ++t)
#pragma GCC unroll 4
      for (int64_t u = 0; u < kC; ++u) a[t][u].store(acc[t] + c + u * kV);
  }
  for (; c + kV <= D; c += kV) {
    Vec a[N];
#pragma GCC unroll 4
    for (int t = 0; t < N; ++t) a[t] = Vec::loadu(acc[t] + c) * Vec(alpha[t]);
    for (int64_t j = ja; j < jb; ++j) {
      Vec vc = Vec::loadu(v + j * D + c);
#pragma GCC unroll 4
      for (int t = 0; t < N; ++t) a[t] = at::vec::fmadd(Vec(p[t][j]), vc, a[t]);
    }
#pragma GCC unroll 4
    for (int t = 0; t < N; ++t) a[t].store(acc[t] + c);
  }
  for (; c < D; ++c) {
    for (int t = 0; t < N; ++t) {
      float a = acc[t][c] * alpha[t];
      for (int64_t j = ja; j < jb; ++j) a += p[t][j] * v[j * D + c];
      acc[t][c] = a;
    }
  }
  lines = pf;
}

// How many times dots<n> calls Lines::step<0> and weighted_sum<n> Lines::step<1> over `keys` keys.
inline int64_t key_steps(int64_t n, int64_t keys) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return (keys / kV) * n;
#else
  return 0;
#endif
}
inline int64_t value_steps(int64_t keys, int64_t D) { return keys * (D / (kValueChunks * kV)); }

// Scores in [ja, jb) -> weights relative to the query's new running max; returns the rescale factor
// of what it had accumulated. The query sees keys [lo, hi) and the sinks [0, sink_hi) below hi;
// the others get weight 0.
inline float softmax_step(float* s, int64_t ja, int64_t jb, int64_t sink_hi, int64_t lo, int64_t hi,
                          float& mx, float& sum) {
  for (int64_t j = std::max(ja, sink_hi); j < std::min(lo, jb); ++j) s[j] = kNegInf;
  for (int64_t j = std::max(hi, ja); j < jb; ++j) s[j] = kNegInf;
  float block_max = kNegInf;  // a max is exact: the vector's order gives the scalar loop's result
  int64_t k = ja;
  if (jb - ja >= kV) {
    Vec m = Vec::loadu(s + k);
    for (k += kV; k + kV <= jb; k += kV) m = at::vec::maximum(m, Vec::loadu(s + k));
    block_max = hmax(m);
  }
  for (; k < jb; ++k) block_max = std::max(block_max, s[k]);
  if (block_max == kNegInf) {  // nothing visible here: keep the state, add nothing
    for (int64_t j = ja; j < jb; ++j) s[j] = 0.f;
    return 1.f;
  }
  const float new_max = std::max(mx, block_max);
  const float shift = mx - new_max;  // -inf for the first visible block
  // the max often stays where it was: exp(0) is 1 without the call
  const float alpha = shift == 0.f ? 1.f : shift < -kCutoff ? 0.f : std::exp(shift);
  const Vec vmax(new_max), vcut(-kCutoff), vzero(0.f);
  Vec vsum(0.f);
  int64_t j = ja;
  for (; j + kV <= jb; j += kV) {
    Vec x = Vec::loadu(s + j) - vmax;
    Vec w = Vec::blendv(x.exp_u20(), vzero, x < vcut);
    w.store(s + j);
    vsum = vsum + w;
  }
  float total = hsum(vsum);
  for (; j < jb; ++j) {
    float x = s[j] - new_max;
    s[j] = x < -kCutoff ? 0.f : std::exp(x);
    total += s[j];
  }
  mx = new_max;
  sum = sum * alpha + total;
  return alpha;
}

struct Problem {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, num_blocks;
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h, table_stride;
  int64_t window;       // <= 0: none
  int64_t sink_tokens;  // keys [0, sink_tokens) stay visible past the window; 0 without one
  float scale;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* qsl;
};

// A row's key range and the blocks it visits: its first sink_blocks blocks (the sinks' blocks that
// precede the window's), then [first_block, end_block).
struct RowSpan {
  int64_t q_start, q_len, seq_len, key_lo, sink_blocks, first_block, end_block;
  int64_t visits() const { return sink_blocks + end_block - first_block; }
  int64_t block(int64_t i) const { return i < sink_blocks ? i : first_block + i - sink_blocks; }
};

inline RowSpan row_span(const Problem& p, int64_t r) {
  RowSpan s;
  s.q_start = p.qsl[r];
  s.q_len = p.qsl[r + 1] - p.qsl[r];
  s.seq_len = p.seq_lens[r];
  const int64_t first_pos = s.seq_len - s.q_len;
  s.key_lo = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
  s.first_block = s.key_lo / p.block_size;
  s.end_block = (s.seq_len + p.block_size - 1) / p.block_size;
  const int64_t sinks = std::min(p.sink_tokens, s.seq_len);
  s.sink_blocks = std::min((sinks + p.block_size - 1) / p.block_size, s.first_block);
  return s;
}

// Per-thread buffers, kept between calls (they only grow).
struct Workspace {
  std::vector<float> q, acc, mx, sum, scores, k, v, out;
  void reserve(int64_t queries, const Problem& p, bool convert_kv) {
    const int64_t D = p.head_dim, B = p.block_size;
    grow(q, queries * D);
    grow(acc, queries * D);
    grow(mx, queries);
    grow(sum, queries);
    grow(scores, queries * B);
    grow(out, D);
    if (convert_kv) {
      grow(k, B * D);
      grow(v, B * D);
    }
  }
  static void grow(std::vector<float>& buf, int64_t n) {
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  }
};

// ---- where a block's K and V come from -----------------------------------------------------------
// A source's load(h, block, ja, jb, w) gives KV head h's K and V of cache block `block` as float
// (block_size, D) arrays whose rows [ja, jb) hold the keys attended; lines(h, block) are the bytes a
// later load(h, block, ...) reads. A row's blocks lie anywhere in the pool, where the hardware
// prefetchers cannot follow, so each block is asked for while the one before is attended.

struct KVRows {
  const float* k;
  const float* v;
};

// A float cache: float32 blocks are read in place, bfloat16 and float16 ones converted.
template <typename cache_t>
struct FloatBlocks {
  static constexpr bool kConverts = !std::is_same_v<cache_t, float>;
  const cache_t* kv;
  int64_t num_kv_heads, head_elems, block_elems, D;  // one head's cache, one block, one token

  KVRows load(int64_t h, int64_t block, int64_t ja, int64_t jb, Workspace& w) const {
    const cache_t* k = kv + h * head_elems + block * block_elems;
    const cache_t* v = kv + (num_kv_heads + h) * head_elems + block * block_elems;
    if constexpr (kConverts) {
      to_float(k + ja * D, w.k.data() + ja * D, (jb - ja) * D);
      to_float(v + ja * D, w.v.data() + ja * D, (jb - ja) * D);
      return {w.k.data(), w.v.data()};
    } else {
      return {k, v};
    }
  }

  Lines lines(int64_t h, int64_t block) const {
    Lines l;
    const char* k = reinterpret_cast<const char*>(kv + h * head_elems + block * block_elems);
    const char* v = reinterpret_cast<const char*>(kv + (num_kv_heads + h) * head_elems + block * block_elems);
    l.at[0] = k; l.end[0] = k + block_elems * sizeof(cache_t);
    l.at[1] = v; l.end[1] = v + block_elems * sizeof(cache_t);
    return l;
  }
};

// K or V inside a quantized block: its kind, the byte offsets of its codes and per-token params,
// their widths per token, and fp8's per-tensor scale.
struct Section {
  int64_t kind, codes, params, code_bytes, param_bytes;
  float scale;
};

inline int64_t code_bytes(int64_t kind, int64_t D) { return kind == kInt4 ? D / 2 : D; }
inline int64_t param_bytes(int64_t kind) { return kind == kInt8 ? 2 : kind == kInt4 ? 4 : 0; }

// formats.KVQuantFormat.layout: [K codes | V codes | K params | V params] in each head's block.
struct QuantLayout {
  Section k, v;
  int64_t block_bytes;
  QuantLayout(int64_t k_kind, int64_t v_kind, int64_t B, int64_t D, float k_scale, float v_scale) {
    k = {k_kind, 0, 0, code_bytes(k_kind, D), param_bytes(k_kind), k_scale};
    v = {v_kind, B * k.code_bytes, 0, code_bytes(v_kind, D), param_bytes(v_kind), v_scale};
    k.params = v.codes + B * v.code_bytes;
    v.params = k.params + B * k.param_bytes;
    block_bytes = v.params + B * v.param_bytes;
  }
};

// fp8 codes [a, b) -> dst[a, b).
template <int64_t kind>
inline void dequantize_fp8(const uint8_t* codes, int64_t a, int64_t b, float scale, float* dst) {
  const float scale256 = scale * 256.f;
  int64_t i = a;
  for (; i + kV <= b; i += kV) fp8_to_vec<kind>(codes + i, scale, scale256).store(dst + i);
  for (; i < b; ++i) dst[i] = (kind == kFp8E4m3 ? e4m3_to_float(codes[i]) : e5m2_to_float(codes[i])) * scale;
}

// Tokens [ja, jb) of a section of `block` -> dst (block_size, D), as formats.dequantize computes them:
// each value is a product rounded once (int8's and int4's products are exact), int4's plus its min.
inline void dequantize(const Section& s, const uint8_t* block, int64_t ja, int64_t jb, int64_t D,
                       float* dst) {
  const uint8_t* codes = block + s.codes;
  const uint8_t* params = block + s.params;
  switch (s.kind) {
    case kFp8E4m3:
      dequantize_fp8<kFp8E4m3>(codes, ja * D, jb * D, s.scale, dst);
      break;
    case kFp8E5m2:
      dequantize_fp8<kFp8E5m2>(codes, ja * D, jb * D, s.scale, dst);
      break;
    case kInt8:
      for (int64_t j = ja; j < jb; ++j) {
        const float scale = load_half(params + 2 * j);
        const uint8_t* c = codes + j * D;
        float* row = dst + j * D;
        int64_t d = 0;
        for (; d + kV <= D; d += kV)
          (at::vec::convert_to_fp_of_same_size<float>(widen_bytes<true>(c + d)) * Vec(scale)).store(row + d);
        for (; d < D; ++d) row[d] = static_cast<float>(static_cast<int8_t>(c[d])) * scale;
      }
      break;
    default: {  // int4: byte i holds dims i (low nibble) and i + D/2
      const int64_t half = D / 2;
      for (int64_t j = ja; j < jb; ++j) {
        const float step = load_half(params + 4 * j), lo = load_half(params + 4 * j + 2);
        const uint8_t* c = codes + j * half;
        float* row = dst + j * D;
        int64_t i = 0;
        const Vec vlo(lo), vstep(step);
        for (; i + kV <= half; i += kV) {
          const IVec w = widen_bytes<false>(c + i);
          (vlo + at::vec::convert_to_fp_of_same_size<float>(w & IVec(15)) * vstep).store(row + i);
          (vlo + at::vec::convert_to_fp_of_same_size<float>(w >> IVec(4)) * vstep).store(row + i + half);
        }
        for (; i < half; ++i) {
          row[i] = lo + static_cast<float>(c[i] & 15) * step;
          row[i + half] = lo + static_cast<float>(c[i] >> 4) * step;
        }
      }
    }
  }
}

// A quantized cache, dequantized block by block.
struct QuantBlocks {
  static constexpr bool kConverts = true;
  const uint8_t* cache;
  int64_t head_bytes, D;  // one head's cache
  QuantLayout layout;

  KVRows load(int64_t h, int64_t block, int64_t ja, int64_t jb, Workspace& w) const {
    const uint8_t* b = cache + h * head_bytes + block * layout.block_bytes;
    dequantize(layout.k, b, ja, jb, D, w.k.data());
    dequantize(layout.v, b, ja, jb, D, w.v.data());
    return {w.k.data(), w.v.data()};
  }

  Lines lines(int64_t h, int64_t block) const {
    Lines l;
    const char* b = reinterpret_cast<const char*>(cache + h * head_bytes + block * layout.block_bytes);
    const int64_t half = (layout.block_bytes / 2 + 63) / 64 * 64;  // one half while dots runs, one in weighted_sum
    l.at[0] = b; l.end[0] = b + std::min(half, layout.block_bytes);
    l.at[1] = l.end[0]; l.end[1] = b + layout.block_bytes;
    return l;
  }
};

template <int N>
inline void tile_step(Workspace& w, int64_t m0, const KVRows& kv, int64_t ja, int64_t jb, int64_t sink_hi,
                      const Problem& p, const int64_t* lo, const int64_t* hi, Lines& pf) {
  const int64_t D = p.head_dim, B = p.block_size;
  const float* q[N];
  float* s[N];
  float* acc[N];
  const float* probs[N];
  for (int t = 0; t < N; ++t) {
    q[t] = w.q.data() + (m0 + t) * D;
    s[t] = w.scores.data() + (m0 + t) * B;
    acc[t] = w.acc.data() + (m0 + t) * D;
    probs[t] = s[t];
  }
  dots<N>(q, kv.k, ja, jb, D, s, pf);
  float alpha[N];
  for (int t = 0; t < N; ++t)
    alpha[t] = softmax_step(s[t], ja, jb, sink_hi, lo[t], hi[t], w.mx[m0 + t], w.sum[m0 + t]);
  weighted_sum<N>(acc, alpha, probs, kv.v, ja, jb, D, pf);
}

// Attends row r, KV head h over the row's visited blocks [v0, v1) into the workspace's (acc, mx, sum);
// while it attends the last, it asks for KV head then_h's block then_block (the thread's next item's
// first; -1 for none).
template <typename scalar_t, typename Source>
void attend_partition(const Problem& p, const scalar_t* query, const Source& src, const RowSpan& row,
                      int64_t h, int64_t v0, int64_t v1, Workspace& w, int64_t then_h, int64_t then_block) {
  const int64_t D = p.head_dim, B = p.block_size, G = p.group;
  const int64_t M = row.q_len * G;
  // Query m = t * G + g is token t, head h * G + g; scaled once here.
  for (int64_t t = 0; t < row.q_len; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      float* dst = w.q.data() + (t * G + g) * D;
      to_float(query + (row.q_start + t) * p.q_stride_t + (h * G + g) * p.q_stride_h, dst, D);
      for (int64_t d = 0; d < D; ++d) dst[d] *= p.scale;
    }
  }
  std::fill(w.acc.begin(), w.acc.begin() + M * D, 0.f);
  std::fill(w.mx.begin(), w.mx.begin() + M, kNegInf);
  std::fill(w.sum.begin(), w.sum.begin() + M, 0.f);
  const int64_t first_pos = row.seq_len - row.q_len;
  int64_t lo[kTile], hi[kTile];
  for (int64_t i = v0; i < v1; ++i) {
    Lines pf;
    if (i + 1 < v1) {
      pf = src.lines(h, p.block_tables[row.block(i + 1)]);
    } else if (then_block >= 0) {
      pf = src.lines(then_h, then_block);
    }
    const int64_t b = row.block(i), j0 = b * B;
    // Keys [0, sink_hi) of this block are sinks. The keys some query of the row sees are [ja, jb),
    // and tokens [t_first, t_last] see any: token t sees [pos - window + 1, pos] and the sinks up to
    // pos, with pos = first_pos + t. A block before the window holds only sinks worth reading.
    const int64_t sink_hi = std::clamp<int64_t>(p.sink_tokens - j0, 0, B);
    const int64_t ja = sink_hi > 0 ? 0 : std::max<int64_t>(row.key_lo - j0, 0);
    int64_t jb = std::min<int64_t>(row.seq_len - j0, B);
    if (b < row.first_block) jb = std::min(jb, sink_hi);
    const int64_t t_first = std::max<int64_t>(0, j0 + ja - first_pos);
    int64_t t_last = row.q_len - 1;
    if (p.window > 0 && sink_hi == 0)
      t_last = std::min<int64_t>(t_last, j0 + jb - 1 + p.window - 1 - first_pos);
    if (ja >= jb || t_first > t_last) {
      pf.finish();
      continue;
    }
    const KVRows kv = src.load(h, p.block_tables[b], ja, jb, w);
    // over the first tile; later tiles ask for the block's last line again
    pf.spread(key_steps(std::min<int64_t>(kTile, (t_last + 1 - t_first) * G), jb - ja), value_steps(jb - ja, D));
    const int64_t m_end = (t_last + 1) * G;
    for (int64_t m0 = t_first * G; m0 < m_end; m0 += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, m_end - m0));
      for (int t = 0; t < n; ++t) {
        const int64_t pos = first_pos + (m0 + t) / G;
        lo[t] = (p.window > 0 ? pos - p.window + 1 : 0) - j0;
        hi[t] = pos + 1 - j0;
      }
      switch (n) {
        case 4: tile_step<4>(w, m0, kv, ja, jb, sink_hi, p, lo, hi, pf); break;
        case 3: tile_step<3>(w, m0, kv, ja, jb, sink_hi, p, lo, hi, pf); break;
        case 2: tile_step<2>(w, m0, kv, ja, jb, sink_hi, p, lo, hi, pf); break;
        default: tile_step<1>(w, m0, kv, ja, jb, sink_hi, p, lo, hi, pf); break;
      }
    }
    pf.finish();
  }
}

template <typename scalar_t>
void write_out(const Problem& p, scalar_t* out, const RowSpan& row, int64_t h, const float* acc,
               const float* sum, float* tmp) {
  const int64_t D = p.head_dim, G = p.group;
  for (int64_t m = 0; m < row.q_len * G; ++m) {
    const float inv = 1.f / sum[m];
    for (int64_t d = 0; d < D; ++d) tmp[d] = acc[m * D + d] * inv;
    from_float(tmp, out + (row.q_start + m / G) * p.o_stride_t + (h * G + m % G) * p.o_stride_h, D);
  }
}

// Runs fn(i, then) for i in [0, n) on the intra-op threads, each taking the next item when it is free
// (items differ in cost: context lengths vary). A thread claims its next item before running the
// current one, and fn learns it as `then` (-1 for none), so the current item can bring the next
// one's first data in.
template <typename F>
void parallel_items(int64_t n, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n;) {
      const int64_t then = next++;
      fn(i, then < n ? then : -1);
      i = then;
    }
  });
}

template <typename scalar_t, typename Source>
void run(const Problem& p, const scalar_t* query, const Source& src, scalar_t* out, int64_t num_rows,
         int64_t partition_tokens) {
  std::vector<RowSpan> rows(num_rows);
  int64_t max_q_len = 1, max_blocks = 1;
  for (int64_t r = 0; r < num_rows; ++r) {
    rows[r] = row_span(p, r);
    max_q_len = std::max(max_q_len, rows[r].q_len);
    max_blocks = std::max(max_blocks, rows[r].visits());
  }
  int64_t part_blocks = max_blocks;
  if (partition_tokens > 0) {
    part_blocks = (partition_tokens + p.block_size - 1) / p.block_size;
  } else {
    const int64_t target = kItemsPerThread * at::get_num_threads();
    if (num_rows * p.num_kv_heads < target) {
      const int64_t parts = (target + num_rows * p.num_kv_heads - 1) / (num_rows * p.num_kv_heads);
      const int64_t min_blocks = (kMinPartitionTokens + p.block_size - 1) / p.block_size;
      part_blocks = std::max(min_blocks, (max_blocks + parts - 1) / parts);
    }
  }
  // (row, first visit) of every partition; rows with several keep their partial results.
  std::vector<int64_t> part_row, part_first, first_part(num_rows + 1, 0);
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t v = 0; v < rows[r].visits(); v += part_blocks) {
      part_row.push_back(r);
      part_first.push_back(v);
    }
    first_part[r + 1] = static_cast<int64_t>(part_row.size());
  }
  const int64_t num_parts = static_cast<int64_t>(part_row.size());
  const int64_t H_kv = p.num_kv_heads, D = p.head_dim, max_m = max_q_len * p.group;
  const bool split = num_parts > num_rows;
  // Per (partition, KV head): acc (max_m, D), then mx (max_m), then sum (max_m).
  const int64_t part_floats = max_m * (D + 2);
  std::vector<float> partial(split ? num_parts * H_kv * part_floats : 0);

  parallel_items(num_parts * H_kv, [&](int64_t item, int64_t then) {
    thread_local Workspace w;
    const int64_t part = item / H_kv, h = item % H_kv, r = part_row[part];
    int64_t then_h = -1, then_block = -1;  // every partition visits at least its first block
    if (then >= 0) {
      const int64_t tp = then / H_kv, tr = part_row[tp];
      then_h = then % H_kv;
      then_block = p.block_tables[tr * p.table_stride + rows[tr].block(part_first[tp])];
    }
    const RowSpan& row = rows[r];
    w.reserve(row.q_len * p.group, p, Source::kConverts);
    Problem rp = p;
    rp.block_tables = p.block_tables + r * p.table_stride;
    const int64_t v0 = part_first[part], v1 = std::min(v0 + part_blocks, row.visits());
    attend_partition(rp, query, src, row, h, v0, v1, w, then_h, then_block);
    const int64_t M = row.q_len * p.group;
    if (first_part[r + 1] - first_part[r] == 1) {
      write_out(p, out, row, h, w.acc.data(), w.sum.data(), w.out.data());
    } else {
      float* dst = partial.data() + item * part_floats;
      std::copy(w.acc.begin(), w.acc.begin() + M * D, dst);
      std::copy(w.mx.begin(), w.mx.begin() + M, dst + max_m * D);
      std::copy(w.sum.begin(), w.sum.begin() + M, dst + max_m * (D + 1));
    }
  });
  if (!split) return;
  // Merge each split row's partitions: weights rescaled to the largest max (log-sum-exp).
  parallel_items(num_rows * H_kv, [&](int64_t item, int64_t) {
    const int64_t r = item / H_kv, h = item % H_kv;
    const int64_t first = first_part[r], count = first_part[r + 1] - first;
    if (count == 1) return;
    const RowSpan& row = rows[r];
    const int64_t M = row.q_len * p.group;
    std::vector<float> acc(M * D, 0.f), sum(M, 0.f), tmp(D);
    for (int64_t m = 0; m < M; ++m) {
      float mx = kNegInf;
      for (int64_t i = 0; i < count; ++i)
        mx = std::max(mx, partial[((first + i) * H_kv + h) * part_floats + max_m * D + m]);
      for (int64_t i = 0; i < count; ++i) {
        const float* src = partial.data() + ((first + i) * H_kv + h) * part_floats;
        const float shift = src[max_m * D + m] - mx;  // -inf for a partition that saw no key
        if (!(shift >= -kCutoff)) continue;
        const float f = std::exp(shift);
        sum[m] += src[max_m * (D + 1) + m] * f;
        for (int64_t d = 0; d < D; ++d) acc[m * D + d] += src[m * D + d] * f;
      }
    }
    write_out(p, out, row, h, acc.data(), sum.data(), tmp.data());
  });
}

// The checks both attention ops share, and their Problem. Every index the kernel will follow is
// checked here rather than trusted.
Problem make_problem(const char* op, const at::Tensor& out, const at::Tensor& query,
                     const at::Tensor& kv_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, int64_t num_rows, double scale, int64_t window,
                     int64_t sink_tokens, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() && out.device().is_cpu(), op,
              ": tensors must be on the CPU");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, op,
              ": query must be (T, H, D) with unit stride in D, got ", query.sizes());
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1, op,
              ": out must have query's shape with unit stride in D");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": query must be float32 or bfloat16, got ",
              dtype);
  TORCH_CHECK(out.scalar_type() == dtype, op, ": out must have query's dtype");
  const int64_t num_heads = query.size(1);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, op,
              ": num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_size > 0, op, ": block_size must be positive");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->device().is_cpu(), op,
                ": block_tables, seq_lens and query_start_loc must be int32 CPU tensors");
  }
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && block_tables.size(0) >= num_rows, op,
              ": block_tables must be (>= num_rows, max_blocks) with unit stride in dim 1");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous() && seq_lens.size(0) >= num_rows, op,
              ": seq_lens must be contiguous (>= num_rows,)");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.is_contiguous() &&
                  query_start_loc.size(0) >= num_rows + 1,
              op, ": query_start_loc must be contiguous (>= num_rows + 1,)");
  TORCH_CHECK(num_rows >= 0, op, ": num_rows must be >= 0");
  TORCH_CHECK(sink_tokens >= 0, op, ": sink_tokens must be >= 0");

  Problem p;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.group = num_heads / num_kv_heads;
  p.head_dim = query.size(2);
  p.num_blocks = num_blocks;
  p.block_size = block_size;
  p.q_stride_t = query.stride(0);
  p.q_stride_h = query.stride(1);
  p.o_stride_t = out.stride(0);
  p.o_stride_h = out.stride(1);
  p.table_stride = block_tables.stride(0);
  p.window = window;
  p.sink_tokens = window > 0 ? sink_tokens : 0;
  p.scale = static_cast<float>(scale);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t max_table = block_tables.size(1);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t q_start = p.qsl[r], q_len = p.qsl[r + 1] - p.qsl[r], seq_len = p.seq_lens[r];
    TORCH_CHECK(q_start >= 0 && q_len >= 1 && q_start + q_len <= query.size(0), op, ": row ", r,
                " has query tokens [", q_start, ", ", q_start + q_len, ") outside the ", query.size(0),
                " given");
    TORCH_CHECK(seq_len >= q_len && seq_len <= max_table * block_size, op, ": row ", r, " has seq_len ",
                seq_len, " for ", q_len, " queries and ", max_table, " table entries");
    const RowSpan row = row_span(p, r);
    const int32_t* table = p.block_tables + r * p.table_stride;
    for (int64_t i = 0; i < row.visits(); ++i) {
      const int64_t b = row.block(i);
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, op, ": row ", r, " block ", b, " is ", table[b],
                  ", outside the cache's ", num_blocks, " blocks");
    }
  }
  return p;
}

template <typename Source>
void run_any_query(const Problem& p, const at::Tensor& query, at::Tensor& out, const Source& src,
                   int64_t num_rows, int64_t partition_tokens) {
  if (query.scalar_type() == at::kFloat) {
    run<float>(p, query.data_ptr<float>(), src, out.data_ptr<float>(), num_rows, partition_tokens);
  } else {
    run<c10::BFloat16>(p, query.data_ptr<c10::BFloat16>(), src, out.data_ptr<c10::BFloat16>(), num_rows,
                       partition_tokens);
  }
}

template <typename cache_t>
void run_float_cache(const Problem& p, const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
                     int64_t num_rows, int64_t partition_tokens) {
  const int64_t block_elems = p.block_size * p.head_dim;
  const FloatBlocks<cache_t> src{kv_cache.data_ptr<cache_t>(), p.num_kv_heads, p.num_blocks * block_elems,
                                 block_elems, p.head_dim};
  run_any_query(p, query, out, src, num_rows, partition_tokens);
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, int64_t num_rows, double scale, int64_t window,
                     int64_t partition_tokens, int64_t sink_tokens) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_attention: kv_cache must be contiguous (2, H_kv, num_blocks, block_size, D), got ",
              kv_cache.sizes());
  const auto cache_dtype = kv_cache.scalar_type();
  TORCH_CHECK(cache_dtype == at::kFloat || cache_dtype == at::kBFloat16 || cache_dtype == at::kHalf,
              "paged_attention: kv_cache must be float32, bfloat16 or float16, got ", cache_dtype);
  TORCH_CHECK(query.dim() == 3 && kv_cache.size(4) == query.size(2),
              "paged_attention: head_dim differs between query and kv_cache");
  const Problem p = make_problem("paged_attention", out, query, kv_cache, block_tables, seq_lens,
                                 query_start_loc, num_rows, scale, window, sink_tokens, kv_cache.size(1),
                                 kv_cache.size(2), kv_cache.size(3));
  if (num_rows == 0) return;
  if (cache_dtype == at::kFloat) {
    run_float_cache<float>(p, query, kv_cache, out, num_rows, partition_tokens);
  } else if (cache_dtype == at::kBFloat16) {
    run_float_cache<c10::BFloat16>(p, query, kv_cache, out, num_rows, partition_tokens);
  } else {
    run_float_cache<c10::Half>(p, query, kv_cache, out, num_rows, partition_tokens);
  }
}

// The layer's fp8 scales (kv_scale[0] for K, [1] for V); 1.0 without a tensor.
std::pair<float, float> tensor_scales(const char* op, const std::optional<at::Tensor>& kv_scale) {
  if (!kv_scale.has_value() || !kv_scale->defined()) return {1.f, 1.f};
  TORCH_CHECK(kv_scale->device().is_cpu() && kv_scale->scalar_type() == at::kFloat && kv_scale->numel() == 2,
              op, ": kv_scale must be a (2,) float32 CPU tensor");
  const at::Tensor s = kv_scale->contiguous();
  return {s.data_ptr<float>()[0], s.data_ptr<float>()[1]};
}

QuantLayout checked_layout(const char* op, const at::Tensor& kv_cache, int64_t k_kind, int64_t v_kind,
                           int64_t head_dim, int64_t block_size, const std::optional<at::Tensor>& kv_scale) {
  TORCH_CHECK(k_kind >= kFp8E4m3 && k_kind <= kInt4 && v_kind >= kFp8E4m3 && v_kind <= kInt4, op,
              ": k_kind and v_kind must be code kinds 0-3, got ", k_kind, " and ", v_kind);
  TORCH_CHECK(head_dim > 0 && block_size > 0, op, ": head_dim and block_size must be positive");
  TORCH_CHECK(head_dim % 2 == 0 || (k_kind != kInt4 && v_kind != kInt4), op,
              ": int4 codes need an even head_dim");
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.scalar_type() == at::kByte && kv_cache.dim() == 3 &&
                  kv_cache.is_contiguous(),
              op, ": kv_cache must be a contiguous (H_kv, num_blocks, block_bytes) uint8 CPU tensor, got ",
              kv_cache.scalar_type(), " ", kv_cache.sizes());
  const auto [k_scale, v_scale] = tensor_scales(op, kv_scale);
  const QuantLayout layout(k_kind, v_kind, block_size, head_dim, k_scale, v_scale);
  TORCH_CHECK(kv_cache.size(2) == layout.block_bytes, op, ": kv_cache blocks have ", kv_cache.size(2),
              " bytes; these kinds take ", layout.block_bytes, " for ", block_size, " tokens of head_dim ",
              head_dim);
  return layout;
}

void paged_attention_quant(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, int64_t num_rows, double scale, int64_t window,
                           int64_t sink_tokens, int64_t k_kind, int64_t v_kind,
                           const std::optional<at::Tensor>& kv_scale, int64_t head_dim, int64_t block_size,
                           int64_t partition_tokens) {
  const char* op = "paged_attention_quant";
  const QuantLayout layout = checked_layout(op, kv_cache, k_kind, v_kind, head_dim, block_size, kv_scale);
  TORCH_CHECK(query.dim() == 3 && query.size(2) == head_dim, op, ": query's head_dim is not ", head_dim);
  const Problem p = make_problem(op, out, query, kv_cache, block_tables, seq_lens, query_start_loc, num_rows,
                                 scale, window, sink_tokens, kv_cache.size(0), kv_cache.size(1), block_size);
  if (num_rows == 0) return;
  const QuantBlocks src{kv_cache.data_ptr<uint8_t>(), kv_cache.size(1) * layout.block_bytes, head_dim,
                        layout};
  run_any_query(p, query, out, src, num_rows, partition_tokens);
}

// ---- quantized K/V write -------------------------------------------------------------------------

// One token's row x (D floats) -> its codes and params, as formats.quantize computes them: the same
// float32 operations in the same order, float16 params rounded to nearest even (c10::Half) before
// the codes use them, codes rounded half to even (nearbyint, as torch.round), fp8 by c10's RNE.
void quantize_row(const float* x, int64_t D, const Section& s, uint8_t* codes, uint8_t* params) {
  switch (s.kind) {
    case kFp8E4m3:
    case kFp8E5m2: {
      const float limit = s.kind == kFp8E4m3 ? 448.f : 57344.f;
      for (int64_t d = 0; d < D; ++d) {
        const float y = std::min(std::max(x[d] / s.scale, -limit), limit);
        codes[d] = s.kind == kFp8E4m3 ? c10::Float8_e4m3fn(y).x : c10::Float8_e5m2(y).x;
      }
      break;
    }
    case kInt8: {
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::abs(x[d]));
      c10::Half scale(amax / 127.f);
      if (!(static_cast<float>(scale) > 0.f)) scale = c10::Half(1.f);
      const float sf = scale;
      for (int64_t d = 0; d < D; ++d) {
        const float q = std::min(std::max(std::nearbyint(x[d] / sf), -127.f), 127.f);
        codes[d] = static_cast<uint8_t>(static_cast<int8_t>(q));
      }
      std::memcpy(params, &scale.x, 2);
      break;
    }
    default: {  // int4: (scale, min) per token; byte i holds dims i (low nibble) and i + D/2
      float mn = x[0], mx = x[0];
      for (int64_t d = 1; d < D; ++d) {
        mn = std::min(mn, x[d]);
        mx = std::max(mx, x[d]);
      }
      const c10::Half lo(mn);
      const float lof = lo;
      c10::Half step((mx - lof) / 15.f);
      if (!(static_cast<float>(step) > 0.f)) step = c10::Half(1.f);
      const float stepf = step;
      auto code = [&](float v) {
        return static_cast<uint8_t>(std::min(std::max(std::nearbyint((v - lof) / stepf), 0.f), 15.f));
      };
      const int64_t half = D / 2;
      for (int64_t i = 0; i < half; ++i) codes[i] = code(x[i]) | static_cast<uint8_t>(code(x[i + half]) << 4);
      std::memcpy(params, &step.x, 2);
      std::memcpy(params + 2, &lo.x, 2);
    }
  }
}

template <typename in_t>
void write_rows(const at::Tensor& key, const at::Tensor& value, uint8_t* cache, const int64_t* slots,
                int64_t num_blocks, int64_t block_size, const QuantLayout& layout) {
  const int64_t T = key.size(0), H_kv = key.size(1), D = key.size(2);
  const int64_t head_bytes = num_blocks * layout.block_bytes;
  const in_t* k = key.data_ptr<in_t>();
  const in_t* v = value.data_ptr<in_t>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> row(D);
    for (int64_t t = t0; t < t1; ++t) {
      if (slots[t] < 0) continue;  // padding
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t h = 0; h < H_kv; ++h) {
        uint8_t* b = cache + h * head_bytes + block * layout.block_bytes;
        auto put = [&](const in_t* x, const at::Tensor& src, const Section& s) {
          to_float(x + t * src.stride(0) + h * src.stride(1), row.data(), D);
          quantize_row(row.data(), D, s, b + s.codes + offset * s.code_bytes,
                       b + s.params + offset * s.param_bytes);
        };
        put(k, key, layout.k);
        put(v, value, layout.v);
      }
    }
  });
}

void write_kv_quant(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping, int64_t k_kind, int64_t v_kind,
                    const std::optional<at::Tensor>& kv_scale, int64_t block_size) {
  const char* op = "write_kv_quant";
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && slot_mapping.device().is_cpu(), op,
              ": tensors must be on the CPU");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              op, ": key and value must be (T, H_kv, D) with unit stride in D, got ", key.sizes(), " and ",
              value.sizes());
  const auto dtype = key.scalar_type();
  TORCH_CHECK(value.scalar_type() == dtype &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              op, ": key and value must share a dtype: float32, bfloat16 or float16");
  const QuantLayout layout = checked_layout(op, kv_cache, k_kind, v_kind, key.size(2), block_size, kv_scale);
  TORCH_CHECK(kv_cache.size(0) == key.size(1), op, ": kv_cache has ", kv_cache.size(0), " KV heads, key ",
              key.size(1));
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous() && slot_mapping.size(0) == key.size(0),
              op, ": slot_mapping must be a contiguous (T,) int64 tensor");
  const int64_t num_blocks = kv_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t) {
    TORCH_CHECK(slots[t] < num_blocks * block_size, op, ": slot ", slots[t], " of token ", t,
                " is outside the cache's ", num_blocks * block_size, " slots");
  }
  uint8_t* cache = kv_cache.data_ptr<uint8_t>();
  if (dtype == at::kFloat) {
    write_rows<float>(key, value, cache, slots, num_blocks, block_size, layout);
  } else if (dtype == at::kBFloat16) {
    write_rows<c10::BFloat16>(key, value, cache, slots, num_blocks, block_size, layout);
  } else {
    write_rows<c10::Half>(key, value, cache, slots, num_blocks, block_size, layout);
  }
}

// This step's K/V into a float cache (2, H_kv, num_blocks, block_size, D) of the key's dtype: one
// call for both halves instead of two index_copy_ calls and their views; negative slots are skipped.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  const char* op = "write_kv";
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu() &&
                  slot_mapping.device().is_cpu(),
              op, ": tensors must be on the CPU");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              op, ": key and value must be (T, H_kv, D) with unit stride in D, got ", key.sizes(), " and ",
              value.sizes());
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && kv_cache.scalar_type() == key.scalar_type(), op,
              ": key, value and kv_cache must share a dtype");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(1) == key.size(1) &&
                  kv_cache.size(4) == key.size(2) && kv_cache.is_contiguous(),
              op, ": kv_cache must be contiguous (2, ", key.size(1), ", num_blocks, block_size, ", key.size(2),
              "), got ", kv_cache.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              op, ": slot_mapping must be a contiguous (T,) int64 tensor");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t slots_per_head = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] < slots_per_head, op, ": slot ", slots[t], " of token ", t, " is outside the cache's ",
                slots_per_head, " slots");
  }
  const int64_t bytes = dim * static_cast<int64_t>(key.element_size());
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  for (int half = 0; half < 2; ++half) {
    const at::Tensor& src = half == 0 ? key : value;
    const char* base = static_cast<const char*>(src.data_ptr());
    const int64_t st = src.stride(0) * src.element_size(), sh = src.stride(1) * src.element_size();
    for (int64_t h = 0; h < heads; ++h) {
      char* dst = cache + ((half * heads + h) * slots_per_head) * bytes;
      for (int64_t t = 0; t < tokens; ++t) {
        if (slots[t] >= 0) std::memcpy(dst + slots[t] * bytes, base + t * st + h * sh, bytes);
      }
    }
  }
}

}  // namespace
}  // namespace KVTIDE_OPS_NS

KVTIDE_LIBRARY(KVTIDE_OPS_NS, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int num_rows, float scale, int window, "
        "int partition_tokens=0, int sink_tokens=0) -> ()",
        &KVTIDE_OPS_NS::paged_attention);
  m.def("paged_attention_quant(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int num_rows, float scale, int window, int sink_tokens, "
        "int k_kind, int v_kind, Tensor? kv_scale, int head_dim, int block_size, "
        "int partition_tokens=0) -> ()",
        &KVTIDE_OPS_NS::paged_attention_quant);
  m.def("write_kv_quant(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, int k_kind, "
        "int v_kind, Tensor? kv_scale, int block_size) -> ()",
        &KVTIDE_OPS_NS::write_kv_quant);
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()", &KVTIDE_OPS_NS::write_kv);
}
