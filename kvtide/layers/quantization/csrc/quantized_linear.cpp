// Weight-only quantized linears on CPU: y = x @ dequantize(w).T with float32 activations, reading
// the weight in its quantized bytes (1 byte per weight for int8/fp8, half a byte for int4) so a
// decode step, which is bound by the bytes it reads, moves 4-8x less than with float32 weights.
//
//   codes: int8 (N, K) | int4: uint8 (N, K/2), 32-blocks of nibbles | fp8: uint8 e4m3 bits (N, K)
//          | iq4: int4's nibbles, each an index into kIq4Levels (GGUF's IQ4_NL/IQ4_XS grid)
//   scales, mins: float32 (N, K / group); w[n, k] = scales[n, g] * code[n, k] + mins[n, g]
//   (the layout of layers/quantization/qweight.py). Nibble groups are multiples of 32 or exactly
//   16 (GGUF's Q2_K/Q3_K sub-blocks: a 32-block's low nibbles are one group, its high nibbles the
//   next).
//
// quantized_linear: each weight vector is dequantized in registers (one FMA) and multiplied into up
// to kRows activation rows at once, so a weight row is read once per kRows rows; work is split
// over output rows. dequantize_rows writes float32 rows, for prefill batches that go through a GEMM.
//
// int4 with int8 activations (kind 3, the int4 codes' layout): each activation row is quantized per
// 32-block (d = max|x| / 127, a = round(x * 127 / max|x|)), and a block's products are summed in
// integers, 64 an instruction (maddubs: unsigned nibble times signed byte), as llama.cpp's Q4_0 does:
//   y[n] = sum_b s[n, g(b)] d_b sum_{k in b} q[n, k] a[k]  +  sum_g m[n, g] sum_{k in g} x[k]
// The codes per weight byte cost two and-masks and a shift instead of a conversion and an FMA each,
// so a decode step is bound by the bytes it reads again, not by its arithmetic.
//
// fp8 e4m3 -> float (NaN codes are refused at load: a checkpoint never stores them): its bits moved into a float16's (sign to bit 15, exponent and mantissa shifted
// up by 7) are the same number times 2^-8 for normals and subnormals alike (float16 has 8 more
// exponent bias), so a float16 conversion and a 2^8 factor folded into the scale decode it exactly.
//
// iq4 codes are decoded by a byte shuffle: the 16 levels fit one 128-bit register, and pshufb with
// the nibbles as indices yields the levels as int8, converted as int8 codes are.
//
// Compiled once per ISA (attention/cpu_extension.py): CPU_CAPABILITY_AVX512 / _AVX2 pick the
// intrinsics, and a portable loop serves the rest.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#ifndef KVTIDE_OPS_NS
#define KVTIDE_OPS_NS kvtide_quant_default
#endif
#define KVTIDE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace KVTIDE_OPS_NS {
namespace {

constexpr int64_t kInt8 = 0, kInt4 = 1, kFp8 = 2, kInt4A8 = 3, kIq4 = 4;
// The non-uniform 4-bit grid of GGUF's IQ4_NL and IQ4_XS (qweight.IQ4_LEVELS).
alignas(16) constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};
constexpr int64_t kActBlock = 32;  // activations quantized per 32-block (a block of int4 codes)
constexpr int64_t kRows = 4;  // activation rows sharing one pass over a weight row
constexpr float kFp8Factor = 256.0f;

inline float fp8_to_float(uint8_t b) {
  uint16_t bits = static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
  c10::Half h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h) * kFp8Factor;
}

