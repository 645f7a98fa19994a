// The GPU code path of the fused ops, run on the CPU: src/model/fused_ops.cpp is compiled here with
// MPITRAIN_FUSED_KERNELS (its CUDA branches) and MPITRAIN_FUSED_EMULATION (CPU tensors go to the
// kernels), linked with the rest of the model as mpitrain_model builds it (mpitrain_model_objs:
// model.cpp's calls into the fused ops reach this build of them) and with
// src/model/kernels/fused_kernels.cu compiled for CPU threads (tests/cuda_emu.h). So the dispatch, the buffers handed to the kernels, the partial-sum
// reductions and the in-place loss gradient run as they would on a GPU, and the results are
// compared with the ATen reference (FusedImpl::reference) and with the unfused model. What stays
// unrun without a GPU: streams, device guards, and the nvcc-compiled kernels themselves.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <string>

#include "mpitrain/amp.h"
#include "mpitrain/comm.h"
#include "mpitrain/fused_ops.h"
#include "mpitrain/model.h"
#include "mpitrain/tensor_parallel.h"
#include "mpi_world.h"

using namespace mpitrain;

namespace {

// Both fused paths (the fused ops and the fused loss, in chunks of `rows`: 0 automatic).
RunOptions all_fused(int64_t rows = 0) {
  RunOptions run;
  run.fused_kernels = true, run.fused_loss = true, run.fused_loss_rows = rows;
  return run;
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, double rtol, double atol, const std::string& what) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!got.defined()) return;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  auto g = got.to(torch::kFloat32), w = want.to(torch::kFloat32);
  EXPECT_TRUE(torch::allclose(g, w, rtol, atol)) << what << ": max |diff| " << (g - w).abs().max().item<double>();
}

// ---- derived tolerances ------------------------------------------------------------------------
// A result evaluated in floating point with unit roundoff u differs from the exact one by at most
// about k u M, where M is the same formula evaluated on the absolute values of every input and
// intermediate and k the number of rounded operations on its longest path (a sum of n terms
// counts n) -- the standard forward error bound. Two implementations of one formula (kernel,
// ATen reference, libtorch's autograd of the plain formula) then differ by at most 2 k u M, plus,
// where both round the result to a 16-bit dtype, one step of that dtype (2 u_T |value|: nearly
// equal values may round to neighbours). The tests compute M in double from the inputs.

constexpr double kU32 = 5.9604644775390625e-08;  // 2^-24, fp32's unit roundoff

double unit_roundoff(c10::ScalarType t) {
  return t == torch::kFloat32 ? kU32 : t == torch::kBFloat16 ? 1.0 / 256 : 1.0 / 2048;  // 2^-24, 2^-8, 2^-11
}
// fp16's subnormal range (below 2^-14) rounds absolutely, by up to 2^-25.
double underflow_floor(c10::ScalarType t) { return t == torch::kFloat16 ? std::ldexp(1.0, -25) : 1e-30; }

// |got - want| <= bound element by element; prints the largest ratio |got - want| / bound.
void expect_within(const torch::Tensor& got, const torch::Tensor& want, const torch::Tensor& bound,
                   const std::string& what) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!got.defined()) return;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const auto diff = (got.to(torch::kFloat64) - want.to(torch::kFloat64)).abs();
  const auto b = bound.to(torch::kFloat64).expand_as(diff);
  const double ratio = (diff / b).max().item<double>();
  std::cout << what << ": max |diff| " << diff.max().item<double>() << ", max |diff| / bound " << ratio << "\n";
  EXPECT_TRUE((diff <= b).all().item<bool>()) << what << ": max |diff| / bound " << ratio;
}

void expect_equal(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!got.defined()) return;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(torch::equal(got, want))
      << what << ": max |diff| " << (got.to(torch::kFloat64) - want.to(torch::kFloat64)).abs().max().item<double>();
}

torch::Tensor d64(const torch::Tensor& t) { return t.detach().to(torch::kFloat64); }

}  // namespace

TEST(FusedEmu, TheKernelPathIsTaken) {
  EXPECT_TRUE(fused_kernels_built());
  EXPECT_TRUE(fused_kernel_device(torch::zeros({2})));
}

