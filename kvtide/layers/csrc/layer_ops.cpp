// The decoder layer's small CPU ops, each one pass over its data in one call.
//
// A narrow model's decode step is dominated by per-op cost, not arithmetic: SmolLM2's 30 layers run
// about 1,300 aten ops per step, and RMSNorm alone (pow, mean, add, rsqrt, mul, ... on a 576-wide
// row) took ~22 us a call. These ops do the same arithmetic as the torch code they replace, in one
// call each:
//
//   rms_norm(out, x, weight, eps)               out = x * rsqrt(mean(x^2) + eps) * weight
//   add_rms_norm(out, x, residual, weight, eps) residual += x; out = rms_norm(residual)
//   silu_and_mul(out, x)                        x = [gate | up] -> out = silu(gate) * up
//   rotary_embedding(qk, cos, sin)              neox rotation in place: [x1, x2] ->
//                                               [x1 cos - x2 sin, x2 cos + x1 sin], per token and head
//   linear_panels(out, x, panels, bias)         out = x @ W^T (+ bias) for a few rows, W packed as
//                                               panels (ceil(N / 16), K, 16): 16 output columns
//                                               side by side for every k
//   set_panel_prefetch(rows)                    how far ahead the panel kernels prefetch (0: none)
//   moe_experts(out, hidden, token_idx, ...)    a MoE layer's experts: gather the routed rows, w13 on
//                                               panels, SiLU-and-mul, w2 on panels, weighted sum
//   decode_layer(x, residual, ...) -> out       a dense Llama-family decoder layer for decode rows:
//                                               the ops above in the module path's order, with the
//                                               K/V write, paged attention and quantized linears of
//                                               their own libraries called through the dispatcher
//
// linear_panels is a candidate of layers/cpu_gemm.py's chooser (it is used only for the shapes and
// row counts where it measures fastest and passes the numerics check). A decode step reads every
// weight once, so a batch-1 linear is bound by memory: each thread streams a contiguous run of
// panels (one 64-byte line per k), and a tile of up to 12 activation rows shares each weight load
// (below). Library GEMVs on small shapes stayed at 14-17 GB/s on a Zen 5 EPYC, against 38 GB/s for
// a large one.
//
// Sums run in float32 in another order than torch's (vector lanes, then across them), so results
// may differ from torch's in the last bits; the models' parity tests bound the effect.
//
// Compiled once per ISA (attention/cpu_extension.py): CPU_CAPABILITY selects at::vec's
// implementation, KVTIDE_OPS_NS names the C++ namespace and the op library.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#ifndef KVTIDE_OPS_NS
#define KVTIDE_OPS_NS kvtide_layers_default
#endif
#define KVTIDE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace KVTIDE_OPS_NS {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kV = Vec::size();
constexpr int64_t kPanel = 16;  // output columns per weight panel
static_assert(kPanel % kV == 0, "a panel holds whole vectors");
constexpr int64_t kPanelVecs = kPanel / kV;
// Panel rows (64-byte lines) a panel tile prefetches ahead of its FMAs, 0 for none: measured per
// machine (layers/cpu_gemm.py, set_panel_prefetch), since it helps on some CPUs and costs on others
// (a Zen 4 EPYC streams 15-20% faster on its hardware prefetcher alone).
std::atomic<int64_t> g_panel_prefetch{32};
// Elements per parallel chunk of the row-wise ops: below this, one thread (a fork costs more).
constexpr int64_t kElementsPerTask = 1 << 15;

inline float hsum(const Vec& v) {
  float lanes[kV];
  v.store(lanes);
  float s = 0.f;
  for (int64_t i = 0; i < kV; ++i) s += lanes[i];
  return s;
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

int64_t row_grain(int64_t width) { return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(width, 1)); }