#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kLanes = 16;
using VecF = __m512;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vset1(float v) { return _mm512_set1_ps(v); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(VecF v) { return _mm512_reduce_add_ps(v); }
// 16 codes starting at p (int8 / fp8), as floats (fp8: times 2^-8, see above).
inline VecF load_int8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline VecF load_fp8(const uint8_t* p) {
  __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i bits = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                 _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_cvtph_ps(bits);
}
// The int8-activation path works on chunks of kChunkBytes weight bytes (kChunkBytes / 16 blocks of
// 32 codes); a chunk's dot products land in int32 lanes, four lanes a block.
using VecI = __m512i;
constexpr int64_t kChunkBytes = 64;
inline VecI load_bytes(const uint8_t* p, int64_t n) {  // n: 16, 32, 48 or 64 (zeros past n)
  return n == 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((__mmask64)((1ULL << n) - 1), p);
}
inline VecI low_nibbles(VecI w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
inline VecI high_nibbles(VecI w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F)); }
// Per int32 lane: the sum of 4 low-nibble x activation products plus 4 high-nibble ones (exact:
// each int16 pair sum is at most 2 * 15 * 127 and two of them fit too).
inline VecI dot_nibbles(VecI lo, VecI a_lo, VecI hi, VecI a_hi) {
  VecI pairs = _mm512_add_epi16(_mm512_maddubs_epi16(lo, a_lo), _mm512_maddubs_epi16(hi, a_hi));
  return _mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
}
inline VecF to_float(VecI v) { return _mm512_cvtepi32_ps(v); }
// The weight scale of each lane's group: `count` scales from s, spread over the lanes by idx.
inline VecF lane_scales(const float* s, int64_t count, const int32_t* idx) {
  return _mm512_permutexvar_ps(_mm512_loadu_si512(idx), _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), s));
}
// Scales s[0..3], one per block of a whole chunk, each over its block's four lanes.
inline VecF block_scales(const float* s) {
  return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                               _mm512_castps128_ps512(_mm_loadu_ps(s)));
}
// One 32-block of int4 codes (16 bytes): codes k0..k0+15 (low nibbles) and k0+16..k0+31 (high).
inline void load_int4_block(const uint8_t* p, VecF out[2]) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i mask = _mm_set1_epi8(0x0F);
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
  out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
}
// One 32-block of iq4 codes: the levels of its nibbles, in load_int4_block's order.
inline void load_iq4_block(const uint8_t* p, VecF out[2]) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i mask = _mm_set1_epi8(0x0F);
  __m128i levels = _mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Levels));
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(levels, _mm_and_si128(b, mask))));
  out[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(levels, _mm_and_si128(_mm_srli_epi16(b, 4), mask))));
}
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kLanes = 8;
using VecF = __m256;
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vset1(float v) { return _mm256_set1_ps(v); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(VecF v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline VecF load_int8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline VecF load_fp8(const uint8_t* p) {
  __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i bits = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                              _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return _mm256_cvtph_ps(bits);
}
using VecI = __m256i;
constexpr int64_t kChunkBytes = 32;
inline VecI load_bytes(const uint8_t* p, int64_t n) {  // n: 16 or 32
  return n == 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                 : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline VecI low_nibbles(VecI w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
inline VecI high_nibbles(VecI w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F)); }
inline VecI dot_nibbles(VecI lo, VecI a_lo, VecI hi, VecI a_hi) {
  VecI pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, a_lo), _mm256_maddubs_epi16(hi, a_hi));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
inline VecF to_float(VecI v) { return _mm256_cvtepi32_ps(v); }
inline VecF lane_scales(const float* s, int64_t count, const int32_t* idx) {
  VecI mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_permutevar8x32_ps(_mm256_maskload_ps(s, mask), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx)));
}
inline VecF block_scales(const float* s) {
  return _mm256_setr_m128(_mm_set1_ps(s[0]), _mm_set1_ps(s[1]));
}
inline void load_int4_block(const uint8_t* p, VecF out[4]) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i mask = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(b, mask);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
inline void load_iq4_block(const uint8_t* p, VecF out[4]) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i mask = _mm_set1_epi8(0x0F);
  __m128i levels = _mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Levels));
  __m128i lo = _mm_shuffle_epi8(levels, _mm_and_si128(b, mask));
  __m128i hi = _mm_shuffle_epi8(levels, _mm_and_si128(_mm_srli_epi16(b, 4), mask));
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}
#else
constexpr int64_t kChunkBytes = 16;
#endif
constexpr int64_t kChunkLanes = kChunkBytes / 4;        // int32 lanes of a chunk's dot products
constexpr int64_t kChunkBlocks = kChunkBytes / 16;      // 32-code blocks in a chunk

struct Weight {
  const uint8_t* codes;  // row n starts at codes + n * row_bytes
  int64_t row_bytes;
  const float* scales;
  const float* mins;  // nullptr: no offsets
  int64_t groups, group, kind;
};