TEST(FusedEmu, AddLayerNormThroughTheKernelsMatchesTheReference) {
  torch::manual_seed(21);
  for (auto delta_t : {torch::kFloat32, torch::kBFloat16}) {
    for (auto out_t : {torch::kFloat32, torch::kBFloat16}) {
      for (bool with_delta : {true, false}) {
        for (bool residual_used : {true, false}) {
          auto x0 = torch::randn({3, 5, 40}) * 2 + 1, d0 = torch::randn({3, 5, 40}).to(delta_t);
          auto w0 = torch::randn({40}), b0 = torch::randn({40});
          auto g_res = torch::randn({3, 5, 40}), g_norm = torch::randn({3, 5, 40});
          std::vector<torch::Tensor> res[2];
          for (int k = 0; k < 2; ++k) {
            auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true),
                 b = b0.clone().requires_grad_(true);
            auto d = with_delta ? d0.clone().requires_grad_(true) : torch::Tensor();
            auto [r, n] = add_layernorm(x, d, w, b, 1e-5, out_t, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
            auto loss = (n.to(torch::kFloat32) * g_norm).sum();
            if (residual_used) loss = loss + (r * g_res).sum();
            loss.backward();
            res[k] = {r.detach(), n.detach(), x.grad(), with_delta ? d.grad() : torch::Tensor(), w.grad(), b.grad()};
          }
          const std::string where = std::string(c10::toString(delta_t)) + " -> " + c10::toString(out_t) +
                                    (with_delta ? "" : " no delta") + (residual_used ? " residual used" : "");
          const char* names[] = {"residual", "normed", "d_x", "d_delta", "d_weight", "d_bias"};
          for (size_t i = 0; i < 6; ++i) {
            const bool low = (i == 1 && out_t != torch::kFloat32) || (i == 3 && delta_t != torch::kFloat32);
            expect_close(res[0][i], res[1][i], low ? 2e-2 : 1e-4, low ? 2e-2 : 1e-4, where + ": " + names[i]);
          }
        }
      }
    }
  }
}