// ---- RMSNorm ---------------------------------------------------------------------------------------
inline float sum_squares(const float* x, int64_t n) {
  Vec a(0.f), b(0.f);
  int64_t i = 0;
  for (; i + 2 * kV <= n; i += 2 * kV) {
    Vec u = Vec::loadu(x + i), v = Vec::loadu(x + i + kV);
    a = at::vec::fmadd(u, u, a);
    b = at::vec::fmadd(v, v, b);
  }
  for (; i + kV <= n; i += kV) {
    Vec u = Vec::loadu(x + i);
    a = at::vec::fmadd(u, u, a);
  }
  float s = hsum(a + b);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

inline void scale_row(const float* x, const float* w, float inv, float* out, int64_t n) {
  const Vec vinv(inv);
  int64_t i = 0;
  for (; i + kV <= n; i += kV) (Vec::loadu(x + i) * vinv * Vec::loadu(w + i)).store(out + i);
  for (; i < n; ++i) out[i] = x[i] * inv * w[i];
}

void check_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(1),
              "weight must be float32 (", x.size(1), ",), got ", weight.sizes());
  TORCH_CHECK(out.sizes() == x.sizes(), "out must be shaped like x");
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(out, x, weight);
  const int64_t n = x.size(1);
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, x.size(0), row_grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = x.data_ptr<float>() + r * x.stride(0);
      const float inv = 1.f / std::sqrt(sum_squares(row, n) / static_cast<float>(n) + static_cast<float>(eps));
      scale_row(row, w, inv, out.data_ptr<float>() + r * out.stride(0), n);
    }
  });
}

void add_rms_norm(at::Tensor& out, const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_norm(out, x, weight);
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must be shaped like x");
  const int64_t n = x.size(1);
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, x.size(0), row_grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x.data_ptr<float>() + r * x.stride(0);
      float* res = residual.data_ptr<float>() + r * residual.stride(0);
      int64_t i = 0;
      for (; i + kV <= n; i += kV) (Vec::loadu(res + i) + Vec::loadu(xr + i)).store(res + i);
      for (; i < n; ++i) res[i] += xr[i];
      const float inv = 1.f / std::sqrt(sum_squares(res, n) / static_cast<float>(n) + static_cast<float>(eps));
      scale_row(res, w, inv, out.data_ptr<float>() + r * out.stride(0), n);
    }
  });
}