// Scalar dequantization of one row: the portable path and the reference for odd tails.
void dequant_row_scalar(const Weight& w, int64_t n, int64_t k, float* out) {
  const uint8_t* row = w.codes + n * w.row_bytes;
  for (int64_t g = 0; g < w.groups; ++g) {
    float s = w.scales[n * w.groups + g];
    float m = w.mins ? w.mins[n * w.groups + g] : 0.0f;
    for (int64_t j = g * w.group; j < (g + 1) * w.group && j < k; ++j) {
      float q;
      if (w.kind == kInt8) {
        q = static_cast<float>(reinterpret_cast<const int8_t*>(row)[j]);
      } else if (w.kind == kFp8) {
        q = fp8_to_float(row[j]);
      } else {
        int64_t k0 = j / 32 * 32, r = j - k0;
        uint8_t byte = row[k0 / 2 + (r & 15)];
        const int nibble = r < 16 ? (byte & 0x0F) : (byte >> 4);
        q = static_cast<float>(w.kind == kIq4 ? kIq4Levels[nibble] : nibble);
      }
      out[j] = s * q + m;
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
using Slot0 = std::integral_constant<int, 0>;
using Slot1 = std::integral_constant<int, 1>;

// Calls f(slot, k, weight vector) for every kLanes-wide vector of row n, dequantized. Consecutive
// vectors alternate between slot 0 and 1 (compile-time constants), so a caller can keep two
// independent accumulators and two FMA chains in flight instead of waiting on one's latency.
template <typename F>
inline void for_each_weight_vector(const Weight& w, int64_t n, F&& f) {
  const uint8_t* row = w.codes + n * w.row_bytes;
  const float* srow = w.scales + n * w.groups;
  const float* mrow = w.mins ? w.mins + n * w.groups : nullptr;
  const float factor = w.kind == kFp8 ? kFp8Factor : 1.0f;
  const bool pairs = w.group % (2 * kLanes) == 0;
  if ((w.kind == kInt4 || w.kind == kIq4) && w.group == 16) {
    // Two groups a 32-block: vector i holds codes i * kLanes.., in the block's group i * kLanes / 16.
    for (int64_t g = 0; g < w.groups; g += 2) {
      const int64_t k0 = g * 16;
      VecF q[32 / kLanes];
      if (w.kind == kIq4) {
        load_iq4_block(row + k0 / 2, q);
      } else {
        load_int4_block(row + k0 / 2, q);
      }
      const VecF s[2] = {vset1(srow[g]), vset1(srow[g + 1])};
      const VecF m[2] = {mrow ? vset1(mrow[g]) : vzero(), mrow ? vset1(mrow[g + 1]) : vzero()};
      for (int64_t i = 0; i < 32 / kLanes; i += 2) {
        const int64_t h0 = i * kLanes / 16, h1 = (i + 1) * kLanes / 16;
        f(Slot0{}, k0 + i * kLanes, vfma(q[i], s[h0], m[h0]));
        f(Slot1{}, k0 + (i + 1) * kLanes, vfma(q[i + 1], s[h1], m[h1]));
      }
    }
    return;
  }
  for (int64_t g = 0; g < w.groups; ++g) {
    VecF s = vset1(srow[g] * factor);
    VecF m = mrow ? vset1(mrow[g]) : vzero();
    const int64_t k_begin = g * w.group, k_end = k_begin + w.group;
    if (w.kind == kInt4 || w.kind == kIq4) {
      for (int64_t k0 = k_begin; k0 < k_end; k0 += 32) {
        VecF q[32 / kLanes];
        if (w.kind == kIq4) {
          load_iq4_block(row + k0 / 2, q);
        } else {
          load_int4_block(row + k0 / 2, q);
        }
        for (int64_t i = 0; i < 32 / kLanes; i += 2) {
          f(Slot0{}, k0 + i * kLanes, vfma(q[i], s, m));
          f(Slot1{}, k0 + (i + 1) * kLanes, vfma(q[i + 1], s, m));
        }
      }
    } else if (w.kind == kInt8) {
      const int8_t* r = reinterpret_cast<const int8_t*>(row);
      if (pairs) {
        for (int64_t k = k_begin; k < k_end; k += 2 * kLanes) {
          f(Slot0{}, k, vfma(load_int8(r + k), s, m));
          f(Slot1{}, k + kLanes, vfma(load_int8(r + k + kLanes), s, m));
        }
      } else {
        for (int64_t k = k_begin; k < k_end; k += kLanes) f(Slot0{}, k, vfma(load_int8(r + k), s, m));
      }
    } else {
      if (pairs) {
        for (int64_t k = k_begin; k < k_end; k += 2 * kLanes) {
          f(Slot0{}, k, vfma(load_fp8(row + k), s, m));
          f(Slot1{}, k + kLanes, vfma(load_fp8(row + k + kLanes), s, m));
        }
      } else {
        for (int64_t k = k_begin; k < k_end; k += kLanes) f(Slot0{}, k, vfma(load_fp8(row + k), s, m));
      }
    }
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Symmetric int8 (no mins): each group's dot products sum the codes as they are, and the group's
// scale multiplies the sum once (sum_k x_k q_k s = s sum_k x_k q_k), one FMA per weight vector
// fewer than dequantizing every vector first.
template <int R>
void int8_rows(const Weight& w, const float* const* xr, int64_t n, float* out, int64_t n_total) {
  const int8_t* row = reinterpret_cast<const int8_t*>(w.codes + n * w.row_bytes);
  const float* srow = w.scales + n * w.groups;
  VecF total[R];
  for (int i = 0; i < R; ++i) total[i] = vzero();
  for (int64_t g = 0; g < w.groups; ++g) {
    VecF a0[R], a1[R];
    for (int i = 0; i < R; ++i) a0[i] = a1[i] = vzero();
    for (int64_t k = g * w.group, k_end = k + w.group; k < k_end; k += 2 * kLanes) {
      const VecF q0 = load_int8(row + k), q1 = load_int8(row + k + kLanes);
      for (int i = 0; i < R; ++i) {
        a0[i] = vfma(vload(xr[i] + k), q0, a0[i]);
        a1[i] = vfma(vload(xr[i] + k + kLanes), q1, a1[i]);
      }
    }
    const VecF s = vset1(srow[g]);
    for (int i = 0; i < R; ++i) total[i] = vfma(a0[i] + a1[i], s, total[i]);
  }
  for (int i = 0; i < R; ++i) out[i * n_total + n] = vsum(total[i]);
}
#endif

// ---- int4 weights x int8 activations ----------------------------------------------------------
// The activation rows of one call, quantized once and laid out chunk by chunk as the weight's bytes
// are: a chunk holds the low halves (codes k0..k0+15) of its blocks, then their high halves.
struct Int8Activations {
  int64_t chunks = 0, groups = 0, row_bytes = 0;
  std::vector<int8_t> codes;         // (M, chunks * 2 * kChunkBytes); zeros past K
  std::vector<float> lane_d;         // (M, chunks * kChunkLanes): each lane's block's d
  std::vector<float> group_sums;     // (M, groups): sum of x over each weight group (for the mins)
  std::vector<int64_t> first_group;  // (chunks): the first weight group a chunk touches
  std::vector<int64_t> group_count;  // (chunks): how many groups it touches
  std::vector<int32_t> lane_group;   // (chunks, kChunkLanes): a lane's group - first_group
};

// d and the codes of one 32-block: d = max|x| / 127, a = round(x * (127 / max|x|)) (0 for an all-zero
// block); the high half goes `hi_offset` bytes after the low half.
inline float quantize_block(const float* x, int8_t* lo, int64_t hi_offset) {
  float amax = 0.0f;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inv))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + hi_offset),
                   _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, inv))));
