// AdamW (against a scalar reference), weight-decay groups, clipping, and the LR schedule.
#include <gtest/gtest.h>

#include <cmath>

#include "mpitrain/amp.h"
#include "mpitrain/libtorch_version.h"
#include "mpitrain/optim.h"

using namespace mpitrain;

TEST(LrSchedule, WarmupThenCosineToMin) {
  OptimConfig c;
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.warmup_steps = 10;
  EXPECT_DOUBLE_EQ(lr_at(c, 110, 0), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(c, 110, 4), 0.5);
  EXPECT_DOUBLE_EQ(lr_at(c, 110, 9), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(c, 110, 10), 1.0);                  // decay starts at the peak
  EXPECT_NEAR(lr_at(c, 110, 10 + 99 / 2.0), 0.55, 0.01);    // halfway: mean of lr and min_lr
  EXPECT_DOUBLE_EQ(lr_at(c, 110, 109), 0.1);                 // last step: min_lr
  for (int s = 10; s < 109; ++s) EXPECT_GE(lr_at(c, 110, s), lr_at(c, 110, s + 1));
  c.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(lr_at(c, 5, 0), 1.0);
}

// Both update paths against the formula in fp64 (rounding ~1e-16 per operation, so 1e-12 after
// five steps is loose for rounding and tight for any wrong term): the foreach kernels and, where
// this libtorch has it for the CPU (2.4 and later), PyTorch's fused kernel.
void expect_adamw_matches_scalar_reference(bool fused) {
  OptimConfig c;
  c.lr = 0.01;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  c.eps = 1e-8;
  c.weight_decay = 0.1;
  torch::Tensor w = torch::tensor({{0.5, -1.0}}, torch::kFloat64).requires_grad_(true);
  torch::Tensor b = torch::tensor({0.25}, torch::kFloat64).requires_grad_(true);
  AdamW opt({{"w", w}, {"b", b}}, c, fused);
  EXPECT_EQ(opt.fused(), fused);
  EXPECT_TRUE(opt.decays(0));
  EXPECT_FALSE(opt.decays(1));  // 1-D: no decay
  double rw = 0.5, rb = 0.25, mw = 0, vw = 0, mb = 0, vb = 0;
  for (int t = 1; t <= 5; ++t) {
    const double gw = 0.3 * t, gb = -0.2;
    w.mutable_grad() = torch::tensor({{gw, gw}}, torch::kFloat64);
    b.mutable_grad() = torch::tensor({gb}, torch::kFloat64);
    opt.step(c.lr);
    auto ref = [&](double& p, double& m, double& v, double g, bool decay) {
      if (decay) p *= 1 - c.lr * c.weight_decay;
      m = c.beta1 * m + (1 - c.beta1) * g;
      v = c.beta2 * v + (1 - c.beta2) * g * g;
      const double mh = m / (1 - std::pow(c.beta1, t)), vh = v / (1 - std::pow(c.beta2, t));
      p -= c.lr * mh / (std::sqrt(vh) + c.eps);
    };
    ref(rw, mw, vw, gw, true);
    ref(rb, mb, vb, gb, false);
    EXPECT_NEAR(w[0][0].item<double>(), rw, 1e-12);
    EXPECT_NEAR(b[0].item<double>(), rb, 1e-12);
  }
  EXPECT_EQ(opt.steps_taken(), 5);
}

TEST(AdamW, MatchesScalarReference) { expect_adamw_matches_scalar_reference(/*fused=*/false); }

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
TEST(AdamW, FusedCpuKernelMatchesScalarReference) {
  ASSERT_TRUE(fused_adamw_available(torch::kCPU)) << libtorch_version();
  expect_adamw_matches_scalar_reference(/*fused=*/true);
}
#else
TEST(AdamW, NoFusedCpuKernelBeforeLibtorch24) {
  EXPECT_FALSE(fused_adamw_available(torch::kCPU)) << libtorch_version();
}
#endif