// ---- SiLU and multiply -----------------------------------------------------------------------------
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t d = x.size(1) / 2;
  TORCH_CHECK(x.size(1) == 2 * d && out.size(0) == x.size(0) && out.size(1) == d,
              "x must be (T, 2d) and out (T, d); got ", x.sizes(), " and ", out.sizes());
  const Vec one(1.f);
  at::parallel_for(0, x.size(0), row_grain(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gate = x.data_ptr<float>() + r * x.stride(0);
      const float* up = gate + d;
      float* o = out.data_ptr<float>() + r * out.stride(0);
      int64_t i = 0;
      for (; i + kV <= d; i += kV) {
        Vec g = Vec::loadu(gate + i);
        (g / (one + g.neg().exp()) * Vec::loadu(up + i)).store(o + i);
      }
      for (; i < d; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
}

// ---- rotary embedding --------------------------------------------------------------------------------
void rotary_embedding(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qk.scalar_type() == at::kFloat && qk.device().is_cpu(), "qk must be float32 on the CPU");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "qk must be (T, H, D) with contiguous heads");
  const int64_t tokens = qk.size(0), heads = qk.size(1), half = qk.size(2) / 2;
  TORCH_CHECK(qk.size(2) == 2 * half, "head size must be even");
  // (T, D/2), or RotaryEmbedding.cos_sin's (T, 1, D/2): one row of D/2 per token either way.
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && (t->dim() == 2 || (t->dim() == 3 && t->size(1) == 1)) &&
                    t->size(0) == tokens && t->size(-1) == half && t->stride(-1) == 1,
                "cos and sin must be float32 (T, D/2) or (T, 1, D/2) with T = ", tokens, ", D/2 = ", half,
                ", got ", t->sizes());
  }
  at::parallel_for(0, tokens, row_grain(heads * half * 2), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos.data_ptr<float>() + t * cos.stride(0);
      const float* s = sin.data_ptr<float>() + t * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = qk.data_ptr<float>() + t * qk.stride(0) + h * qk.stride(1);
        float* x2 = x1 + half;
        int64_t i = 0;
        for (; i + kV <= half; i += kV) {
          Vec a = Vec::loadu(x1 + i), b = Vec::loadu(x2 + i), vc = Vec::loadu(c + i), vs = Vec::loadu(s + i);
          (a * vc - b * vs).store(x1 + i);
          (b * vc + a * vs).store(x2 + i);
        }
        for (; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

// ---- linears on weight panels ----------------------------------------------------------------------
// A tile is R activation rows against P adjacent panels: each weight vector loaded is used by R
// FMAs, each activation element (broadcast) by P * kPanelVecs. The tile keeps R * P * kPanelVecs
// accumulators in registers: up to 24 of AVX-512's 32 (12 rows x 2 panels) or 12 of AVX2's 16
// (6 rows x 1 panel of two vectors), so a 16-row expert GEMM or a prefill chunk loads each weight
// vector once per 12 rows (4 before), and the FMAs, not the loads, set the pace. For few
// accumulators (decode's 1-2 rows), acc[u] sums k = u (mod U) so the FMA chains overlap; the U
// partial sums are added at the end.
constexpr int64_t kTilePanels = kPanelVecs == 1 ? 2 : 1;
constexpr int64_t kAccumulators = kV >= 16 ? 24 : 12;
constexpr int64_t kTileRows = kAccumulators / (kTilePanels * kPanelVecs);
constexpr int64_t kMemoryBoundRows = 2;  // up to this many rows: tiles of one panel

template <int64_t R, int64_t P>
inline void panel_tile(const float* x, int64_t ldx, const float* panels, int64_t k, const float* bias,
                       float* out, int64_t ldo, int64_t cols, const float* next = nullptr,
                       int64_t next_every = 0) {
  constexpr int64_t PV = P * kPanelVecs;
  constexpr int64_t U = R * PV <= 4 ? 2 : 1;
  const int64_t panel_stride = k * kPanel;
  // Fully unrolled (the pragmas), so the accumulators live in registers, not on the stack.
  Vec acc[U][R][PV];
#pragma GCC unroll 32
  for (int64_t u = 0; u < U; ++u)
#pragma GCC unroll 32
    for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 32
      for (int64_t v = 0; v < PV; ++v) acc[u][r][v] = Vec(0.f);
  const int64_t prefetch = g_panel_prefetch.load(std::memory_order_relaxed);
  int64_t countdown = next_every;
  int64_t kk = 0;
  for (; kk + U <= k; kk += U) {
    if (prefetch > 0) {
#pragma GCC unroll 4
      for (int64_t p = 0; p < P; ++p) __builtin_prefetch(panels + p * panel_stride + (kk + prefetch) * kPanel, 0, 3);
    }
    if (next != nullptr && --countdown == 0) {  // a line of each of the next group's panels
      countdown = next_every;
#pragma GCC unroll 4
      for (int64_t p = 0; p < P; ++p) __builtin_prefetch(next + p * panel_stride, 0, 2);
      next += kPanel;
    }
#pragma GCC unroll 4
    for (int64_t u = 0; u < U; ++u) {
      Vec wv[PV];
#pragma GCC unroll 4
      for (int64_t p = 0; p < P; ++p)
#pragma GCC unroll 4
        for (int64_t v = 0; v < kPanelVecs; ++v)
          wv[p * kPanelVecs + v] = Vec::loadu(panels + p * panel_stride + (kk + u) * kPanel + v * kV);
#pragma GCC unroll 32
      for (int64_t r = 0; r < R; ++r) {
        const Vec xv(x[r * ldx + kk + u]);
#pragma GCC unroll 32
        for (int64_t v = 0; v < PV; ++v) acc[u][r][v] = at::vec::fmadd(xv, wv[v], acc[u][r][v]);
      }
    }
  }
  for (; kk < k; ++kk) {  // K not a multiple of U
#pragma GCC unroll 32
    for (int64_t r = 0; r < R; ++r) {
      const Vec xv(x[r * ldx + kk]);
#pragma GCC unroll 32
      for (int64_t v = 0; v < PV; ++v) {
        const float* w = panels + (v / kPanelVecs) * panel_stride + kk * kPanel + (v % kPanelVecs) * kV;
        acc[0][r][v] = at::vec::fmadd(xv, Vec::loadu(w), acc[0][r][v]);
      }
    }
  }
#pragma GCC unroll 32
  for (int64_t r = 0; r < R; ++r) {
    float sums[P * kPanel];
#pragma GCC unroll 32
    for (int64_t v = 0; v < PV; ++v) {
      Vec s = acc[0][r][v];
#pragma GCC unroll 4
      for (int64_t u = 1; u < U; ++u) s = s + acc[u][r][v];
      if (bias != nullptr && cols == P * kPanel) s = s + Vec::loadu(bias + v * kV);
      s.store(sums + v * kV);
    }
    float* o = out + r * ldo;
    if (cols == P * kPanel) {
      std::copy(sums, sums + P * kPanel, o);
    } else {
      for (int64_t c = 0; c < cols; ++c) o[c] = bias != nullptr ? sums[c] + bias[c] : sums[c];
    }
  }
}

// panel_tile<rows, P> for a run-time row count in [1, R].
template <int64_t P, int64_t R = kTileRows>
inline void panel_tile_rows(int64_t rows, const float* x, int64_t ldx, const float* panels, int64_t k,
                            const float* bias, float* out, int64_t ldo, int64_t cols) {
  if constexpr (R >= 1) {
    if (rows == R) return panel_tile<R, P>(x, ldx, panels, k, bias, out, ldo, cols);
    panel_tile_rows<P, R - 1>(rows, x, ldx, panels, k, bias, out, ldo, cols);
  }
}

// A group's row tiles, each a pass over its panels. The first pass reads them from memory, the others
// from the cache; with `next` (the panels this thread multiplies after these), the full tiles bring
// the next group's lines into L2 meanwhile, each pass a slice of them, so every pass runs from the
// cache instead of the first stalling on memory (a 64-row GEMM lost ~15% of its speed there).
template <int64_t P>
inline void panel_group(const float* x, int64_t m, int64_t k, const float* panels, const float* bias,
                        float* out, int64_t n, int64_t cols, const float* next = nullptr) {
  const int64_t passes = m / kTileRows;
  if (passes < 2) next = nullptr;
  const int64_t slice = passes > 0 ? (k + passes - 1) / passes : 0;  // next's lines per pass
  int64_t r = 0;
  for (int64_t t = 0; r + kTileRows <= m; r += kTileRows, ++t)
    panel_tile<kTileRows, P>(x + r * k, k, panels, k, bias, out + r * n, n, cols,
                             next == nullptr ? nullptr : next + t * slice * kPanel, passes);
  if (r < m) panel_tile_rows<P>(m - r, x + r * k, k, panels, k, bias, out + r * n, n, cols);
}

void linear_panels(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                   const std::optional<at::Tensor>& bias) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "x and out must be contiguous");
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.is_contiguous() &&
                  panels.size(2) == kPanel && panels.size(1) == x.size(1),
              "panels must be float32 (ceil(N/16), K, 16) with K = ", x.size(1), ", got ", panels.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(out.size(0) == m && n <= panels.size(0) * kPanel && n > (panels.size(0) - 1) * kPanel,
              "out must be (M, N) with N in the panels' last block; got ", out.sizes());
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == n,
                "bias must be float32 (N,)");
    bias_ptr = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t num_panels = panels.size(0);
  // A few rows are bound by reading the weight: one panel at a time is one stream per thread.
  const int64_t group_panels = m > kMemoryBoundRows ? kTilePanels : 1;
  const int64_t groups = (num_panels + group_panels - 1) / group_panels;
  // Groups of kTilePanels panels split evenly over the threads: each streams one contiguous run of
  // the weight, and each group's panels stay in the cache while every row tile passes over them.
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t first = g * group_panels, count = std::min(group_panels, num_panels - first);
      const int64_t col = first * kPanel, cols = std::min(count * kPanel, n - col);
      const float* panel = wp + first * k * kPanel;
      const float* b = bias_ptr == nullptr ? nullptr : bias_ptr + col;
      if (count == kTilePanels) {
        const bool next_full = g + 1 < g1 && first + 2 * group_panels <= num_panels;
        panel_group<kTilePanels>(xp, m, k, panel, b, op + col, n, cols,
                                 next_full ? panel + group_panels * k * kPanel : nullptr);
      } else {
        panel_group<1>(xp, m, k, panel, b, op + col, n, cols);
      }
    }
  });
}