#else
  for (int64_t j = 0; j < kActBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t j = 0; j < kActBlock; ++j) {
    int8_t* dst = j < 16 ? lo + j : lo + hi_offset + (j - 16);
    *dst = static_cast<int8_t>(std::nearbyint(x[j] * inv));
  }
#endif
  return amax / 127.0f;
}

void quantize_activations(const float* x, int64_t m, int64_t k, int64_t group, Int8Activations& a) {
  const int64_t blocks = k / kActBlock;
  a.chunks = (blocks + kChunkBlocks - 1) / kChunkBlocks;
  a.groups = k / group;
  a.row_bytes = a.chunks * 2 * kChunkBytes;
  a.codes.assign(m * a.row_bytes, 0);
  a.lane_d.assign(m * a.chunks * kChunkLanes, 0.0f);
  a.group_sums.assign(m * a.groups, 0.0f);
  a.first_group.resize(a.chunks);
  a.group_count.resize(a.chunks);
  a.lane_group.assign(a.chunks * kChunkLanes, 0);
  for (int64_t c = 0; c < a.chunks; ++c) {
    const int64_t b0 = c * kChunkBlocks, b1 = std::min(blocks, b0 + kChunkBlocks);
    a.first_group[c] = b0 * kActBlock / group;
    a.group_count[c] = (b1 * kActBlock - 1) / group - a.first_group[c] + 1;
    for (int64_t lane = 0; lane < kChunkLanes; ++lane) {
      const int64_t b = std::min(b0 + lane / 4, b1 - 1);
      a.lane_group[c * kChunkLanes + lane] = static_cast<int32_t>(b * kActBlock / group - a.first_group[c]);
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c = b / kChunkBlocks, j = b % kChunkBlocks;
      int8_t* lo = a.codes.data() + r * a.row_bytes + c * 2 * kChunkBytes + j * 16;
      const float d = quantize_block(xr + b * kActBlock, lo, kChunkBytes);
      float* lane_d = a.lane_d.data() + (r * a.chunks + c) * kChunkLanes + j * 4;
      for (int i = 0; i < 4; ++i) lane_d[i] = d;
    }
    for (int64_t g = 0; g < a.groups; ++g) {
      float sum = 0.0f;
      for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) sum += xr[kk];
      a.group_sums[r * a.groups + g] = sum;
    }
  }
}