TEST(FusedEmu, BiasGeluThroughTheKernelsMatchesTheReference) {
  torch::manual_seed(22);
  for (auto t : {torch::kFloat32, torch::kBFloat16}) {
    for (int64_t cols : {64, 36}) {  // 16-byte packs; the scalar path for bf16
      auto pre0 = (torch::randn({2, 7, cols}) * 2).to(t), bias0 = torch::randn({cols}), g = torch::randn({2, 7, cols});
      std::vector<torch::Tensor> res[2];
      for (int k = 0; k < 2; ++k) {
        auto pre = pre0.clone().requires_grad_(true), bias = bias0.clone().requires_grad_(true);
        auto y = bias_gelu(pre, bias, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
        (y.to(torch::kFloat32) * g).sum().backward();
        res[k] = {y.detach(), pre.grad(), bias.grad()};
      }
      const double tol = t == torch::kFloat32 ? 1e-4 : 2e-2;
      const std::string where = std::string(c10::toString(t)) + " cols " + std::to_string(cols);
      expect_close(res[0][0], res[1][0], tol, tol, where + ": out");
      expect_close(res[0][1], res[1][1], tol, tol, where + ": d_pre");
      expect_close(res[0][2], res[1][2], 1e-3, tol, where + ": d_bias");
    }
  }
}

// add_rmsnorm three ways: the emulated kernels, the ATen reference, and libtorch's autograd of the
// plain formula (NormImpl's, Hugging Face's LlamaRMSNorm) on x + delta. eps = 1e-2, not 1e-5: with
// unit-variance rows a misplaced or missing eps then moves the output by ~0.5%, far beyond the
// bounds below, instead of by 5e-6 (within them).
// Bounds (see "derived tolerances"; n = 40 columns, 15 rows; r the residual, xhat = r rstd, g =
// d_normed * weight, m2 = mean(g xhat)):
//   residual  x + delta in fp32, one identical rounding everywhere: equal.
//   normed    k = n + 6 (sum of squares, mean, + eps, rsqrt as 1/sqrt, * rstd, * weight),
//             M = |xhat w|; plus a 16-bit output's rounding step.
//   d_x       k = 2n + 12 (rstd, xhat, g xhat, the mean m2 over n, xhat m2, -, * rstd, + d_res),
//             M = |d_res| + rstd (|g| + |xhat| mean(|g xhat|)); d_delta in bf16: plus its rounding.
//   d_weight  k = rows + n + 8 (xhat, then the sum over rows), M = sum over rows of |d_normed xhat|.
TEST(FusedEmu, AddRmsNormThroughTheKernelsMatchesTheReferenceAndAutograd) {
  torch::manual_seed(26);
  const double eps = 1e-2;
  const int64_t n = 40, rows = 15;
  for (auto delta_t : {torch::kFloat32, torch::kBFloat16}) {
    for (auto out_t : {torch::kFloat32, torch::kBFloat16}) {
      for (bool with_delta : {true, false}) {
        for (bool residual_used : {true, false}) {
          auto x0 = torch::randn({3, 5, n}) * 2 + 1, d0 = torch::randn({3, 5, n}).to(delta_t);
          auto w0 = torch::randn({n});
          auto g_res = torch::randn({3, 5, n}), g_norm = torch::randn({3, 5, n});
          std::vector<torch::Tensor> res[3];
          for (int k = 0; k < 3; ++k) {  // kernel, reference, autograd of the plain formula
            auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
            auto d = with_delta ? d0.clone().requires_grad_(true) : torch::Tensor();
            torch::Tensor r, nrm;
            if (k < 2) {
              std::tie(r, nrm) = add_rmsnorm(x, d, w, eps, out_t, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
            } else {
              r = with_delta ? x + d.to(torch::kFloat32) : x;
              nrm = (r * torch::rsqrt(r.pow(2).mean(-1, /*keepdim=*/true) + eps) * w).to(out_t);
            }
            auto loss = (nrm.to(torch::kFloat32) * g_norm).sum();
            if (residual_used) loss = loss + (r * g_res).sum();
            loss.backward();
            res[k] = {r.detach(), nrm.detach(), x.grad(), with_delta ? d.grad() : torch::Tensor(), w.grad()};
          }
          // The magnitudes M, in double from the inputs.
          const auto r = d64(res[2][0]);
          const auto rstd = (r * r).mean(-1, true).add(eps).rsqrt();
          const auto xhat = (r * rstd).abs(), dn = d64(g_norm.to(out_t)), g = (dn * d64(w0)).abs();
          const auto m_normed = xhat * d64(w0).abs();
          const auto m_dx = (residual_used ? d64(g_res).abs() : torch::zeros_like(r)) +
                            rstd * (g + xhat * (g * xhat).mean(-1, true));
          const auto m_dw = (dn.abs() * xhat).reshape({rows, n}).sum(0);
          const double u_out = unit_roundoff(out_t), u_delta = unit_roundoff(delta_t);
          const auto b_normed = 2 * (n + 6) * kU32 * m_normed +
                                (out_t == torch::kFloat32 ? 0.0 : 2.1 * u_out) * m_normed + 1e-30;
          const auto b_dx = 2 * (2 * n + 12) * kU32 * m_dx + 1e-30;
          const auto b_dd = b_dx * (1 + u_delta) + (delta_t == torch::kFloat32 ? 0.0 : 2.1 * u_delta) * m_dx;
          const auto b_dw = 2 * (rows + n + 8) * kU32 * m_dw + 1e-30;
          const std::string where = std::string("add_rmsnorm ") + c10::toString(delta_t) + " -> " +
                                    c10::toString(out_t) + (with_delta ? "" : " no delta") +
                                    (residual_used ? " residual used" : "");
          for (int k : {1, 2}) {
            const std::string w = where + (k == 1 ? " kernel vs reference" : " kernel vs autograd");
            expect_equal(res[0][0], res[k][0], w + ": residual");
            expect_within(res[0][1], res[k][1], b_normed, w + ": normed");
            expect_within(res[0][2], res[k][2], b_dx, w + ": d_x");
            if (with_delta) expect_within(res[0][3], res[k][3], b_dd, w + ": d_delta");
            expect_within(res[0][4], res[k][4], b_dw, w + ": d_weight");
          }
          expect_within(res[1][1], res[2][1], b_normed, where + " reference vs autograd: normed");
          expect_within(res[1][2], res[2][2], b_dx, where + " reference vs autograd: d_x");
          expect_within(res[1][4], res[2][4], b_dw, where + " reference vs autograd: d_weight");
        }
      }
    }
  }
}

// swiglu three ways, in fp32, bf16 and fp16. The plain formula's autograd runs in fp32 on the
// 16-bit inputs' values (libtorch's bf16 silu and product would round twice), with the upstream
// gradient the 16-bit one the fused op receives. Bounds (tests/test_kernels_emu.cpp derives the
// same: k = 12, M the formula on absolute values, s = sigmoid(gate)):
//   out = gate s up: M = |gate s up|;  d_up = d gate s: M = |d gate s|;
//   d_gate = d up s (1 + gate (1 - s)): M = |d up| s (1 + |gate| (1 + s));
// kernel or reference vs fp32 autograd: k u32 M on both sides plus the 16-bit result's rounding
// (1.01 u_T |value|); kernel vs reference: both roundings (2.1 u_T).
TEST(FusedEmu, SwigluThroughTheKernelsMatchesTheReferenceAndAutograd) {
  torch::manual_seed(27);
  const double k_ops = 12;
  for (auto t : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    for (int64_t cols : {64, 35}) {  // 16-byte packs; 2 x 7 x 35 = 490 elements: the scalar path
      auto gate0 = (torch::randn({2, 7, cols}) * 3).to(t), up0 = torch::randn({2, 7, cols}).to(t);
      auto g = torch::randn({2, 7, cols});
      std::vector<torch::Tensor> res[3];
      for (int k = 0; k < 3; ++k) {
        const auto ct = k < 2 ? t : torch::kFloat32;
        // Copies: .to() of a tensor already in ct would return it, sharing one .grad() across runs.
        auto gate = gate0.to(ct).clone().requires_grad_(true), up = up0.to(ct).clone().requires_grad_(true);
        auto y = k < 2 ? swiglu(gate, up, k == 0 ? FusedImpl::automatic : FusedImpl::reference)
                       : torch::silu(gate) * up;
        (y.to(torch::kFloat32) * (k < 2 ? g : g.to(t).to(torch::kFloat32))).sum().backward();
        res[k] = {y.detach(), gate.grad(), up.grad()};
      }
      const auto gd = d64(gate0), ud = d64(up0), dd = d64(g.to(t)), sg = torch::sigmoid(gd);
      const torch::Tensor m[3] = {(gd * sg * ud).abs(), (dd * ud).abs() * sg * (1 + gd.abs() * (1 + sg)),
                                  (dd * gd * sg).abs()};
      const char* names[3] = {"out", "d_gate", "d_up"};
      const double u = t == torch::kFloat32 ? 0.0 : unit_roundoff(t);
      const std::string where = std::string("swiglu ") + c10::toString(t) + " cols " + std::to_string(cols);
      for (int i = 0; i < 3; ++i) {
        const auto vs_plain = k_ops * kU32 * m[i] * 2 + 1.01 * u * m[i] + underflow_floor(t);
        const auto vs_each = 2 * k_ops * kU32 * m[i] + 2.1 * u * m[i] + 2 * underflow_floor(t);
        expect_within(res[0][i], res[1][i], vs_each, where + " kernel vs reference: " + names[i]);
        for (int k : {0, 1})
          expect_within(res[k][i].to(torch::kFloat32), res[2][i], vs_plain,
                        where + (k == 0 ? " kernel" : " reference") + " vs fp32 autograd: " + names[i]);
      }
    }
  }
}

// rotary three ways, forward and gradient: the kernel rounds as the ATen ops do (fused_kernels.h)
// and the reference is those ops with the backward pass autograd derives for them, so all three
// are equal bit for bit -- the unfused model (Rotary::apply) and the fused one see the same q and
// k. Tables with more rows than the sequence; x contiguous, and a strided view (the kernel path
// copies it).
TEST(FusedEmu, RotaryThroughTheKernelsEqualsTheReferenceAndAutograd) {
  torch::manual_seed(28);
  const int64_t B = 2, T = 7, H = 3, table_rows = 10;
  for (auto t : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    for (int64_t D : {16, 12}) {
      for (bool strided : {false, true}) {
        auto inv_freq = torch::rand({D / 2}) * 0.9 + 0.05;
        auto freqs = torch::arange(table_rows, torch::kFloat32).unsqueeze(1) * inv_freq.unsqueeze(0);
        auto emb = torch::cat({freqs, freqs}, -1);
        auto cos = emb.cos(), sin = emb.sin();
        auto x0 = (torch::randn({B, T, 2 * H, D}) * 2).to(t);
        auto g = torch::randn({B, T, H, D});
        std::vector<torch::Tensor> res[3];
        for (int k = 0; k < 3; ++k) {
          auto leaf = x0.clone().requires_grad_(true);
          auto x = strided ? leaf.narrow(2, H, H) : leaf.narrow(2, 0, H).contiguous();
          torch::Tensor y;
          if (k < 2) {
            y = rotary(x, cos, sin, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
          } else {  // the unfused ops as the attention applied them: [B, H, T, D], tables [T, D] in x's dtype
            auto xt = x.transpose(1, 2);
            auto c = cos.narrow(0, 0, T).to(t), s = sin.narrow(0, 0, T).to(t);
            auto rotated = torch::cat({-xt.narrow(-1, D / 2, D / 2), xt.narrow(-1, 0, D / 2)}, -1);
            y = (xt * c + rotated * s).transpose(1, 2);
          }
          (y.to(torch::kFloat32) * g).sum().backward();
          res[k] = {y.detach().contiguous(), leaf.grad()};
        }
        const std::string where = std::string("rotary ") + c10::toString(t) + " head_dim " + std::to_string(D) +
                                  (strided ? " strided" : "");
        for (int k : {1, 2}) {
          const std::string w = where + (k == 1 ? " kernel vs reference" : " kernel vs autograd");
          expect_equal(res[0][0], res[k][0], w + ": out");
          expect_equal(res[0][1], res[k][1], w + ": d_x");
        }
      }
    }
  }
}

TEST(FusedEmu, LinearCrossEntropyThroughTheKernelMatchesTheReference) {
  torch::manual_seed(23);
  auto h0 = torch::randn({45, 16}), w0 = torch::randn({72, 16}) * 0.3;
  auto t = torch::randint(0, 72, {45}, torch::kLong);
  std::vector<torch::Tensor> res[2];
  for (int k = 0; k < 2; ++k) {
    auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    auto loss = linear_cross_entropy(h, w, t, 10, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
    (loss * 3.0).backward();
    torch::NoGradGuard no_grad;
    auto eval = linear_cross_entropy(h0, w0, t, 10, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
    res[k] = {loss.detach(), h.grad(), w.grad(), eval};
  }
  expect_close(res[0][0], res[1][0], 1e-5, 1e-5, "loss");
  expect_close(res[0][1], res[1][1], 1e-4, 1e-6, "d_hidden");
  expect_close(res[0][2], res[1][2], 1e-4, 1e-6, "d_weight");
  expect_close(res[0][3], res[1][3], 1e-5, 1e-5, "loss without gradients");
}

TEST(FusedEmu, TheFusedModelMatchesTheUnfusedModel) {
  GPTDims d{/*n_layer=*/2, /*n_head=*/2, /*n_embd=*/32, /*seq_len=*/8, /*vocab_size=*/48};
  torch::manual_seed(24);
  GPT fused(d);
  fused->apply(all_fused());
  torch::manual_seed(24);
  GPT plain(d);
  auto x = torch::randint(0, 48, {2, 8}, torch::kLong), y = torch::randint(0, 48, {2, 8}, torch::kLong);
  auto lf = fused->loss(x, y), lp = plain->loss(x, y);
  EXPECT_NEAR(lf.item<double>(), lp.item<double>(), 1e-5);
  lf.backward();
  lp.backward();
  auto pf = fused->named_params(), pp = plain->named_params();
  for (size_t i = 0; i < pf.size(); ++i)
    expect_close(pf[i].second.grad(), pp[i].second.grad(), 1e-3, 1e-5, pf[i].first);
  // bf16 autocast on the CPU: the kernels take bf16 activations, as on a GPU.
  Autocast ac(Precision::bf16, torch::Device(torch::kCPU));
  EXPECT_NEAR(fused->loss(x, y).item<double>(), plain->loss(x, y).item<double>(), 3e-2);
}

// ---- the whole Llama, fused vs unfused ------------------------------------------------------------

namespace {

// llama-debug's parts at a test's size: GQA (4 query heads, 2 kv heads), qkv biases, an untied
// lm_head, and rope_scaling llama3 with wavelengths on both sides of its band (original_max 64,
// factors 1..4: head_dim 8's wavelengths 6.3, 63, 628, 6283 are kept, smoothed, scaled, scaled).
GPTDims llama_test_dims() {
  GPTDims d{/*n_layer=*/2, /*n_head=*/4, /*n_embd=*/32, /*seq_len=*/8, /*vocab_size=*/48};
  d.arch = "llama";
  d.n_kv_head = 2;
  d.intermediate_size = 64;
  d.max_position = 8;
  d.rope_theta = 10000;
  d.rope_scaling = "llama3";
  d.rope_factor = 8, d.rope_low_freq_factor = 1, d.rope_high_freq_factor = 4, d.rope_original_max_position = 64;
  d.qkv_bias = true;
  d.tie_embeddings = false;
  return d;
}

// Initial values moved off GPT-2's (norm weights 1, biases 0) so that every parameter takes part:
// + N(0, 0.05) each, from a fixed seed.
void perturb(GPT& m) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(31);
  for (auto& [name, p] : m->named_params()) p.add_(torch::randn_like(p) * 0.05);
}

// First-order budgets for a whole model (the per-op tests above bound each fused op against its
// unfused twin; here the differences of n_ops = 5 per layer (2 norms, 2 rotary, SwiGLU) x 2 layers
// + ln_f + the loss = 12 ops add up: the norms renormalise, and the linear layers are contractions
// at this initialisation (N(0, 0.02 + 0.05): spectral norm ~0.054 (sqrt(in) + sqrt(out)) < 1), so
// no difference grows on its way through).
//  fp32: each op within (L + 12) u32 of its magnitude, L = 64 the longest reduction (the
//    MLP width; vocabulary 48, width 32): B32 = 12 (64 + 12) u32 = 5.4e-5 relative; both sides
//    err, so 2 B32; the loss against |loss| + 1 (the log-sum-exp's terms are O(1)); each gradient
//    normwise against its largest element, times sqrt(B T) = 4 for the cancellation in its sum
//    over the batch's 16 tokens (the magnitudes M are up to that much larger than the result).
//  bf16 autocast: what differs is each op's result rounding (SwiGLU rounds once instead of twice;
//    the norms round nearly equal fp32 values, which may land on neighbours): 2 u_bf16 per op,
//    B16 = 12 x 2 x 2^-8 = 0.094 relative to the results themselves (loss, normwise gradients).
//    Loose: the fp32 comparison is the tight one; this one catches a path that breaks in 16 bits.
constexpr double kModelOps = 12, kLongestReduction = 64, kTokens = 16;
constexpr double kB32 = kModelOps * (kLongestReduction + 12) * kU32;
constexpr double kB16 = kModelOps * 2 / 256.0;

void expect_grads_close(GPT& a, GPT& b, double rel, const std::string& what, Communicator* tp = nullptr) {
  auto pa = a->named_params(), pb = b->named_params();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pa[i].second.grad().defined() && pb[i].second.grad().defined()) << pa[i].first;
    auto want = pb[i].second.grad();
    if (tp) want = tp_shard(want, b->tp_split(pb[i].first), tp->rank(), tp->size()).contiguous();
    const double scale = want.abs().max().item<double>();
    expect_within(pa[i].second.grad(), want, torch::full({}, rel * scale + 1e-30, torch::kFloat64),
                  what + ": " + pa[i].first);
  }
}

}  // namespace

TEST(FusedEmu, TheFusedLlamaMatchesTheUnfusedLlama) {
  // Llama-shaped (llama_test_dims), then Qwen3-shaped: heads of 16 at width 32 and q/k norms.
  for (bool qwen3 : {false, true}) {
    SCOPED_TRACE(qwen3 ? "qwen3" : "llama");
    GPTDims d = llama_test_dims();
    if (qwen3) d.qkv_bias = false, d.head_size = 16, d.qk_norm = true;  // q/k norms unfused, then the fused rotary
    const std::string name = qwen3 ? "qwen3" : "llama";
    torch::manual_seed(29);
    GPT plain(d);
    perturb(plain);
    GPT fused(d);
    fused->apply(all_fused());
    {
      torch::NoGradGuard no_grad;
      auto pf = fused->named_params(), pp = plain->named_params();
      ASSERT_EQ(pf.size(), pp.size());
      for (size_t i = 0; i < pf.size(); ++i) pf[i].second.copy_(pp[i].second);
    }
    auto x = torch::randint(0, 48, {2, 8}, torch::kLong), y = torch::randint(0, 48, {2, 8}, torch::kLong);
    auto lf = fused->loss(x, y), lp = plain->loss(x, y);
    const double loss_tol = 2 * kB32 * (std::fabs(lp.item<double>()) + 1);
    std::cout << name << " fp32 loss: fused " << lf.item<double>() << ", unfused " << lp.item<double>()
              << ", |diff| / bound " << std::fabs(lf.item<double>() - lp.item<double>()) / loss_tol << "\n";
    EXPECT_NEAR(lf.item<double>(), lp.item<double>(), loss_tol);
    lf.backward();
    lp.backward();
    expect_grads_close(fused, plain, 2 * kB32 * std::sqrt(kTokens), name + " fp32");

    // bf16 autocast on the CPU: the kernels take bf16 activations, as on a GPU.
    fused->zero_grad();
    plain->zero_grad();
    {
      Autocast ac(Precision::bf16, torch::Device(torch::kCPU));
      lf = fused->loss(x, y), lp = plain->loss(x, y);
    }
    const double loss_tol16 = kB16 * (std::fabs(lp.item<double>()) + 1);
    std::cout << name << " bf16 loss: fused " << lf.item<double>() << ", unfused " << lp.item<double>()
              << ", |diff| / bound " << std::fabs(lf.item<double>() - lp.item<double>()) / loss_tol16 << "\n";
    EXPECT_NEAR(lf.item<double>(), lp.item<double>(), loss_tol16);
    lf.backward();
    lp.backward();
    expect_grads_close(fused, plain, kB16, name + " bf16");
  }
}

// Tensor parallel on the kernel path (CTest test_fused_emu_tp_np2: mpirun -np 2; the singleton
// run filters it out): a tp 2 model whose block ops go through the emulated CUDA kernels and whose
// loss is the vocabulary-parallel fused chunked one matches the unfused dense model in its loss and
// in every gradient's shard, as the fused dense model does above.
TEST(FusedEmuTensorParallel, TheFusedTpModelMatchesTheUnfusedDenseModel) {
  ASSERT_EQ(world_size(), 2) << "runs under mpirun -np 2";
  auto tp = make_mpi_communicator(mpi::world());
  GPTDims d{/*n_layer=*/2, /*n_head=*/2, /*n_embd=*/32, /*seq_len=*/8, /*vocab_size=*/48};
  torch::manual_seed(24);
  GPT plain(d);
  torch::manual_seed(24);
  GPT fused(d);
  fused->parallelize(TpPlace{2, tp->rank(), tp.get()});
  fused->apply(all_fused(5));
  torch::manual_seed(25);  // the same batch on both ranks
  auto x = torch::randint(0, 48, {2, 8}, torch::kLong), y = torch::randint(0, 48, {2, 8}, torch::kLong);
  auto lf = fused->loss(x, y), lp = plain->loss(x, y);
  EXPECT_NEAR(lf.item<double>(), lp.item<double>(), 1e-5);
  lf.backward();
  lp.backward();
  auto pf = fused->named_params(), pp = plain->named_params();
  ASSERT_EQ(pf.size(), pp.size());
  for (size_t i = 0; i < pf.size(); ++i)
    expect_close(pf[i].second.grad(), tp_shard(pp[i].second.grad(), plain->tp_split(pp[i].first), tp->rank(), 2).contiguous(),
                 1e-3, 1e-5, pf[i].first);
}

// The same for Llama (GQA: each rank 2 query heads and 1 kv head; SwiGLU's 64 units split 32 +
// 32; the untied lm_head vocabulary-parallel), within the fp32 budget of
// TheFusedLlamaMatchesTheUnfusedLlama.
TEST(FusedEmuTensorParallel, TheFusedTpLlamaMatchesTheUnfusedDenseLlama) {
  ASSERT_EQ(world_size(), 2) << "runs under mpirun -np 2";
  auto tp = make_mpi_communicator(mpi::world());
  GPTDims d = llama_test_dims();
  torch::manual_seed(29);
  GPT plain(d);
  perturb(plain);
  GPT fused(d);
  fused->parallelize(TpPlace{2, tp->rank(), tp.get()});
  fused->apply(all_fused(5));
  {
    torch::NoGradGuard no_grad;
    auto pf = fused->named_params(), pp = plain->named_params();
    ASSERT_EQ(pf.size(), pp.size());
    for (size_t i = 0; i < pf.size(); ++i)
      pf[i].second.copy_(tp_shard(pp[i].second, plain->tp_split(pp[i].first), tp->rank(), 2));
  }
  torch::manual_seed(25);  // the same batch on both ranks
  auto x = torch::randint(0, 48, {2, 8}, torch::kLong), y = torch::randint(0, 48, {2, 8}, torch::kLong);
  auto lf = fused->loss(x, y), lp = plain->loss(x, y);
  EXPECT_NEAR(lf.item<double>(), lp.item<double>(), 2 * kB32 * (std::fabs(lp.item<double>()) + 1));
  lf.backward();
  lp.backward();
  expect_grads_close(fused, plain, 2 * kB32 * std::sqrt(kTokens), "llama tp 2", tp.get());
}

// Gradient clipping's fp64 sum of squares through the kernel (one pass over fp32 tensors of many
// sizes, an empty one among them) against the reference's per-tensor fp64 norms; both are the
// exact sum to a few fp64 roundings. A non-contiguous tensor in the list sends all to the reference.
TEST(FusedEmu, SumOfSquaresThroughTheKernelMatchesTheReference) {
  torch::manual_seed(11);
  std::vector<torch::Tensor> ts;
  for (int64_t n : {1, 700, 0, 65536, 3 * 65536 + 5, 33})
    ts.push_back(torch::randn({n}) * 2.5);
  ts.push_back(torch::randn({64, 48}));
  const torch::Tensor kernel = sum_of_squares(ts, torch::kCPU, FusedImpl::automatic);
  const torch::Tensor reference = sum_of_squares(ts, torch::kCPU, FusedImpl::reference);
  ASSERT_EQ(kernel.scalar_type(), torch::kFloat64);
  ASSERT_EQ(kernel.sizes(), torch::IntArrayRef({1}));
  double exact = 0;
  for (const auto& t : ts) exact += t.to(torch::kFloat64).square().sum().item<double>();
  EXPECT_NEAR(kernel.item<double>(), exact, 1e-12 * exact);
  EXPECT_NEAR(reference.item<double>(), exact, 1e-12 * exact);
  ts.push_back(torch::randn({8, 8}).t());  // not contiguous: the reference for the whole list
  exact += ts.back().to(torch::kFloat64).square().sum().item<double>();
  EXPECT_NEAR(sum_of_squares(ts, torch::kCPU).item<double>(), exact, 1e-12 * exact);
  EXPECT_EQ(sum_of_squares({}, torch::kCPU).item<double>(), 0.0);
}
