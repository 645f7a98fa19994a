// PowerSGD (comm.compress: powersgd, powersgd.h) under a real mpirun (-np 2 and -np 4):
// orthonormalisation; which tensors are compressed and the bytes a step sends; exactness where
// the ranks' mean gradient has the approximation's rank; the same result on every rank; error
// feedback (constant gradients: the applied gradients' running mean converges to the true mean,
// which one step's rank-1 approximation is far from); zero gradients stay finite.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "mpitrain/comm.h"
#include "mpitrain/powersgd.h"

using namespace mpitrain;

namespace {

std::unique_ptr<Communicator> world() { return make_mpi_communicator(mpi::world()); }

// A tensor drawn from a seed (the same on every rank for the same seed).
torch::Tensor draw(std::vector<int64_t> shape, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randn(shape, torch::kFloat32);
}

// Whether t is the same on every rank (bit for bit).
bool same_everywhere(Communicator& c, const torch::Tensor& t) {
  auto lo = t.clone(), hi = t.clone();
  c.all_reduce(lo, ReduceOp::min);
  c.all_reduce(hi, ReduceOp::max);
  return torch::equal(lo, hi);
}

double rel(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).norm().item<double>() / b.norm().item<double>();
}

}  // namespace

TEST(PowerSgd, OrthonormalizeColumns) {
  auto p = draw({50, 4}, 1);
  orthonormalize_columns(p);
  EXPECT_LT((p.t().matmul(p) - torch::eye(4)).abs().max().item<double>(), 1e-5);
  auto z = torch::zeros({10, 2});
  orthonormalize_columns(z);
  EXPECT_TRUE(torch::isfinite(z).all().item<bool>());
}

// Matrices are compressed when rank x (rows + cols) < rows x cols; vectors and small matrices go as
// they are. Bytes: the factors plus the plain tensors, in fp32.
TEST(PowerSgd, CompressesOnlyWhatGainsAndCountsTheBytes) {
  auto c = world();
  std::vector<torch::Tensor> params{torch::zeros({64, 32}), torch::zeros({32}), torch::zeros({4, 4})};
  PowerSgd psgd(params, *c, 2, 7);
  EXPECT_EQ(psgd.compressed_matrices(), 1u);
  EXPECT_EQ(psgd.bytes_per_step(), 4u * ((64 + 32) * 2 + 32 + 16));
  EXPECT_EQ(psgd.uncompressed_bytes(), 4u * (64 * 32 + 32 + 16));
}

// Every rank's gradient U V_rᵀ with a shared U (64 x 2): the mean has rank 2, so rank-2 PowerSGD
// returns it exactly (up to fp32 rounding: ~1e-6 relative for products of this depth); the plain
// vector is the exact mean; every rank ends with the same gradients.
TEST(PowerSgd, ExactWhereTheMeanHasTheApproximationsRank) {
  auto c = world();
  const int n = c->size(), r = c->rank();
  auto w = torch::zeros({64, 32}, torch::requires_grad()), b = torch::zeros({32}, torch::requires_grad());
  PowerSgd psgd({w, b}, *c, 2, 11);
  const auto u = draw({64, 2}, 100);
  torch::Tensor mean = torch::zeros({64, 32}), bmean = torch::zeros({32});
  for (int k = 0; k < n; ++k) {
    mean += u.matmul(draw({32, 2}, 200 + k).t()) / n;
    bmean += draw({32}, 300 + k) / n;
  }
  w.mutable_grad() = u.matmul(draw({32, 2}, 200 + r).t());
  b.mutable_grad() = draw({32}, 300 + r);
  psgd.reduce_grads();
  EXPECT_LT(rel(w.grad(), mean), 1e-5);
  EXPECT_LT(rel(b.grad(), bmean), 1e-6);
  EXPECT_TRUE(same_everywhere(*c, w.grad()));
  EXPECT_TRUE(same_everywhere(*c, b.grad()));
}

// Error feedback. With constant gradients G_r, each rank's error after T steps is e_r = T G_r - S_T
// (S_T the sum of the applied gradients, the same on every rank), so S_T / T = mean(G) - mean(e)/T:
// the applied gradients average to the true mean as long as the error stays bounded, the gap
// shrinking like 1/T. Rank 1 of a random 48 x 40 mean is far from it in one step (relative error
// > 0.5); from 200 to 800 steps the running mean's gap must shrink by more than half (1/T: to a
// quarter) and end within 5%. Without error feedback it would stay at the one-step error.
TEST(PowerSgd, ErrorFeedbackRecoversTheMeanGradient) {
  auto c = world();
  const int n = c->size(), r = c->rank();
  auto w = torch::zeros({48, 40}, torch::requires_grad());
  PowerSgd psgd({w}, *c, 1, 5);
  torch::Tensor mean = torch::zeros({48, 40});
  for (int k = 0; k < n; ++k) mean += draw({48, 40}, 500 + k) / n;
  const auto mine = draw({48, 40}, 500 + r);
  torch::Tensor sum = torch::zeros({48, 40});
  double first = 0, at200 = 0;
  const int T = 800;
  for (int t = 1; t <= T; ++t) {
    w.mutable_grad() = mine.clone();
    psgd.reduce_grads();
    if (t == 1) first = rel(w.grad(), mean);
    sum += w.grad();
    if (t == 200) at200 = rel(sum / t, mean);
  }
  const double at800 = rel(sum / T, mean);
  if (r == 0) std::printf("error feedback, rank 1 of 48 x 40: one step %.3f, mean of 200 steps %.4f, of 800 %.4f\n", first, at200, at800);
  EXPECT_GT(first, 0.5) << "one rank-1 step should be far from a random mean";
  EXPECT_LT(at800, at200 / 2) << "one step " << first << ", 200 steps " << at200;
  EXPECT_LT(at800, 0.05) << "one step " << first << ", 200 steps " << at200;
  EXPECT_TRUE(same_everywhere(*c, sum));
}

TEST(PowerSgd, ZeroAndMissingGradientsStayFinite) {
  auto c = world();
  auto w = torch::zeros({48, 40}, torch::requires_grad()), v = torch::zeros({48, 40}, torch::requires_grad());
  PowerSgd psgd({w, v}, *c, 2, 3);
  w.mutable_grad() = torch::zeros({48, 40});  // v has no gradient at all
  psgd.reduce_grads();
  EXPECT_TRUE(torch::isfinite(w.grad()).all().item<bool>());
  ASSERT_TRUE(v.grad().defined());
  EXPECT_EQ(v.grad().abs().max().item<double>(), 0.0);
}