// sum_i a[i] b[i]: the mins' term, one product per group (a scalar chain of them would cost more
// than the integer dots at 32-wide groups).
inline float dot_floats(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  VecF acc = vzero();
  for (; i + kLanes <= n; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
  sum = vsum(acc);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// How a chunk finds its lanes' weight scales: kScalesGeneral through the chunk's lane->group table,
// kScalesPerBlock (32-wide groups) as the next kChunkBlocks scales in order, kScalesWide (a group
// spans whole chunks) as one scale for the chunk.
constexpr int kScalesGeneral = 0, kScalesPerBlock = 1, kScalesWide = 2;

int scale_mode(int64_t group) {
  if (group == kActBlock) return kScalesPerBlock;
  return group % (2 * kChunkBytes) == 0 ? kScalesWide : kScalesGeneral;
}

// out[m0 + i, n] for R activation rows m0.. and weight row n.
template <int R, int kMode>
void int4a8_rows(const Weight& w, const Int8Activations& a, int64_t m0, int64_t n, float* out, int64_t n_total) {
  const uint8_t* wrow = w.codes + n * w.row_bytes;
  const float* srow = w.scales + n * w.groups;
  const int8_t* arow[R];
  const float* drow[R];
  for (int i = 0; i < R; ++i) {
    arow[i] = a.codes.data() + (m0 + i) * a.row_bytes;
    drow[i] = a.lane_d.data() + (m0 + i) * a.chunks * kChunkLanes;
  }
  float result[R];
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  VecF acc[R];
  for (int i = 0; i < R; ++i) acc[i] = vzero();
  auto chunk = [&](int64_t c, VecI wv, VecF s) {
    const VecI lo = low_nibbles(wv), hi = high_nibbles(wv);
    for (int i = 0; i < R; ++i) {
      const uint8_t* ac = reinterpret_cast<const uint8_t*>(arow[i] + c * 2 * kChunkBytes);
      const VecI dot = dot_nibbles(lo, load_bytes(ac, kChunkBytes), hi, load_bytes(ac + kChunkBytes, kChunkBytes));
      acc[i] = vfma(to_float(dot), vload(drow[i] + c * kChunkLanes) * s, acc[i]);
    }
  };
  const int64_t full = w.row_bytes / kChunkBytes;  // chunks of kChunkBlocks whole blocks
  const int64_t chunks_per_group = w.group / (2 * kChunkBytes);
  int64_t g = 0, in_group = 0;
  for (int64_t c = 0; c < full; ++c) {
    VecF s;
    if constexpr (kMode == kScalesPerBlock) {
      s = block_scales(srow + c * kChunkBlocks);
    } else if constexpr (kMode == kScalesWide) {
      s = vset1(srow[g]);
      if (++in_group == chunks_per_group) in_group = 0, ++g;
    } else {
      s = lane_scales(srow + a.first_group[c], a.group_count[c], a.lane_group.data() + c * kChunkLanes);
    }
    chunk(c, load_bytes(wrow + c * kChunkBytes, kChunkBytes), s);
  }
  if (full < a.chunks) {  // the last blocks, fewer than a chunk
    chunk(full, load_bytes(wrow + full * kChunkBytes, w.row_bytes - full * kChunkBytes),
          lane_scales(srow + a.first_group[full], a.group_count[full], a.lane_group.data() + full * kChunkLanes));
  }
  for (int i = 0; i < R; ++i) result[i] = vsum(acc[i]);
#else
  for (int i = 0; i < R; ++i) {
    float acc = 0.0f;
    for (int64_t c = 0; c < a.chunks; ++c) {  // one block a chunk
      const uint8_t* wb = wrow + c * 16;
      const int8_t* ac = arow[i] + c * 2 * kChunkBytes;
      int32_t dot = 0;
      for (int j = 0; j < 16; ++j) dot += (wb[j] & 0x0F) * ac[j] + (wb[j] >> 4) * ac[kChunkBytes + j];
      acc += static_cast<float>(dot) * drow[i][c * kChunkLanes] * srow[c * kActBlock / w.group];
    }
    result[i] = acc;
  }
#endif
  if (w.mins != nullptr) {
    const float* mrow = w.mins + n * w.groups;
    for (int i = 0; i < R; ++i) result[i] += dot_floats(mrow, a.group_sums.data() + (m0 + i) * a.groups, w.groups);
  }
  for (int i = 0; i < R; ++i) out[(m0 + i) * n_total + n] = result[i];
}

template <int kMode>
void int4a8_tile(const Weight& w, const Int8Activations& a, int64_t m0, int64_t r, int64_t n0, int64_t n1,
                 float* out, int64_t n_total) {
  for (int64_t n = n0; n < n1; ++n) {
    switch (r) {
      case 1: int4a8_rows<1, kMode>(w, a, m0, n, out, n_total); break;
      case 2: int4a8_rows<2, kMode>(w, a, m0, n, out, n_total); break;
      case 3: int4a8_rows<3, kMode>(w, a, m0, n, out, n_total); break;
      default: int4a8_rows<4, kMode>(w, a, m0, n, out, n_total); break;
    }
  }
}

// out[m, n] for rows m0..m0+rows of x and output rows n0..n1.
void linear_tile(const Weight& w, const float* x, int64_t k, int64_t m0, int64_t rows, int64_t n0,
                 int64_t n1, float* out, int64_t n_total, float* scratch) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (w.kind == kInt8 && w.mins == nullptr && w.group % (2 * kLanes) == 0) {
    const float* xr[kRows];
    for (int64_t i = 0; i < rows; ++i) xr[i] = x + (m0 + i) * k;
    float* o = out + m0 * n_total;
    for (int64_t n = n0; n < n1; ++n) {
      switch (rows) {
        case 1: int8_rows<1>(w, xr, n, o, n_total); break;
        case 2: int8_rows<2>(w, xr, n, o, n_total); break;
        case 3: int8_rows<3>(w, xr, n, o, n_total); break;
        default: int8_rows<4>(w, xr, n, o, n_total); break;
      }
    }
    return;
  }
  if (w.group % kLanes == 0) {
    const float* xr[kRows];
    for (int64_t i = 0; i < rows; ++i) xr[i] = x + (m0 + i) * k;
    for (int64_t n = n0; n < n1; ++n) {
      VecF acc[2][kRows];
      for (int64_t i = 0; i < kRows; ++i) acc[0][i] = acc[1][i] = vzero();
      switch (rows) {  // the row count as a constant, so the inner loop unrolls
#define KVTIDE_ROWS_CASE(R)                                                                         \
  case R:                                                                                           \
    for_each_weight_vector(w, n, [&](auto slot, int64_t kk, VecF wv) {                             \
      constexpr int c = R == 1 ? decltype(slot)::value : 0; /* R rows are R chains already */       \
      for (int64_t i = 0; i < R; ++i) acc[c][i] = vfma(vload(xr[i] + kk), wv, acc[c][i]);         \
    });                                                                                             \
    break;
        KVTIDE_ROWS_CASE(1)
        KVTIDE_ROWS_CASE(2)
        KVTIDE_ROWS_CASE(3)
        KVTIDE_ROWS_CASE(4)
#undef KVTIDE_ROWS_CASE
      }
      for (int64_t i = 0; i < rows; ++i) out[(m0 + i) * n_total + n] = vsum(acc[0][i] + acc[1][i]);
    }
    return;
  }
#endif
  for (int64_t n = n0; n < n1; ++n) {
    dequant_row_scalar(w, n, k, scratch);
    for (int64_t i = 0; i < rows; ++i) {
      const float* xi = x + (m0 + i) * k;
      float acc = 0.0f;
      for (int64_t j = 0; j < k; ++j) acc += xi[j] * scratch[j];
      out[(m0 + i) * n_total + n] = acc;
    }
  }
}

Weight make_weight(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                   int64_t kind, int64_t group_size, int64_t k) {
  TORCH_CHECK(kind != kInt4A8 || group_size % 32 == 0, "int8 activations need int4 groups that are multiples of 32");
  if (kind == kInt4A8) kind = kInt4;  // the same codes; only the activations differ
  TORCH_CHECK(kind == kInt8 || kind == kInt4 || kind == kFp8 || kind == kIq4, "unknown quantized kind ", kind);
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "codes and scales must be contiguous");
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "scales must be float32");
  TORCH_CHECK(group_size > 0 && k % group_size == 0, "group size must divide K");
  const bool nibbles = kind == kInt4 || kind == kIq4;
  TORCH_CHECK(!nibbles || group_size % 32 == 0 || group_size == 16, "int4 groups must be 16 or multiples of 32");
  const int64_t row_bytes = nibbles ? k / 2 : k;
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) == row_bytes && codes.scalar_type() == (kind == kInt8 ? at::kChar : at::kByte),
              "codes must be ", kind == kInt8 ? "int8" : "uint8", " with ", row_bytes, " bytes per row");
  const int64_t groups = k / group_size;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == codes.size(0) && scales.size(1) == groups,
              "scales must be (N, K / group)");
  const float* mins_ptr = nullptr;
  if (mins.has_value()) {
    TORCH_CHECK(mins->is_contiguous() && mins->scalar_type() == at::kFloat && mins->sizes() == scales.sizes(),
                "mins must be float32 like scales");
    mins_ptr = mins->data_ptr<float>();
  }
  return Weight{static_cast<const uint8_t*>(codes.data_ptr()), row_bytes, scales.data_ptr<float>(), mins_ptr,
                groups, group_size, kind};
}

