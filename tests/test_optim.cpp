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

// Stochastic rounding to bf16 (optim.state_dtype: bf16). A value between two bf16 neighbours goes
// to one of them, up (in magnitude) with probability equal to the fraction of the step it lies
// above the lower, so over n copies of 1 + 0.3 ulp the fraction rounded up is 0.3 within 6 standard
// deviations of a binomial, sqrt(0.3 x 0.7 / n); the bits are integer arithmetic, the same on
// every kernel path. They depend on (seed, key, begin + index) only: deterministic, other for
// another seed or key, and a cut of the tensor passed with its offset rounds as the whole does,
// whatever the chunks the elements are hashed in. Exact bf16 values, zero and infinities stay.
TEST(AdamW, StochasticBf16RoundingIsUnbiasedDeterministicAndTheSameForACut) {
  const int64_t n = int64_t{1} << 18;
  const float ulp = std::ldexp(1.0f, -7);  // bf16's step in [1, 2): 8 significant bits
  for (float sign : {1.0f, -1.0f}) {
    const float lo = sign, hi = sign * (1.0f + ulp), x = sign * (1.0f + 0.3f * ulp);
    const torch::Tensor xs = torch::full({n}, x);
    const torch::Tensor r = round_bf16_stochastic(xs, 7, 3, 0);
    EXPECT_TRUE(torch::equal(r, round_bf16_stochastic(xs, 7, 3, 0, /*chunk=*/1000)));
    ASSERT_EQ(r.scalar_type(), torch::kBFloat16);
    const torch::Tensor rf = r.to(torch::kFloat32);
    EXPECT_TRUE(rf.eq(lo).logical_or(rf.eq(hi)).all().item<bool>()) << "only the two neighbours";
    const double up = rf.eq(hi).to(torch::kFloat64).mean().item<double>();
    EXPECT_NEAR(up, 0.3, 6 * std::sqrt(0.3 * 0.7 / static_cast<double>(n))) << "sign " << sign;
    EXPECT_TRUE(torch::equal(r, round_bf16_stochastic(xs, 7, 3, 0)));
    EXPECT_FALSE(torch::equal(r, round_bf16_stochastic(xs, 8, 3, 0)));
    EXPECT_FALSE(torch::equal(r, round_bf16_stochastic(xs, 7, 4, 0)));
    const int64_t at = 99500;
    EXPECT_TRUE(torch::equal(round_bf16_stochastic(xs.narrow(0, at, 3000), 7, 3, at, 700), r.narrow(0, at, 3000)));
  }
  torch::Tensor exact = torch::randn({4096}).to(torch::kBFloat16).to(torch::kFloat32);
  exact[0] = 0.0;
  exact[1] = INFINITY;
  exact[2] = -INFINITY;
  EXPECT_TRUE(torch::equal(round_bf16_stochastic(exact, 1, 0, 0).to(torch::kFloat32), exact));
}

// optim.state_dtype: bf16: the moments are bf16 (half AdamW's bytes); each step computes them in
// fp32 from the stored values, updates with those fp32 values and stores them stochastically
// rounded (against a reference written from that description); and ZeRO's slices of the same
// parameters, updated by two sharded AdamWs as two ranks would, make the same run bit for bit
// (the rounding's bits follow the element, not the slice).
TEST(AdamW, Bf16StateFollowsItsReferenceAndShardedEqualsWhole) {
  torch::manual_seed(12);
  OptimConfig oc;
  oc.weight_decay = 0.1;
  oc.state_dtype = "bf16";
  auto make = [] {
    torch::manual_seed(5);
    return std::vector<std::pair<std::string, torch::Tensor>>{{"w", torch::randn({16, 8}).requires_grad_(true)},
                                                              {"b", torch::randn({8}).requires_grad_(true)}};
  };
  auto whole = make(), sliced = make();
  AdamW opt(whole, oc);
  OptimConfig fp32 = oc;
  fp32.state_dtype = "fp32";
  EXPECT_EQ(opt.state_bytes() * 2, AdamW(make(), fp32).state_bytes());
  EXPECT_EQ(opt.exp_avg(0).scalar_type(), torch::kBFloat16);

  // Two "ranks": rank 0 owns w's first 100 elements, rank 1 the other 28 and all of b; each
  // rank's gradient shard is one bucket holding its slices' gradients in order.
  std::vector<GradShards> shards(2);
  shards[0].slices = {{0, 0, 100, 0, 0}};
  shards[0].grads = {torch::zeros({100})};
  shards[1].slices = {{0, 100, 28, 0, 0}, {1, 0, 8, 0, 28}};
  shards[1].grads = {torch::zeros({36})};
  std::vector<AdamW> ranks;
  for (const GradShards& s : shards) ranks.emplace_back(sliced, s, oc);

  std::vector<torch::Tensor> ref, m, v;
  for (auto& [n, p] : whole) {
    ref.push_back(p.detach().clone());
    m.push_back(torch::zeros_like(p, torch::kBFloat16));
    v.push_back(torch::zeros_like(p, torch::kBFloat16));
  }
  for (int t = 1; t <= 5; ++t) {
    const double lr = 1e-2 / t;
    std::vector<torch::Tensor> g;
    for (size_t i = 0; i < whole.size(); ++i) {
      g.push_back(torch::randn_like(ref[i]) * (i == 0 ? 1e-3 : 1.0));  // small gradients: rounding matters
      whole[i].second.mutable_grad() = g[i].clone();
      if (ref[i].dim() >= 2) ref[i].mul_(1.0 - lr * oc.weight_decay);
      torch::Tensor mi = m[i].to(torch::kFloat32), vi = v[i].to(torch::kFloat32);
      mi.mul_(oc.beta1).add_(g[i], 1.0 - oc.beta1);
      vi.mul_(oc.beta2).addcmul_(g[i], g[i], 1.0 - oc.beta2);
      auto denom = (vi.sqrt() / std::sqrt(1.0 - std::pow(oc.beta2, t))).add_(oc.eps);
      ref[i].addcdiv_(mi, denom, -lr / (1.0 - std::pow(oc.beta1, t)));
      m[i] = round_bf16_stochastic(mi, 2 * t, static_cast<int64_t>(i), 0);
      v[i] = round_bf16_stochastic(vi, 2 * t + 1, static_cast<int64_t>(i), 0);
    }
    const torch::Tensor gw = g[0].view({-1});
    shards[0].grads[0].copy_(gw.narrow(0, 0, 100));
    shards[1].grads[0].copy_(torch::cat({gw.narrow(0, 100, 28), g[1]}));
    opt.step(lr);
    for (AdamW& r : ranks) r.step(lr);
  }
  for (size_t i = 0; i < whole.size(); ++i) {
    EXPECT_TRUE(torch::equal(whole[i].second.detach(), ref[i])) << whole[i].first;
    EXPECT_TRUE(torch::equal(opt.exp_avg(i), m[i])) << whole[i].first;
    EXPECT_TRUE(torch::equal(opt.exp_avg_sq(i), v[i])) << whole[i].first;
    EXPECT_TRUE(torch::equal(sliced[i].second.detach(), ref[i])) << whole[i].first << ": the sharded run";
  }
  EXPECT_TRUE(torch::equal(ranks[0].exp_avg(0), m[0].view({-1}).narrow(0, 0, 100)));
  EXPECT_TRUE(torch::equal(ranks[1].exp_avg_sq(1), v[1]));
}