// ---- a MoE layer's experts on weight panels --------------------------------------------------------
// The rows routed to each expert are contiguous (sorted by expert, offsets[e] .. offsets[e + 1]).
// One GEMM phase runs every (expert, panel group) pair with rows: the pairs are split over the
// threads by their share of the work (rows x panels), so both threads stay busy whether the rows
// spread over all experts or pile onto one, and no thread waits on another between experts.
void experts_gemm(const float* x, int64_t ldx, float* out, int64_t ldo, const int64_t* offsets, int64_t experts,
                  const float* panels, int64_t num_panels, int64_t k, int64_t n) {
  struct Item { int64_t expert, first, count; };
  std::vector<Item> items;
  std::vector<int64_t> cost_before{0};  // work before each item
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    const int64_t group = rows > kMemoryBoundRows ? kTilePanels : 1;
    for (int64_t first = 0; first < num_panels; first += group) {
      const int64_t count = std::min(group, num_panels - first);
      items.push_back({e, first, count});
      cost_before.push_back(cost_before.back() + (rows + 1) * count);  // + 1: a pass over the weight
    }
  }
  if (items.empty()) return;
  const int64_t total = cost_before.back(), threads = std::min<int64_t>(at::get_num_threads(), items.size());
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    // Thread share t takes the items that start in [t * total / threads, (t + 1) * total / threads).
    auto first_item = [&](int64_t t) {
      return std::lower_bound(cost_before.begin(), cost_before.end() - 1, t * total / threads) - cost_before.begin();
    };
    for (int64_t i = first_item(t0), end = first_item(t1); i < end; ++i) {
      const Item& item = items[i];
      const int64_t row0 = offsets[item.expert], rows = offsets[item.expert + 1] - row0;
      const int64_t col = item.first * kPanel, cols = std::min(item.count * kPanel, n - col);
      const float* panel = panels + (item.expert * num_panels + item.first) * k * kPanel;
      if (item.count == kTilePanels) {
        panel_group<kTilePanels>(x + row0 * ldx, rows, k, panel, nullptr, out + row0 * ldo + col, ldo, cols);
      } else {
        panel_group<1>(x + row0 * ldx, rows, k, panel, nullptr, out + row0 * ldo + col, ldo, cols);
      }
    }
  });
}

