// PoPE attention for CPU inference (float32): softplus-phase features, QK^T, softmax, PV per head group.
//
// Paper: PoPE (shared/papers/004_*), Eqs. 3-6 and the real-valued form Eq. 10:
//   q_real = softplus(q) [cos(t w), sin(t w)] (attention scale folded into the q table),
//   k_real = softplus(k) [cos(s w + delta), sin(s w + delta)],   out = softmax(q_real k_real^T) v.
// Same contract as ``pope_cpu_inference_attention_reference`` in vision_priors/layers/pope.py (its
// plain-PyTorch twin). What this file adds over the torch-op version: the softplus and the feature
// products are one pass per row instead of seven tensor ops, the softmax is one fused pass per row,
// and the per-sample / per-head loop runs without Python in between. The matmuls stay with ATen (MKL).
//
// exp and log1p are written out as branch-free polynomials so that the compiler vectorises the row
// loops without -ffast-math (which would change the process's floating-point state) and without
// relying on a vector math library; each hot function is compiled for AVX-512, AVX2 + FMA and the
// baseline ISA and picked at load time (target_clones), so one build runs on any x86-64.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

namespace {

// VP_PIN_X86_64_V3 / VP_PIN_X86_64_V4 (VISION_PRIORS_POPE_CPU_ISA in pope_cpu.py): one ISA only, to time
// the AVX2 + FMA code on an AVX-512 machine.
#if defined(VP_PIN_X86_64_V3)
#define VP_MULTIVERSION __attribute__((target("arch=x86-64-v3")))
#define VP_PINNED_ISA "x86-64-v3"
#elif defined(VP_PIN_X86_64_V4)
#define VP_MULTIVERSION __attribute__((target("arch=x86-64-v4")))
#define VP_PINNED_ISA "x86-64-v4"
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VP_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VP_MULTIVERSION
#endif

// exp(x) for x <= 0 (inputs below -87 give exp(-87) ~ 1.6e-38 instead of a denormal or 0).
// x = n ln2 + r with |r| <= ln2 / 2 (two-part ln2), exp(r) by its degree-7 Taylor polynomial
// (truncation < 5e-9 relative), 2^n built in the exponent bits. About 1 ulp.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// log(1 + s) for s in [0, 1]: with t = s / (2 + s) in [0, 1/3], log(1 + s) = 2 atanh(t)
// = 2 t (1 + t^2/3 + t^4/5 + ...); eight terms leave < 2e-9 relative. No rounding of 1 + s.
inline float log1p_unit(float s) {
  const float t = s / (2.0f + s);
  const float t2 = t * t;
  float p = 1.0f / 15.0f;
  p = p * t2 + 1.0f / 13.0f;
  p = p * t2 + 1.0f / 11.0f;
  p = p * t2 + 1.0f / 9.0f;
  p = p * t2 + 1.0f / 7.0f;
  p = p * t2 + 1.0f / 5.0f;
  p = p * t2 + 1.0f / 3.0f;
  p = p * t2 + 1.0f;
  return 2.0f * t * p;
}

// softplus(x) = max(x, 0) + log(1 + exp(-|x|)): overflow-free for every finite x.
inline float softplus(float x) {
  return std::max(x, 0.0f) + log1p_unit(exp_nonpositive(-std::abs(x)));
}

// One token's width-2d features: out[c] = softplus(x[c]) cos_row[c], out[d + c] = softplus(x[c]) sin_row[c].
VP_MULTIVERSION
void feature_row(const float* __restrict x, const float* __restrict cos_row, const float* __restrict sin_row,
                 float* __restrict out, int64_t d) {
  for (int64_t c = 0; c < d; ++c) {
    const float m = softplus(x[c]);
    out[c] = m * cos_row[c];
    out[d + c] = m * sin_row[c];
  }
}

constexpr int64_t kLanes = 16;  // partial maxima / sums kept per row so the reductions vectorise

// In-place softmax of one row of n logits.
VP_MULTIVERSION
void softmax_row(float* __restrict row, int64_t n) {
  float lane_max[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) lane_max[j] = -3.4e38f;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lane_max[j] = std::max(lane_max[j], row[i + j]);
  float row_max = -3.4e38f;
  for (int64_t j = 0; j < kLanes; ++j) row_max = std::max(row_max, lane_max[j]);
  for (; i < n; ++i) row_max = std::max(row_max, row[i]);

  float lane_sum[kLanes] = {0.0f};
  i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      const float e = exp_nonpositive(row[i + j] - row_max);
      row[i + j] = e;
      lane_sum[j] += e;
    }
  float total = 0.0f;
  for (int64_t j = 0; j < kLanes; ++j) total += lane_sum[j];
  for (; i < n; ++i) {
    const float e = exp_nonpositive(row[i] - row_max);
    row[i] = e;
    total += e;
  }
  const float inv = 1.0f / total;
  for (i = 0; i < n; ++i) row[i] *= inv;
}