void quantized_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const std::optional<at::Tensor>& mins, int64_t kind, int64_t group_size) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "x and out must be float32");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "x and out must be contiguous 2-D");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "out must be (M, N)");
  const Weight w = make_weight(codes, scales, mins, kind, group_size, k);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Chunks of output rows: several per thread so uneven cores even out, each at least 16 rows.
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(16, (n + threads * 4 - 1) / (threads * 4));
  if (kind == kInt4A8) {
    Int8Activations a;
    quantize_activations(xp, m, k, group_size, a);
    const int mode = scale_mode(group_size);
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      for (int64_t m0 = 0; m0 < m; m0 += kRows) {
        const int64_t r = std::min(kRows, m - m0);
        switch (mode) {
          case kScalesPerBlock: int4a8_tile<kScalesPerBlock>(w, a, m0, r, n0, n1, op, n); break;
          case kScalesWide: int4a8_tile<kScalesWide>(w, a, m0, r, n0, n1, op, n); break;
          default: int4a8_tile<kScalesGeneral>(w, a, m0, r, n0, n1, op, n); break;
        }
      }
    });
    return;
  }
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> scratch(k);
    for (int64_t m0 = 0; m0 < m; m0 += kRows) {
      linear_tile(w, xp, k, m0, std::min(kRows, m - m0), n0, n1, op, n, scratch.data());
    }
  });
}