void check_panels(const at::Tensor& panels, int64_t experts, int64_t n, int64_t k, const char* name) {
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 4 && panels.is_contiguous() &&
                  panels.size(0) == experts && panels.size(1) == (n + kPanel - 1) / kPanel && panels.size(2) == k &&
                  panels.size(3) == kPanel,
              name, " must be float32 (", experts, ", ", (n + kPanel - 1) / kPanel, ", ", k, ", ", kPanel, "), got ",
              panels.sizes());
}

void moe_experts(at::Tensor& out, const at::Tensor& hidden, const at::Tensor& token_idx, const at::Tensor& weights,
                 const at::Tensor& offsets, const at::Tensor& w13_panels, const at::Tensor& w2_panels,
                 int64_t intermediate) {
  check_rows(hidden, "hidden");
  check_rows(out, "out");
  TORCH_CHECK(hidden.is_contiguous() && out.is_contiguous() && out.sizes() == hidden.sizes(),
              "out and hidden must be contiguous (T, H)");
  const int64_t tokens = hidden.size(0), h = hidden.size(1), experts = offsets.size(0) - 1;
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.is_contiguous() && experts >= 1,
              "offsets must be int64 (E + 1,)");
  TORCH_CHECK(token_idx.scalar_type() == at::kLong && token_idx.dim() == 1 && token_idx.is_contiguous(),
              "token_idx must be int64 (A,)");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.dim() == 1 && weights.is_contiguous() &&
                  weights.size(0) == token_idx.size(0), "weights must be float32 (A,)");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t assignments = off[experts];  // the rows past it (skipped assignments) are not read
  TORCH_CHECK(off[0] == 0 && assignments <= token_idx.size(0), "offsets must run from 0 to at most A = ",
              token_idx.size(0));
  for (int64_t e = 0; e < experts; ++e) TORCH_CHECK(off[e] <= off[e + 1], "offsets must not decrease");
  const int64_t* tok = token_idx.data_ptr<int64_t>();
  for (int64_t a = 0; a < assignments; ++a) TORCH_CHECK(0 <= tok[a] && tok[a] < tokens, "token index out of range");
  check_panels(w13_panels, experts, 2 * intermediate, h, "w13_panels");
  check_panels(w2_panels, experts, h, intermediate, "w2_panels");

  out.zero_();
  if (assignments == 0) return;
  const float* hp = hidden.data_ptr<float>();
  at::Tensor xs = at::empty({assignments, h}, hidden.options());
  float* xsp = xs.data_ptr<float>();
  at::parallel_for(0, assignments, row_grain(h), [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) std::copy(hp + tok[a] * h, hp + (tok[a] + 1) * h, xsp + a * h);
  });
  at::Tensor gate_up = at::empty({assignments, 2 * intermediate}, hidden.options());
  experts_gemm(xsp, h, gate_up.data_ptr<float>(), 2 * intermediate, off, experts, w13_panels.data_ptr<float>(),
               w13_panels.size(1), h, 2 * intermediate);
  at::Tensor act = at::empty({assignments, intermediate}, hidden.options());
  silu_and_mul(act, gate_up);
  at::Tensor down = at::empty({assignments, h}, hidden.options());
  experts_gemm(act.data_ptr<float>(), intermediate, down.data_ptr<float>(), h, off, experts,
               w2_panels.data_ptr<float>(), w2_panels.size(1), intermediate, h);
  // out[token] += down * weight, assignment by assignment in expert order (each token's experts added
  // in the order, and with the roundings, of one index_add_ per expert); threads split the columns.
  const float* dp = down.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t vecs = (h + kV - 1) / kV;
  at::parallel_for(0, vecs, std::max<int64_t>(1, vecs / 8), [&](int64_t v0, int64_t v1) {
    const int64_t c0 = v0 * kV, c1 = std::min(h, v1 * kV);
    for (int64_t a = 0; a < assignments; ++a) {
      const float* d = dp + a * h;
      float* o = op + tok[a] * h;
      const Vec w(wp[a]);
      int64_t c = c0;
      for (; c + kV <= c1; c += kV) {
        const Vec product = Vec::loadu(d + c) * w;
        (Vec::loadu(o + c) + product).store(o + c);
      }
      for (; c < c1; ++c) o[c] += d[c] * wp[a];
    }
  });
}