// (B, h_t, N, 2, d) view of a phase table given as (h_t, N, 2, d) shared by the batch or (B, h_t, N, 2, d).
at::Tensor batched_table(const at::Tensor& table, int64_t B, int64_t H, int64_t N, int64_t d, const char* name) {
  TORCH_CHECK(table.dim() == 4 || table.dim() == 5, "pope_cpu_attention: ", name,
              " must be (1 or H, N, 2, d) or (B, 1 or H, N, 2, d), got shape ", table.sizes());
  at::Tensor t = table.dim() == 4 ? table.unsqueeze(0) : table;
  TORCH_CHECK((t.size(0) == 1 || t.size(0) == B) && (t.size(1) == 1 || t.size(1) == H) && t.size(2) == N &&
                  t.size(3) == 2 && t.size(4) == d,
              "pope_cpu_attention: ", name, " of shape ", table.sizes(), " does not match B=", B, ", H=", H,
              ", N=", N, ", d=", d);
  t = t.expand({B, H, N, 2, d});
  return t.stride(4) == 1 ? t : t.contiguous();
}

at::Tensor pope_cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& q_table, const at::Tensor& k_table, int64_t logits_bytes) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "pope_cpu_attention: CPU tensors expected, got ", q.device(), " / ", k.device(), " / ", v.device());
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  q_table.scalar_type() == at::kFloat && k_table.scalar_type() == at::kFloat,
              "pope_cpu_attention: float32 tensors expected, got q ", q.scalar_type(), ", k ", k.scalar_type(),
              ", v ", v.scalar_type(), ", tables ", q_table.scalar_type(), " / ", k_table.scalar_type());
  TORCH_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && q.sizes() == v.sizes(),
              "pope_cpu_attention: q, k, v must all be (B, H, N, d), got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), d = q.size(3);
  const at::Tensor qs = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor ks = k.stride(3) == 1 ? k : k.contiguous();
  const at::Tensor qt = batched_table(q_table, B, H, N, d, "q_table");
  const at::Tensor kt = batched_table(k_table, B, H, N, d, "k_table");

  // output laid out (B, N, H, d) so the projection's reshape after transpose(1, 2) is free
  at::Tensor out = at::empty({B, N, H, d}, v.options()).transpose(1, 2);
  if (B == 0 || H == 0 || N == 0) return out;
  const int64_t step = std::max<int64_t>(1, std::min<int64_t>(H, logits_bytes / (N * N * 4)));
  at::Tensor q_feat = at::empty({H, N, 2 * d}, q.options());
  at::Tensor k_feat = at::empty({H, N, 2 * d}, q.options());
  at::Tensor logits = at::empty({step, N, N}, q.options());

  const auto build = [&](const at::Tensor& x, const at::Tensor& table, at::Tensor& feat, int64_t b) {
    const float* xp = x.data_ptr<float>();
    const float* tp = table.data_ptr<float>();
    float* fp = feat.data_ptr<float>();
    const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
    const int64_t ts0 = table.stride(0), ts1 = table.stride(1), ts2 = table.stride(2), ts3 = table.stride(3);
    at::parallel_for(0, H * N, 64, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t h = row / N, n = row % N;
        const float* trow = tp + b * ts0 + h * ts1 + n * ts2;
        feature_row(xp + b * xs0 + h * xs1 + n * xs2, trow, trow + ts3, fp + row * 2 * d, d);
      }
    });
  };

  for (int64_t b = 0; b < B; ++b) {
    build(qs, qt, q_feat, b);
    build(ks, kt, k_feat, b);
    for (int64_t h = 0; h < H; h += step) {
      const int64_t n_heads = std::min(step, H - h);
      at::Tensor group_logits = logits.narrow(0, 0, n_heads);
      at::bmm_out(group_logits, q_feat.narrow(0, h, n_heads), k_feat.narrow(0, h, n_heads).transpose(1, 2));
      float* lp = group_logits.data_ptr<float>();
      at::parallel_for(0, n_heads * N, 16, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) softmax_row(lp + row * N, N);
      });
      at::Tensor group_out = out.select(0, b).narrow(0, h, n_heads);
      at::bmm_out(group_out, group_logits, v.select(0, b).narrow(0, h, n_heads));
    }
  }
  return out;
}

}  // namespace

// The clone target_clones picks on this CPU: its resolver tests the same ISA levels, in the same order.
std::string pope_cpu_isa() {
#if defined(VP_PINNED_ISA)
  return VP_PINNED_ISA;
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4";
  if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3";
  return "x86-64";
#else
  return "native";  // one build for the compiler's default target, no clones
#endif
}

TORCH_LIBRARY(vision_priors_cpu, m) {
  m.def("pope_attention(Tensor q, Tensor k, Tensor v, Tensor q_table, Tensor k_table, int logits_bytes) -> Tensor");
  m.def("pope_isa", &pope_cpu_isa);
}

TORCH_LIBRARY_IMPL(vision_priors_cpu, CPU, m) { m.impl("pope_attention", &pope_cpu_attention); }
