// Paged attention on CPU: each query reads its request's K/V in place from the paged cache through
// the block table (no gather copy), with an online softmax over blocks.
//
//   kv_cache: (2, H_kv, num_blocks, block_size, D)      the torch backend's head-major layout
//   query, out: (T, H, D), tokens packed; row r owns tokens [qsl[r], qsl[r+1])
//
// One work item is (row, KV head, partition): the H / H_kv query heads of the group and every query
// token of the row share each K/V block read. A partition is a run of the row's blocks; rows are
// split into several only when there are too few (row, KV head) items to keep every thread busy,
// and the partitions are merged by log-sum-exp afterwards.
//
// The same source is compiled once per ISA (cpu_extension.py): CPU_CAPABILITY selects at::vec's
// implementation and KVTIDE_OPS_NS names both the C++ namespace and the op library, so builds for
// several ISAs can live in one process.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void from_float(const float* src, c10::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
inline float hsum(const Vec& v) { return v.reduce_add(); }
#else
inline float hsum(const Vec& v) {  // the generic Vectorized's reduce_add does not compile
  float lanes[kV];
  v.store(lanes);
  float s = 0.f;
  for (int64_t i = 0; i < kV; ++i) s += lanes[i];
  return s;
}
#endif

// scores[t * ld + j] = q_t . k_j for N queries and keys j in [ja, jb) of a (block_size, D) block.
template <int N>
inline void dots(const float* const* q, const float* k, int64_t ja, int64_t jb, int64_t D,
                 float* const* scores) {
  for (int64_t j = ja; j < jb; ++j) {
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
}

// acc_t = acc_t * alpha_t + sum_j p_t[j] v_j for N queries over keys [ja, jb).
template <int N>
inline void weighted_sum(float* const* acc, const float* alpha, const float* const* p, const float* v,
                         int64_t ja, int64_t jb, int64_t D) {
  int64_t c = 0;
  for (; c + kV <= D; c += kV) {
    Vec a[N];
    for (int t = 0; t < N; ++t) a[t] = Vec::loadu(acc[t] + c) * Vec(alpha[t]);
    for (int64_t j = ja; j < jb; ++j) {
      Vec vc = Vec::loadu(v + j * D + c);
      for (int t = 0; t < N; ++t) a[t] = at::vec::fmadd(Vec(p[t][j]), vc, a[t]);
    }
    for (int t = 0; t < N; ++t) a[t].store(acc[t] + c);
  }
  for (; c < D; ++c) {
    for (int t = 0; t < N; ++t) {
      float a = acc[t][c] * alpha[t];
      for (int64_t j = ja; j < jb; ++j) a += p[t][j] * v[j * D + c];
      acc[t][c] = a;
    }
  }
}

// Scores in [ja, jb) -> weights relative to the query's new running max; returns the rescale factor
// of what it had accumulated. Keys outside [lo, hi) (the query's own range) get weight 0.
inline float softmax_step(float* s, int64_t ja, int64_t jb, int64_t lo, int64_t hi, float& mx, float& sum) {
  for (int64_t j = ja; j < std::min(lo, jb); ++j) s[j] = kNegInf;
  for (int64_t j = std::max(hi, ja); j < jb; ++j) s[j] = kNegInf;
  float block_max = kNegInf;
  for (int64_t j = ja; j < jb; ++j) block_max = std::max(block_max, s[j]);
  if (block_max == kNegInf) {  // nothing visible here: keep the state, add nothing
    for (int64_t j = ja; j < jb; ++j) s[j] = 0.f;
    return 1.f;
  }
  const float new_max = std::max(mx, block_max);
  const float shift = mx - new_max;  // -inf for the first visible block
  const float alpha = shift < -kCutoff ? 0.f : std::exp(shift);
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
  int64_t window;  // <= 0: none
  float scale;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* qsl;
};

// A row's key range and the blocks it covers.
struct RowSpan {
  int64_t q_start, q_len, seq_len, key_lo, first_block, end_block;
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

template <int N>
inline void tile_step(Workspace& w, int64_t m0, const float* k, const float* v, int64_t ja, int64_t jb,
                      const Problem& p, const int64_t* lo, const int64_t* hi) {
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
  dots<N>(q, k, ja, jb, D, s);
  float alpha[N];
  for (int t = 0; t < N; ++t)
    alpha[t] = softmax_step(s[t], ja, jb, lo[t], hi[t], w.mx[m0 + t], w.sum[m0 + t]);
  weighted_sum<N>(acc, alpha, probs, v, ja, jb, D);
}

// Attends row r, KV head h over blocks [b0, b1) into the workspace's (acc, mx, sum).
template <typename scalar_t>
void attend_partition(const Problem& p, const scalar_t* query, const scalar_t* kv, const RowSpan& row,
                      int64_t h, int64_t b0, int64_t b1, Workspace& w) {
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
  const int64_t head_blocks = p.num_blocks * B * D;
  const scalar_t* k_head = kv + h * head_blocks;
  const scalar_t* v_head = kv + (p.num_kv_heads + h) * head_blocks;
  const int32_t* table = p.block_tables;
  int64_t lo[kTile], hi[kTile];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t j0 = b * B;
    // Keys of this block inside the row's range, and the tokens that see any of them: token t sees
    // [pos - window + 1, pos] with pos = first_pos + t.
    const int64_t ja = std::max<int64_t>(row.key_lo - j0, 0);
    const int64_t jb = std::min<int64_t>(row.seq_len - j0, B);
    const int64_t t_first = std::max<int64_t>(0, j0 + ja - first_pos);
    int64_t t_last = row.q_len - 1;
    if (p.window > 0) t_last = std::min<int64_t>(t_last, j0 + jb - 1 + p.window - 1 - first_pos);
    if (ja >= jb || t_first > t_last) continue;
    const int64_t offset = static_cast<int64_t>(table[b]) * B * D;
    const float* k;
    const float* v;
    if constexpr (std::is_same_v<scalar_t, float>) {
      k = k_head + offset;
      v = v_head + offset;
    } else {
      to_float(k_head + offset + ja * D, w.k.data() + ja * D, (jb - ja) * D);
      to_float(v_head + offset + ja * D, w.v.data() + ja * D, (jb - ja) * D);
      k = w.k.data();
      v = w.v.data();
    }
    const int64_t m_end = (t_last + 1) * G;
    for (int64_t m0 = t_first * G; m0 < m_end; m0 += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, m_end - m0));
      for (int t = 0; t < n; ++t) {
        const int64_t pos = first_pos + (m0 + t) / G;
        lo[t] = (p.window > 0 ? pos - p.window + 1 : 0) - j0;
        hi[t] = pos + 1 - j0;
      }
      switch (n) {
        case 4: tile_step<4>(w, m0, k, v, ja, jb, p, lo, hi); break;
        case 3: tile_step<3>(w, m0, k, v, ja, jb, p, lo, hi); break;
        case 2: tile_step<2>(w, m0, k, v, ja, jb, p, lo, hi); break;
        default: tile_step<1>(w, m0, k, v, ja, jb, p, lo, hi); break;
      }
    }
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

// Runs fn(i) for i in [0, n) on the intra-op threads, each taking the next item when it is free
// (items differ in cost: context lengths vary).
template <typename F>
void parallel_items(int64_t n, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(i);
  });
}