TEST(ClipGradNorm, ScalesToMaxNormAndReportsTheNormBefore) {
  torch::Tensor a = torch::zeros({2}).requires_grad_(true), b = torch::zeros({1}).requires_grad_(true);
  a.mutable_grad() = torch::tensor({3.0f, 0.0f});
  b.mutable_grad() = torch::tensor({4.0f});
  EXPECT_NEAR(clip_grad_norm({a, b}, 1.0), 5.0, 1e-6);
  EXPECT_NEAR(torch::cat({a.grad(), b.grad()}).norm().item<double>(), 1.0, 1e-5);
  EXPECT_NEAR(clip_grad_norm({a, b}, 0.0), 1.0, 1e-5);  // 0 = off: unchanged
  EXPECT_NEAR(torch::cat({a.grad(), b.grad()}).norm().item<double>(), 1.0, 1e-5);
}

// fp16 loss scaling (the arithmetic is device-independent; test_gpu repeats it on CUDA).
TEST(LossScaler, UnscalesSkipsOverflowsAndGrows) {
  auto p = torch::zeros({4}).requires_grad_(true);
  LossScaler scaler(/*enabled=*/true, /*init_scale=*/1024.0, /*growth_interval=*/2);
  EXPECT_EQ(scaler.scale_loss(torch::tensor(1.5)).item<double>(), 1536.0);
  p.mutable_grad() = torch::full({4}, 512.0f);
  EXPECT_TRUE(scaler.unscale_and_check({p}));
  EXPECT_TRUE(torch::equal(p.grad(), torch::full({4}, 0.5f)));
  scaler.update(true);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 2048.0);  // doubled after 2 good steps
  p.mutable_grad() = torch::tensor({1.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f, 0.0f});
  EXPECT_FALSE(scaler.unscale_and_check({p}));
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 1024.0);  // halved, growth count reset
  EXPECT_EQ(scaler.good_steps(), 0);

  LossScaler off(false);
  p.mutable_grad() = torch::full({4}, std::numeric_limits<float>::infinity());
  EXPECT_TRUE(off.unscale_and_check({p}));  // disabled: nothing checked or touched
  EXPECT_EQ(off.scale(), 1.0);
}

// The multi-tensor AdamW equals the textbook per-parameter update bit for bit on the CPU.
TEST(AdamW, ForeachUpdateEqualsPerParameterLoop) {
  torch::manual_seed(11);
  OptimConfig oc;
  oc.weight_decay = 0.1;
  std::vector<std::pair<std::string, torch::Tensor>> params{
      {"w", torch::randn({16, 8}).requires_grad_(true)}, {"b", torch::randn({8}).requires_grad_(true)}};
  std::vector<torch::Tensor> ref, m, v;
  for (auto& [n, p] : params) {
    ref.push_back(p.detach().clone());
    m.push_back(torch::zeros_like(p));
    v.push_back(torch::zeros_like(p));
  }
  AdamW opt(params, oc);
  for (int t = 1; t <= 4; ++t) {
    const double lr = 1e-2 / t;
    for (size_t i = 0; i < params.size(); ++i) {
      auto g = torch::randn_like(ref[i]);
      params[i].second.mutable_grad() = g.clone();
      if (ref[i].dim() >= 2) ref[i].mul_(1.0 - lr * oc.weight_decay);
      m[i].mul_(oc.beta1).add_(g, 1.0 - oc.beta1);
      v[i].mul_(oc.beta2).addcmul_(g, g, 1.0 - oc.beta2);
      auto denom = (v[i].sqrt() / std::sqrt(1.0 - std::pow(oc.beta2, t))).add_(oc.eps);
      ref[i].addcdiv_(m[i], denom, -lr / (1.0 - std::pow(oc.beta1, t)));
    }
    opt.step(lr);
  }
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i].second.detach(), ref[i])) << i;
}