void set_panel_prefetch(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= 1024, "set_panel_prefetch: rows must be in [0, 1024], got ", rows);
  g_panel_prefetch.store(rows, std::memory_order_relaxed);
}

// ---- a dense decoder layer for decode rows ---------------------------------------------------------
// Batch-1 decode of a narrow model pays per op, not per FLOP: SmolLM2's layer is ~12 Python module
// calls around 9 compiled ops, ~150 us a layer of interpreter time against ~25 us of norms, rotary
// and attention. This runs the layer as the module path does (same ops, same order, same buffers'
// shapes: bit-identical results) from one call. The attention library and the quantized linears'
// library are separate builds (their own op namespaces, passed in), reached through the dispatcher.
using AttentionFn = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, int64_t, double, int64_t, int64_t, int64_t);
using WriteKvFn = void(const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&);
using QuantizedLinearFn = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, int64_t, int64_t);

template <typename Fn>
c10::TypedOperatorHandle<Fn> find_op(const std::string& name) {
  static std::mutex mutex;
  static std::unordered_map<std::string, c10::TypedOperatorHandle<Fn>> found;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = found.find(name);
  if (it == found.end())
    it = found.emplace(name, c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Fn>()).first;
  return it->second;
}

// The layer's four linears, each on weight panels (kind -1) or in quantized bytes (kind: the
// quantized-linear op's code kind, with its scales, mins and group size).
struct Linears {
  at::TensorList weights;
  const c10::List<std::optional<at::Tensor>>& scales;
  const c10::List<std::optional<at::Tensor>>& mins;
  const c10::List<std::optional<at::Tensor>>& biases;
  c10::ArrayRef<int64_t> kinds, groups;
  std::string quantized_ns;

  at::Tensor product(int64_t i, const at::Tensor& x, int64_t n) const {
    at::Tensor out = at::empty({x.size(0), n}, x.options());
    const std::optional<at::Tensor> bias = biases.get(i);
    if (kinds[i] < 0) {
      linear_panels(out, x, weights[i], bias);
      return out;
    }
    const std::optional<at::Tensor> scale = scales.get(i);
    TORCH_CHECK(scale.has_value() && !quantized_ns.empty(),
                "decode_layer: a quantized linear needs its scales and the quantized linears' op library");
    find_op<QuantizedLinearFn>(quantized_ns + "::quantized_linear").call(out, x, weights[i], *scale, mins.get(i),
                                                                         kinds[i], groups[i]);
    if (bias.has_value()) out.add_(*bias);  // as the module path adds it, after the product
    return out;
  }
};