void dequantize_rows(at::Tensor& out, const at::Tensor& codes, const at::Tensor& scales,
                     const std::optional<at::Tensor>& mins, int64_t kind, int64_t group_size) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2, "out: float32 (N, K)");
  const int64_t n = out.size(0), k = out.size(1);
  TORCH_CHECK(codes.size(0) == n, "codes and out differ in rows");
  const Weight w = make_weight(codes, scales, mins, kind, group_size, k);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
      if (w.group % kLanes == 0) {
        float* row = op + r * k;
        for_each_weight_vector(w, r, [&](auto, int64_t kk, VecF wv) { vstore(row + kk, wv); });
        continue;
      }
#endif
      dequant_row_scalar(w, r, k, op + r * k);
    }
  });
}

}  // namespace
}  // namespace KVTIDE_OPS_NS

KVTIDE_LIBRARY(KVTIDE_OPS_NS, m) {
  m.def("quantized_linear(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor? mins, int kind, "
        "int group_size) -> ()",
        &KVTIDE_OPS_NS::quantized_linear);
  m.def("dequantize_rows(Tensor(a!) out, Tensor codes, Tensor scales, Tensor? mins, int kind, "
        "int group_size) -> ()",
        &KVTIDE_OPS_NS::dequantize_rows);
}