template <typename scalar_t>
void run(const Problem& p, const scalar_t* query, const scalar_t* kv, scalar_t* out, int64_t num_rows,
         int64_t partition_tokens) {
  std::vector<RowSpan> rows(num_rows);
  int64_t max_q_len = 1, max_blocks = 1;
  for (int64_t r = 0; r < num_rows; ++r) {
    rows[r] = row_span(p, r);
    max_q_len = std::max(max_q_len, rows[r].q_len);
    max_blocks = std::max(max_blocks, rows[r].end_block - rows[r].first_block);
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
  // (row, first block) of every partition; rows with several keep their partial results.
  std::vector<int64_t> part_row, part_first, first_part(num_rows + 1, 0);
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t b = rows[r].first_block; b < rows[r].end_block; b += part_blocks) {
      part_row.push_back(r);
      part_first.push_back(b);
    }
    first_part[r + 1] = static_cast<int64_t>(part_row.size());
  }
  const int64_t num_parts = static_cast<int64_t>(part_row.size());
  const int64_t H_kv = p.num_kv_heads, D = p.head_dim, max_m = max_q_len * p.group;
  const bool split = num_parts > num_rows;
  // Per (partition, KV head): acc (max_m, D), then mx (max_m), then sum (max_m).
  const int64_t part_floats = max_m * (D + 2);
  std::vector<float> partial(split ? num_parts * H_kv * part_floats : 0);
  const bool convert_kv = !std::is_same_v<scalar_t, float>;

  parallel_items(num_parts * H_kv, [&](int64_t item) {
    thread_local Workspace w;
    const int64_t part = item / H_kv, h = item % H_kv, r = part_row[part];
    const RowSpan& row = rows[r];
    w.reserve(row.q_len * p.group, p, convert_kv);
    Problem rp = p;
    rp.block_tables = p.block_tables + r * p.table_stride;
    const int64_t b0 = part_first[part], b1 = std::min(b0 + part_blocks, row.end_block);
    attend_partition(rp, query, kv, row, h, b0, b1, w);
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
  parallel_items(num_rows * H_kv, [&](int64_t item) {
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

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, int64_t num_rows, double scale, int64_t window,
                     int64_t partition_tokens) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() && out.device().is_cpu(),
              "paged_attention: tensors must be on the CPU");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "paged_attention: query must be (T, H, D) with unit "
              "stride in D, got ", query.sizes());
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1,
              "paged_attention: out must have query's shape with unit stride in D");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_attention: kv_cache must be contiguous (2, H_kv, num_blocks, block_size, D), got ",
              kv_cache.sizes());
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "paged_attention: float32 or bfloat16 only, got ",
              dtype);
  TORCH_CHECK(kv_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_attention: query, kv_cache and out must share a dtype");
  const int64_t num_heads = query.size(1), num_kv_heads = kv_cache.size(1), head_dim = query.size(2);
  TORCH_CHECK(kv_cache.size(4) == head_dim, "paged_attention: head_dim differs between query and kv_cache");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "paged_attention: num_heads must be a multiple of num_kv_heads");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->device().is_cpu(),
                "paged_attention: block_tables, seq_lens and query_start_loc must be int32 CPU tensors");
  }
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && block_tables.size(0) >= num_rows,
              "paged_attention: block_tables must be (>= num_rows, max_blocks) with unit stride in dim 1");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous() && seq_lens.size(0) >= num_rows,
              "paged_attention: seq_lens must be contiguous (>= num_rows,)");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.is_contiguous() &&
              query_start_loc.size(0) >= num_rows + 1,
              "paged_attention: query_start_loc must be contiguous (>= num_rows + 1,)");
  TORCH_CHECK(num_rows >= 0, "paged_attention: num_rows must be >= 0");
  if (num_rows == 0) return;

  Problem p;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.group = num_heads / num_kv_heads;
  p.head_dim = head_dim;
  p.num_blocks = kv_cache.size(2);
  p.block_size = kv_cache.size(3);
  p.q_stride_t = query.stride(0);
  p.q_stride_h = query.stride(1);
  p.o_stride_t = out.stride(0);
  p.o_stride_h = out.stride(1);
  p.table_stride = block_tables.stride(0);
  p.window = window;
  p.scale = static_cast<float>(scale);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.qsl = query_start_loc.data_ptr<int32_t>();
  // Every index the kernel will follow, checked here rather than trusted.
  const int64_t max_table = block_tables.size(1);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t q_start = p.qsl[r], q_len = p.qsl[r + 1] - p.qsl[r], seq_len = p.seq_lens[r];
    TORCH_CHECK(q_start >= 0 && q_len >= 1 && q_start + q_len <= query.size(0),
                "paged_attention: row ", r, " has query tokens [", q_start, ", ", q_start + q_len,
                ") outside the ", query.size(0), " given");
    TORCH_CHECK(seq_len >= q_len && seq_len <= max_table * p.block_size, "paged_attention: row ", r,
                " has seq_len ", seq_len, " for ", q_len, " queries and ", max_table, " table entries");
    const RowSpan row = row_span(p, r);
    const int32_t* table = p.block_tables + r * p.table_stride;
    for (int64_t b = row.first_block; b < row.end_block; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < p.num_blocks, "paged_attention: row ", r, " block ", b,
                  " is ", table[b], ", outside the cache's ", p.num_blocks, " blocks");
    }
  }
  if (dtype == at::kFloat) {
    run<float>(p, query.data_ptr<float>(), kv_cache.data_ptr<float>(), out.data_ptr<float>(), num_rows,
               partition_tokens);
  } else {
    run<c10::BFloat16>(p, query.data_ptr<c10::BFloat16>(), kv_cache.data_ptr<c10::BFloat16>(),
                       out.data_ptr<c10::BFloat16>(), num_rows, partition_tokens);
  }
}

}  // namespace
}  // namespace KVTIDE_OPS_NS

KVTIDE_LIBRARY(KVTIDE_OPS_NS, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int num_rows, float scale, int window, "
        "int partition_tokens=0) -> ()",
        &KVTIDE_OPS_NS::paged_attention);
}