at::Tensor decode_layer(const at::Tensor& x, at::Tensor& residual, bool first, const at::Tensor& input_norm,
                        const at::Tensor& post_norm, double eps, at::TensorList weights,
                        const c10::List<std::optional<at::Tensor>>& scales,
                        const c10::List<std::optional<at::Tensor>>& mins,
                        const c10::List<std::optional<at::Tensor>>& biases, c10::ArrayRef<int64_t> kinds,
                        c10::ArrayRef<int64_t> groups, int64_t num_heads, int64_t num_kv_heads, int64_t intermediate,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        const at::Tensor& query_start_loc, int64_t num_rows, double scale, int64_t window,
                        int64_t sink_tokens, c10::string_view attention_ns, c10::string_view quantized_ns) {
  check_rows(x, "x");
  TORCH_CHECK(kv_cache.dim() == 5, "decode_layer: kv_cache must be (2, H_kv, blocks, block_size, D), got ",
              kv_cache.sizes());
  TORCH_CHECK(weights.size() == 4 && scales.size() == 4 && mins.size() == 4 && biases.size() == 4 &&
                  kinds.size() == 4 && groups.size() == 4,
              "decode_layer: give qkv, o, gate_up and down (4 of weights, scales, mins, biases, kinds, groups)");
  const Linears linears{weights, scales, mins, biases, kinds, groups, std::string(quantized_ns)};
  const int64_t m = x.size(0), h = x.size(1), d = kv_cache.size(4);
  const std::string ns(attention_ns);
  // input_layernorm: the first layer's residual is its input itself
  at::Tensor normed = at::empty_like(x);
  if (first) {
    rms_norm(normed, x, input_norm, eps);
  } else {
    add_rms_norm(normed, x, residual, input_norm, eps);
  }
  // q | k | v by head, q and k rotated together, K/V into the cache, attention over it
  const at::Tensor heads = linears.product(0, normed, (num_heads + 2 * num_kv_heads) * d)
                               .view({m, num_heads + 2 * num_kv_heads, d});
  at::Tensor qk = heads.narrow(1, 0, num_heads + num_kv_heads);
  rotary_embedding(qk, cos, sin);
  const at::Tensor q = heads.narrow(1, 0, num_heads);
  find_op<WriteKvFn>(ns + "::write_kv")
      .call(heads.narrow(1, num_heads, num_kv_heads), heads.narrow(1, num_heads + num_kv_heads, num_kv_heads), kv_cache,
            slot_mapping);
  at::Tensor attended = at::empty({m, num_heads, d}, x.options());
  find_op<AttentionFn>(ns + "::paged_attention")
      .call(attended, q, kv_cache, block_tables, seq_lens, query_start_loc, num_rows, scale, window, 0, sink_tokens);
  const at::Tensor projected = linears.product(1, attended.view({m, num_heads * d}), h);
  // post_attention_layernorm, then the gated MLP
  at::Tensor normed_mlp = at::empty_like(x);
  add_rms_norm(normed_mlp, projected, residual, post_norm, eps);
  const at::Tensor gate_up = linears.product(2, normed_mlp, 2 * intermediate);
  at::Tensor activated = at::empty({m, intermediate}, x.options());
  silu_and_mul(activated, gate_up);
  return linears.product(3, activated, h);
}

}  // namespace
}  // namespace KVTIDE_OPS_NS

KVTIDE_LIBRARY(KVTIDE_OPS_NS, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()", &KVTIDE_OPS_NS::rms_norm);
  m.def("add_rms_norm(Tensor(a!) out, Tensor x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
        &KVTIDE_OPS_NS::add_rms_norm);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()", &KVTIDE_OPS_NS::silu_and_mul);
  m.def("rotary_embedding(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()", &KVTIDE_OPS_NS::rotary_embedding);
  m.def("linear_panels(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()", &KVTIDE_OPS_NS::linear_panels);
  m.def("moe_experts(Tensor(a!) out, Tensor hidden, Tensor token_idx, Tensor weights, Tensor offsets, "
        "Tensor w13_panels, Tensor w2_panels, int intermediate) -> ()", &KVTIDE_OPS_NS::moe_experts);
  m.def("set_panel_prefetch(int rows) -> ()", &KVTIDE_OPS_NS::set_panel_prefetch);
  m.def("decode_layer(Tensor x, Tensor(a!) residual, bool first, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor[] weights, Tensor?[] scales, Tensor?[] mins, Tensor?[] biases, int[] kinds, int[] groups, "
        "int num_heads, int num_kv_heads, int intermediate, Tensor cos, Tensor sin, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int num_rows, "
        "float scale, int window, int sink_tokens, str attention_ns, str quantized_ns) -> Tensor",
        &KVTIDE_OPS_NS::decode_layer);
}
