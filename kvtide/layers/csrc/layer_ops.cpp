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
//
// linear_panels is a candidate of layers/cpu_gemm.py's chooser (it is used only for the shapes and
// row counts where it measures fastest and passes the numerics check). A decode step reads every
// weight once, so a batch-1 linear is bound by memory: each thread streams a contiguous run of
// panels (one 64-byte line per k), and up to 4 activation rows share each weight load. Library
// GEMVs on small shapes stayed at 14-17 GB/s on a Zen 5 EPYC, against 38 GB/s for a large one.
//
// Sums run in float32 in another order than torch's (vector lanes, then across them), so results
// may differ from torch's in the last bits; the models' parity tests bound the effect.
//
// Compiled once per ISA (attention/cpu_extension.py): CPU_CAPABILITY selects at::vec's
// implementation, KVTIDE_OPS_NS names the C++ namespace and the op library.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

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
constexpr int64_t kRows = 4;  // activation rows sharing one pass over a panel
constexpr int64_t kPrefetchRows = 32;  // panel rows (64-byte lines) read ahead of the FMAs
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

// ---- small-row linears on weight panels ------------------------------------------------------------
// R activation rows against one panel: acc[u][r] sums k = u (mod U) so the FMA chains overlap and
// each chain adds up K / U terms; the U partial sums are added at the end.
template <int64_t R>
inline void panel_rows(const float* x, int64_t ldx, const float* panel, int64_t k, const float* bias,
                       float* out, int64_t ldo, int64_t cols) {
  constexpr int64_t U = R * kPanelVecs <= 4 ? 2 : 1;
  // Fully unrolled (the pragmas), so the accumulators live in registers, not on the stack.
  Vec acc[U][R][kPanelVecs];
#pragma GCC unroll 16
  for (int64_t u = 0; u < U; ++u)
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int64_t v = 0; v < kPanelVecs; ++v) acc[u][r][v] = Vec(0.f);
  int64_t kk = 0;
  for (; kk + U <= k; kk += U) {
    __builtin_prefetch(panel + (kk + kPrefetchRows) * kPanel, 0, 3);
#pragma GCC unroll 16
    for (int64_t u = 0; u < U; ++u) {
      const float* w = panel + (kk + u) * kPanel;
      Vec wv[kPanelVecs];
#pragma GCC unroll 16
      for (int64_t v = 0; v < kPanelVecs; ++v) wv[v] = Vec::loadu(w + v * kV);
#pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r) {
        const Vec xv(x[r * ldx + kk + u]);
#pragma GCC unroll 16
        for (int64_t v = 0; v < kPanelVecs; ++v) acc[u][r][v] = at::vec::fmadd(xv, wv[v], acc[u][r][v]);
      }
    }
  }
  for (; kk < k; ++kk) {  // K not a multiple of U
    const float* w = panel + kk * kPanel;
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      const Vec xv(x[r * ldx + kk]);
#pragma GCC unroll 16
      for (int64_t v = 0; v < kPanelVecs; ++v) acc[0][r][v] = at::vec::fmadd(xv, Vec::loadu(w + v * kV), acc[0][r][v]);
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    float sums[kPanel];
#pragma GCC unroll 16
    for (int64_t v = 0; v < kPanelVecs; ++v) {
      Vec s = acc[0][r][v];
#pragma GCC unroll 16
      for (int64_t u = 1; u < U; ++u) s = s + acc[u][r][v];
      if (bias != nullptr && cols == kPanel) s = s + Vec::loadu(bias + v * kV);
      s.store(sums + v * kV);
    }
    float* o = out + r * ldo;
    if (cols == kPanel) {
      std::copy(sums, sums + kPanel, o);
    } else {
      for (int64_t c = 0; c < cols; ++c) o[c] = bias != nullptr ? sums[c] + bias[c] : sums[c];
    }
  }
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
  // Panels split evenly over the threads: each streams one contiguous run of the weight.
  at::parallel_for(0, panels.size(0), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = wp + p * k * kPanel;
      const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
      const float* b = bias_ptr == nullptr ? nullptr : bias_ptr + col;
      int64_t r = 0;
      for (; r + kRows <= m; r += kRows) panel_rows<kRows>(xp + r * k, k, panel, k, b, op + r * n + col, n, cols);
      switch (m - r) {
        case 3: panel_rows<3>(xp + r * k, k, panel, k, b, op + r * n + col, n, cols); break;
        case 2: panel_rows<2>(xp + r * k, k, panel, k, b, op + r * n + col, n, cols); break;
        case 1: panel_rows<1>(xp + r * k, k, panel, k, b, op + r * n + col, n, cols); break;
        default: break;
      }
    }
  });
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
}
