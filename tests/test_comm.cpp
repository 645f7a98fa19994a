// The MPI communicator under a real mpirun (-np 2 and -np 4): all_reduce sum/avg/max,
// broadcast, all_gather, large tensors, asynchronous all-reduce, and the bucketed gradient
// all-reduce with and without overlap with backward; reduce-scatter and ZeRO-1's sharded GradSync.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>

#include "mpitrain/comm.h"
#include "mpitrain/grad_sync.h"
#include "mpitrain/error.h"
#include "mpitrain/layout.h"
#include "mpitrain/mesh.h"
#include "mpitrain/mpi_env.h"
#include "mpitrain/model.h"
#include "zero3_probe.h"

using namespace mpitrain;

namespace {
std::unique_ptr<Communicator> world() { return make_mpi_communicator(mpi::world()); }
}  // namespace

TEST(MpiComm, AllReduceSumAvgMax) {
  auto c = world();
  const int n = c->size(), r = c->rank();
  ASSERT_GE(n, 2) << "run under mpirun -np >= 2";
  auto t = torch::arange(10, torch::kFloat32) + r;
  c->all_reduce(t, ReduceOp::sum);
  EXPECT_TRUE(torch::equal(t, torch::arange(10, torch::kFloat32) * n + n * (n - 1) / 2.0));
  auto a = torch::full({3}, static_cast<double>(r), torch::kFloat64);
  c->all_reduce(a, ReduceOp::avg);
  EXPECT_DOUBLE_EQ(a[0].item<double>(), (n - 1) / 2.0);
  auto m = torch::tensor({static_cast<int64_t>(r)});
  c->all_reduce(m, ReduceOp::max);
  EXPECT_EQ(m.item<int64_t>(), n - 1);
}

// bf16 and fp16: MPI has neither the types nor a sum over them; the communicator brings both.
// Integers below 256 are exact in both, so these sums are exact.
TEST(MpiComm, SixteenBitSumsAndAverages) {
  auto c = world();
  const int n = c->size(), r = c->rank();
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    auto t = (torch::arange(10, torch::kFloat32) + r).to(dtype);
    const uint64_t before = c->reduced_bytes();
    c->all_reduce(t, ReduceOp::sum);
    EXPECT_EQ(c->reduced_bytes() - before, 20u);  // 10 elements of 2 bytes handed to the reduction
    EXPECT_EQ(t.scalar_type(), dtype);
    EXPECT_TRUE(torch::equal(t.to(torch::kFloat32), torch::arange(10, torch::kFloat32) * n + n * (n - 1) / 2.0)) << dtype;
    auto a = torch::full({5}, 2.0 * r, dtype);
    c->all_reduce_async(a, ReduceOp::avg)->wait();
    EXPECT_EQ(a[0].item<float>(), static_cast<float>(n - 1)) << dtype;
    auto m = torch::ones({3}, dtype);
    EXPECT_THROW(c->all_reduce(m, ReduceOp::max), Error);  // no max over 16-bit floats: refused, not wrong
  }
}

TEST(MpiComm, NonContiguousTensorsAreReducedInPlace) {
  auto c = world();
  auto base = torch::ones({4, 4});
  auto col = base.select(1, 2);  // a strided view
  c->all_reduce(col, ReduceOp::sum);
  EXPECT_TRUE(torch::all(base.select(1, 2) == c->size()).item<bool>());
  EXPECT_TRUE(torch::all(base.select(1, 0) == 1).item<bool>());
}

TEST(MpiComm, BroadcastFromEveryRoot) {
  auto c = world();
  for (int root = 0; root < c->size(); ++root) {
    auto t = torch::full({5}, static_cast<float>(c->rank() * 10 + 1));
    c->broadcast(t, root);
    EXPECT_TRUE(torch::all(t == static_cast<float>(root * 10 + 1)).item<bool>());
  }
}

TEST(MpiComm, AllGatherPlacesEachRankInItsSlice) {
  auto c = world();
  auto in = torch::full({2, 3}, static_cast<float>(c->rank()));
  auto out = torch::empty({c->size() * 2, 3});
  c->all_gather(in, out);
  for (int r = 0; r < c->size(); ++r)
    EXPECT_TRUE(torch::all(out.view({c->size(), -1})[r] == static_cast<float>(r)).item<bool>());
  auto wrong = torch::empty({1});
  EXPECT_THROW(c->all_gather(in, wrong), Error);
  c->barrier();
}

TEST(MpiComm, ReduceScatterGivesEachRankItsSliceOfTheSum) {
  auto c = world();
  const int n = c->size(), r = c->rank();
  // Rank q contributes q + i at element i; rank r receives elements [3r, 3r+3) of the sum.
  auto in = torch::arange(3 * n, torch::kFloat32) + r;
  auto out = torch::empty({3});
  c->reduce_scatter(in, out, ReduceOp::sum);
  for (int64_t i = 0; i < 3; ++i)
    EXPECT_EQ(out[i].item<float>(), static_cast<float>(n * (3 * r + i) + n * (n - 1) / 2)) << i;
  auto avg = torch::empty({3}, torch::kFloat64);
  c->reduce_scatter(in.to(torch::kFloat64), avg, ReduceOp::avg);
  EXPECT_DOUBLE_EQ(avg[0].item<double>(), 3 * r + (n - 1) / 2.0);
  // Asynchronous, into a strided destination (staged), two in flight at once.
  auto base = torch::zeros({3, 2});
  auto strided = base.select(1, 1);
  auto big = torch::ones({1000 * n});
  auto big_out = torch::empty({1000});
  auto w1 = c->reduce_scatter_async(in, strided, ReduceOp::sum);
  auto w2 = c->reduce_scatter_async(big, big_out, ReduceOp::avg);
  w2->wait();
  w1->wait();
  EXPECT_TRUE(torch::equal(base.select(1, 1), out));
  EXPECT_TRUE(torch::all(base.select(1, 0) == 0).item<bool>());
  EXPECT_TRUE(torch::all(big_out == 1.0f).item<bool>());
  auto wrong = torch::empty({2});
  EXPECT_THROW(c->reduce_scatter(in, wrong, ReduceOp::sum), Error);
}

// ZeRO-1's gradient path: the shards of a sharded GradSync are the rank's slices of the plain
// average, owned_slices() tile every parameter exactly once across the ranks, and
// all_gather_params() gives every rank every rank's slices.
TEST(GradSync, ShardedSlicesTileTheAverageAndAllGatherRestoresParameters) {
  auto c = world();
  const int n = c->size(), r = c->rank();
  torch::manual_seed(200 + r);
  std::vector<torch::Tensor> params;
  for (int64_t len : {1001, 7, 30000, 50, 12001}) params.push_back(torch::zeros({len}).requires_grad_(true));
  for (auto& p : params) p.mutable_grad() = torch::randn_like(p);
  std::vector<torch::Tensor> expected, bound;
  for (auto& p : params) {
    auto e = p.grad().clone();
    c->all_reduce(e, ReduceOp::avg);
    expected.push_back(e);
    // The reduce-scatter may add the n ranks' values in another order than the all-reduce (MPICH
    // does at 4 ranks; Open MPI happens not to): each order's sum is within (n-1) u sum|g| of the
    // exact one (u = 2^-24), the division by n adds u |avg| to each, so the two averages differ by
    // at most (2 (n-1) + 2) u sum|g| / n <= 2^-23 sum|g| per element.
    auto abs_sum = p.grad().abs();
    c->all_reduce(abs_sum, ReduceOp::sum);
    bound.push_back(abs_sum * std::ldexp(1.0, -23));
  }
  GradSync sync(params, *c, /*bucket_mb=*/0.05, /*overlap=*/false, /*shard=*/true);
  EXPECT_GE(sync.num_buckets(), 2u);
  sync.all_reduce_grads();
  for (auto& p : params) EXPECT_FALSE(p.grad().defined());  // spent
  // Every rank's slices, gathered: each element of each parameter owned exactly once.
  std::vector<torch::Tensor> owners;
  for (auto& p : params) owners.push_back(torch::zeros({p.numel()}, torch::kInt32));
  for (const auto& s : sync.owned_slices()) {
    const auto diff = (sync.grad_shard(s.bucket).narrow(0, s.shard_offset, s.length) -
                       expected[s.param].narrow(0, s.begin, s.length)).abs();
    EXPECT_TRUE(torch::all(diff <= bound[s.param].narrow(0, s.begin, s.length)).item<bool>())
        << "largest difference " << diff.max().item<float>();
    owners[s.param].narrow(0, s.begin, s.length) += 1;
    // The "optimizer": this rank writes its rank number into the elements it owns.
    torch::NoGradGuard no_grad;
    params[s.param].detach().narrow(0, s.begin, s.length).fill_(static_cast<float>(r + 1));
  }
  for (auto& o : owners) c->all_reduce(o, ReduceOp::sum);
  for (size_t k = 0; k < params.size(); ++k) EXPECT_TRUE(torch::all(owners[k] == 1).item<bool>()) << k;
  sync.all_gather_params();
  // Every element now holds its owner's number on every rank; with n ranks, each owns ~1/n.
  int64_t mine = 0, total = 0;
  for (auto& p : params) {
    EXPECT_TRUE(torch::all(p.detach() >= 1).item<bool>() && torch::all(p.detach() <= n).item<bool>());
    mine += (p.detach() == static_cast<float>(r + 1)).sum().item<int64_t>();
    total += p.numel();
  }
  EXPECT_NEAR(static_cast<double>(mine), static_cast<double>(total) / n, static_cast<double>(sync.num_buckets() * n));
}

// comm.grad_dtype: buckets travel in bf16/fp16, half the bytes, and the averages land within the
// rounding the 16-bit path can add. Derivation: each rank's g/n is rounded once (relative u) and
// the n values are summed with n-1 roundings of partial sums no larger than sum|g|/n, so
// |got - average| <= n u sum_r|g_r|/n + n 2^-25 (fp16 subnormals: absolute half-spacing), with
// u = 2^-8 for bf16 and 2^-11 for fp16. Sharded (ZeRO-1) alike.
TEST(GradSync, SixteenBitGradientsHalveTheBytesWithinTheirRounding) {
  auto c = world();
  const int n = c->size(), r = c->rank();
  for (bool shard : {false, true}) {
    for (const auto& wire_u : {std::pair{torch::kBFloat16, std::ldexp(1.0, -8)}, std::pair{torch::kHalf, std::ldexp(1.0, -11)}}) {
      const torch::ScalarType wire = wire_u.first;  // (not structured bindings: the lambda below captures them)
      const double u = wire_u.second;
      torch::manual_seed(300 + r);
      std::vector<torch::Tensor> params;
      for (int64_t len : {1000, 7, 30000, 50}) params.push_back(torch::zeros({len}).requires_grad_(true));
      std::vector<torch::Tensor> grads, expected, abs_mean;
      for (auto& p : params) grads.push_back(torch::randn_like(p));
      for (auto& g : grads) {
        auto e = g.clone(), a = g.abs();
        c->all_reduce(e, ReduceOp::avg);
        c->all_reduce(a, ReduceOp::avg);
        expected.push_back(e);
        abs_mean.push_back(a);
      }
      uint64_t bytes[2];
      for (int k = 0; k < 2; ++k) {  // fp32, then the 16-bit wire, from the same gradients
        for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i].clone();
        GradSync sync(params, *c, /*bucket_mb=*/0.05, /*overlap=*/false, shard, k == 0 ? torch::kFloat32 : wire);
        const uint64_t before = c->reduced_bytes();
        sync.all_reduce_grads();
        bytes[k] = c->reduced_bytes() - before;
        EXPECT_EQ(bytes[k], sync.bytes_per_step());
        if (k == 0) continue;
        auto check = [&](size_t param, int64_t begin, int64_t length, const torch::Tensor& got) {
          auto want = expected[param].narrow(0, begin, length);
          auto bound = abs_mean[param].narrow(0, begin, length) * (n * u) + n * std::ldexp(1.0, -25);
          EXPECT_TRUE(((got - want).abs() <= bound).all().item<bool>())
              << wire << " shard " << shard << " param " << param << ": max |delta| "
              << (got - want).abs().max().item<float>();
        };
        if (shard)
          for (const auto& sl : sync.owned_slices())
            check(sl.param, sl.begin, sl.length, sync.grad_shard(sl.bucket).narrow(0, sl.shard_offset, sl.length));
        else
          for (size_t i = 0; i < params.size(); ++i) check(i, 0, params[i].numel(), params[i].grad());
      }
      EXPECT_EQ(bytes[1] * 2, bytes[0]) << wire << " shard " << shard;  // half the bytes
    }
  }
}

// fp16 cannot hold 4 x 30000: the division by the group size comes before the cast, so averages
// of large gradients do not overflow where the fp32 average is representable.
TEST(GradSync, Fp16GradientsArePreDividedAndDoNotOverflow) {
  auto c = world();
  auto p = torch::zeros({64}).requires_grad_(true);
  p.mutable_grad() = torch::full({64}, 30000.0f);
  GradSync sync({p}, *c, /*bucket_mb=*/1, /*overlap=*/false, /*shard=*/false, torch::kHalf);
  sync.all_reduce_grads();
  EXPECT_TRUE(torch::isfinite(p.grad()).all().item<bool>());
  EXPECT_NEAR(p.grad()[0].item<float>(), 30000.0f, 30000.0f * c->size() * std::ldexp(1.0, -11));
}

TEST(GradSync, BucketedAverageEqualsPerParameterAverage) {
  auto c = world();
  torch::manual_seed(100 + c->rank());  // different gradients per rank
  std::vector<torch::Tensor> params;
  for (int64_t n : {1000, 7, 300000, 50, 120000}) params.push_back(torch::zeros({n}).requires_grad_(true));
  for (auto& p : params) p.mutable_grad() = torch::randn_like(p);
  params[3].mutable_grad() = torch::Tensor();  // a parameter with no gradient this step
  std::vector<torch::Tensor> expected;
  for (auto& p : params) {
    auto e = p.grad().defined() ? p.grad().clone() : torch::zeros_like(p);
    c->all_reduce(e, ReduceOp::avg);
    expected.push_back(e);
  }
  GradSync sync(params, *c, /*bucket_mb=*/0.5, /*overlap=*/false);
  EXPECT_GE(sync.num_buckets(), 2u);   // 0.5 MiB buckets: the 1.2 MB parameter forces splits
  EXPECT_LE(sync.num_buckets(), 5u);
  sync.all_reduce_grads();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(torch::allclose(params[i].grad(), expected[i], 1e-6, 1e-7)) << i;
}

TEST(MpiComm, AsyncAllReducesInFlightTogether) {
  auto c = world();
  const int n = c->size(), r = c->rank();
  auto a = torch::full({1000}, static_cast<float>(r));
  auto b = torch::arange(5, torch::kFloat64) * (r + 1);
  auto strided = torch::ones({4, 4}).select(1, 1);  // staged through a host copy
  auto wa = c->all_reduce_async(a, ReduceOp::sum);
  auto wb = c->all_reduce_async(b, ReduceOp::avg);
  auto ws = c->all_reduce_async(strided, ReduceOp::sum);
  wb->wait();
  wa->wait();
  ws->wait();
  EXPECT_TRUE(torch::all(a == n * (n - 1) / 2.0f).item<bool>());
  EXPECT_TRUE(torch::allclose(b, torch::arange(5, torch::kFloat64) * ((n + 1) / 2.0)));
  EXPECT_TRUE(torch::all(strided == static_cast<float>(n)).item<bool>());
}

// Two micro-steps of a small network with one parameter unused; the overlapped GradSync (hooks
// launch buckets during the second backward) must give exactly the gradients of the plain one.
TEST(GradSync, OverlapWithBackwardEqualsAllReduceAfterBackward) {
  auto c = world();
  auto run = [&](bool overlap, size_t* launched) {
    torch::manual_seed(7);  // same parameters on every rank
    // Buckets fill in reverse order: [300x16], [32x300], [32, 64x32, unused].
    std::vector<torch::Tensor> params{torch::randn({5}).requires_grad_(true),  // never used
                                      torch::randn({64, 32}).requires_grad_(true),
                                      torch::randn({32}).requires_grad_(true),
                                      torch::randn({32, 300}).requires_grad_(true),
                                      torch::randn({300, 16}).requires_grad_(true)};
    GradSync sync(params, *c, /*bucket_mb=*/0.03, overlap);
    torch::manual_seed(1000 + c->rank());  // different data per rank
    for (int micro = 0; micro < 2; ++micro) {
      auto x = torch::randn({8, 64});
      auto h = torch::tanh(torch::matmul(x, params[1]) + params[2]);
      auto y = torch::matmul(torch::relu(torch::matmul(h, params[3])), params[4]);
      if (micro == 1) sync.arm();
      (y.pow(2).mean() / 2.0).backward();
    }
    if (launched) *launched = sync.launched_during_backward();
    sync.all_reduce_grads();
    EXPECT_GE(sync.num_buckets(), 3u);
    std::vector<torch::Tensor> grads;
    for (auto& p : params) grads.push_back(p.grad().clone());
    return grads;
  };
  size_t launched = 0;
  auto plain = run(false, nullptr);
  auto overlapped = run(true, &launched);
  EXPECT_EQ(launched, 2u) << "the two complete buckets start during backward";
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], overlapped[i])) << i;
  EXPECT_TRUE(torch::all(overlapped[0] == 0).item<bool>());  // unused: zeros, on every rank
}

// ZeRO-2's gradient path (free_grads): each backward's gradients go from the parameters' hooks into
// the buckets and are reduce-scattered per micro-step. With one micro-step that is ZeRO-1's
// reduce-scatter of the same buffer: bitwise equal shards. Over two micro-steps the shards are the
// sum over micro-steps of the ranks' average where ZeRO-1 averages the sum: 2n terms g/n added in
// two orders, each within (2n - 1) u of the exact sum of |g|/n, plus the divisions' u, so within
// 4 u sum|g| = 2^-22 sum|g| per element (sum|g| over ranks and micro-steps, measured here). No
// parameter holds a .grad() after any backward, and during one at most the last whose hook ran.
// With overlap the complete buckets start during backward.
TEST(GradSync, ZeroTwoKeepsOnlyTheShardAndEqualsZeroOne) {
  auto c = world();
  const int n = c->size();
  auto make_params = [] {
    torch::manual_seed(7);  // the same on every rank
    return std::vector<torch::Tensor>{torch::randn({5}).requires_grad_(true),  // never used
                                      torch::randn({64, 32}).requires_grad_(true),
                                      torch::randn({32}).requires_grad_(true),
                                      torch::randn({32, 300}).requires_grad_(true),
                                      torch::randn({300, 16}).requires_grad_(true)};
  };
  auto backward = [](std::vector<torch::Tensor>& params) {
    auto x = torch::randn({8, 64});
    auto h = torch::tanh(torch::matmul(x, params[1]) + params[2]);
    auto y = torch::matmul(torch::relu(torch::matmul(h, params[3])), params[4]);
    (y.pow(2).mean() / 2.0).backward();
  };
  struct Got {
    std::vector<torch::Tensor> shards;
    std::vector<GradSync::Slice> slices;
    int64_t held = 0;
    size_t launched = 0;
  };
  auto run = [&](bool free_grads, bool overlap, int micros) {
    auto params = make_params();
    GradSync sync(params, *c, /*bucket_mb=*/0.03, overlap, /*shard=*/true, torch::kFloat32, free_grads);
    torch::manual_seed(1000 + c->rank());  // different data per rank
    Got got;
    for (int micro = 0; micro < micros; ++micro) {
      if (free_grads || micro + 1 == micros) sync.arm();
      backward(params);
      int64_t grads = 0;
      for (auto& p : params) grads += p.grad().defined() ? p.numel() : 0;
      got.held = std::max(got.held, grads);
      if (free_grads && micro + 1 < micros) sync.reduce_micro_step();
    }
    got.launched = sync.launched_during_backward();
    sync.all_reduce_grads();
    for (auto& p : params) EXPECT_FALSE(p.grad().defined());
    for (size_t b = 0; b < sync.num_buckets(); ++b) got.shards.push_back(sync.grad_shard(b).clone());
    got.slices = sync.owned_slices();
    return got;
  };
  // sum|g| over ranks and micro-steps, per element of each parameter, for the bound.
  auto abs_sums = [&](int micros) {
    auto params = make_params();
    torch::manual_seed(1000 + c->rank());
    std::vector<torch::Tensor> sums;
    for (auto& p : params) sums.push_back(torch::zeros({p.numel()}));
    for (int micro = 0; micro < micros; ++micro) {
      for (auto& p : params) p.mutable_grad() = torch::Tensor();
      backward(params);
      for (size_t k = 0; k < params.size(); ++k)
        if (params[k].grad().defined()) sums[k] += params[k].grad().abs().reshape({-1});
    }
    for (auto& s : sums) c->all_reduce(s, ReduceOp::sum);
    return sums;
  };
  for (bool overlap : {true, false}) {
    const Got one = run(false, overlap, 1), two = run(true, overlap, 1);
    ASSERT_EQ(one.shards.size(), two.shards.size());
    for (size_t b = 0; b < one.shards.size(); ++b) EXPECT_TRUE(torch::equal(one.shards[b], two.shards[b])) << b;
    const Got one2 = run(false, overlap, 2), two2 = run(true, overlap, 2);
    const auto sums = abs_sums(2);
    for (const auto& sl : two2.slices) {
      auto a = two2.shards[sl.bucket].narrow(0, sl.shard_offset, sl.length);
      auto b = one2.shards[sl.bucket].narrow(0, sl.shard_offset, sl.length);
      auto bound = sums[sl.param].narrow(0, sl.begin, sl.length) * std::ldexp(1.0, -22);
      EXPECT_TRUE(torch::all((a - b).abs() <= bound).item<bool>())
          << "param " << sl.param << ": max |delta| " << (a - b).abs().max().item<float>();
    }
    // ZeRO-1 holds every used parameter's whole gradient after backward; ZeRO-2 at most the last
    // one whose hook ran ([64 x 32], [32] or [300 x 16] alone: never two).
    EXPECT_GT(one2.held, 64 * 32 + 32 * 300);
    EXPECT_LE(two2.held, 300 * 16) << "overlap " << overlap;
    if (overlap && n > 1) {
      EXPECT_EQ(two2.launched, 2u) << "the two complete buckets start during backward";
    }
  }
}

// ZeRO-2 with overlap: a chain of 8 weights of 32 x 32, one per bucket, so backward completes a
// bucket at every hook. Launching a third reduce-scatter completes the oldest, so at no hook are
// more than three bucket buffers held (two in flight, one filling), not all eight; the shards
// still equal ZeRO-1's.
TEST(GradSync, ZeroTwoHoldsAtMostThreeBucketsDuringBackward) {
  auto c = world();
  if (c->size() < 2) GTEST_SKIP() << "ZeRO-2 shards over 2 or more ranks";
  auto run = [&](bool free_grads, size_t* max_held) {
    torch::manual_seed(5);
    std::vector<torch::Tensor> params;
    for (int i = 0; i < 8; ++i) params.push_back((torch::randn({32, 32}) / 6).requires_grad_(true));
    GradSync sync(params, *c, /*bucket_mb=*/0.004, /*overlap=*/true, /*shard=*/true, torch::kFloat32, free_grads);
    EXPECT_EQ(sync.num_buckets(), 8u);
    torch::manual_seed(100 + c->rank());
    sync.arm();
    torch::Tensor h = torch::randn({4, 32});
    for (auto& w : params) h = torch::tanh(h.matmul(w));
    h.sum().backward();
    if (max_held) *max_held = sync.max_buckets_held();
    sync.all_reduce_grads();
    std::vector<torch::Tensor> shards;
    for (size_t b = 0; b < sync.num_buckets(); ++b) shards.push_back(sync.grad_shard(b).clone());
    return shards;
  };
  size_t held = 0;
  const auto zero2 = run(true, &held), zero1 = run(false, nullptr);
  EXPECT_GE(held, 1u);
  EXPECT_LE(held, 3u) << "bucket buffers held at once during backward";
  for (size_t b = 0; b < zero1.size(); ++b) EXPECT_TRUE(torch::equal(zero1[b], zero2[b])) << "bucket " << b;
}

// The mesh's groups are the layout's: a sum over the tp group adds the tp-group ranks, a sum over
// the dp group the ranks that share this rank's tp coordinate (tp 2 on one host's 2 or 4 ranks).
TEST(Mesh, GroupCommunicatorsFollowTheLayout) {
  const Topology topo = Topology::discover(mpi::world());
  for (int tp : {1, 2}) {
    if (topo.size % tp != 0) continue;
    Mesh mesh(mpi::world(), plan_layout(topo, tp), "mpi", torch::Device(torch::kCPU));
    const MeshLayout& l = mesh.layout();
    EXPECT_EQ(mesh.tp().size(), tp);
    EXPECT_EQ(mesh.dp().size(), topo.size / tp);
    EXPECT_EQ(mesh.tp().rank(), l.tp_rank(topo.rank));
    EXPECT_EQ(mesh.dp().rank(), l.dp_rank(topo.rank));
    auto in_tp = torch::tensor({static_cast<int64_t>(topo.rank)});
    mesh.tp().all_reduce(in_tp, ReduceOp::sum);
    int64_t want = 0;
    for (int r : l.tp_group(topo.rank)) want += r;
    EXPECT_EQ(in_tp.item<int64_t>(), want) << "tp " << tp;
    auto in_dp = torch::tensor({static_cast<int64_t>(topo.rank)});
    mesh.dp().all_reduce(in_dp, ReduceOp::sum);
    want = 0;
    for (int r : l.dp_group(topo.rank)) want += r;
    EXPECT_EQ(in_dp.item<int64_t>(), want) << "tp " << tp;
    mesh.world().barrier();
  }
}

// The island communicator holds every rank of the rank's island; the per-step checks of a run with
// islands (mpi_env.h's LaggedAgreement over it): a stop signal posted by one rank is every rank's
// after complete(); a bad-input error in the last island alone ends every rank with
// ReportedUsageError, that island's ranks at post() (before their step), the others at complete()
// (after theirs); nothing posted completes to 0.
TEST(LaggedAgreement, SignalsAndFailuresReachEveryRankOneStepLate) {
  const Topology topo = Topology::discover(mpi::world());
  ASSERT_EQ(topo.size % 2, 0) << "run under mpirun -np 2 or 4";
  Mesh mesh(mpi::world(), plan_layout(topo, 1, 2), "mpi", torch::Device(torch::kCPU));
  const MeshLayout& l = mesh.layout();
  const int island = l.island(topo.rank), last = topo.size - 1;
  auto members = torch::tensor({static_cast<int64_t>(topo.rank)});
  mesh.island().all_reduce(members, ReduceOp::sum);
  int64_t want = 0;
  for (int r = island * l.island_size(); r < (island + 1) * l.island_size(); ++r) want += r;
  EXPECT_EQ(members.item<int64_t>(), want);

  LaggedAgreement checks(mpi::world(), mesh.island_mpi());
  EXPECT_EQ(checks.complete(), 0);  // nothing posted
  checks.post([] {}, topo.rank == last ? 15 : 0);
  EXPECT_EQ(checks.complete(), 15);
  checks.post([] {}, topo.rank == 0 ? 10 : 0);
  EXPECT_EQ(checks.complete(), 10);
  checks.post([] {}, 0);
  EXPECT_EQ(checks.complete(), 0);

  int thrown_at_post = 0, thrown_at_complete = 0;
  try {
    checks.post([&] { if (topo.rank == last) throw UsageError("test: bad data on the last rank"); }, 0);
  } catch (const ReportedUsageError& e) {
    EXPECT_EQ(e.exit_code, 2);
    ++thrown_at_post;
  }
  if (!thrown_at_post) {
    try {
      checks.complete();
    } catch (const ReportedUsageError&) {
      ++thrown_at_complete;
    }
  }
  const bool last_island = island == l.islands - 1;
  EXPECT_EQ(thrown_at_post, last_island ? 1 : 0) << "rank " << topo.rank;
  EXPECT_EQ(thrown_at_complete, last_island ? 0 : 1) << "rank " << topo.rank;
  mesh.world().barrier();
}

// ZeRO-3's parameter shards (zero3.h) on a real model: the gradient shards of one forward and
// backward equal ZeRO-2's over the same units (the same GradSync groups) bit for bit, while at most
// the outside unit, the block running and the next one (prefetched) are whole at once, and none
// after backward; the loss equals the whole model's.
TEST(ParamShards, GradientsEqualZeroTwoWithAtMostTwoBlocksWhole) {
  auto c = world();
  if (c->size() < 2) GTEST_SKIP() << "ZeRO-3 shards over 2 or more ranks";
  GPTDims d;
  d.n_layer = 3, d.n_head = 2, d.n_embd = 16, d.seq_len = 8, d.vocab_size = 40;
  for (const char* arch : {"gpt2", "llama"})
    for (RunOptions::Ac ac : {RunOptions::Ac::none, RunOptions::Ac::full, RunOptions::Ac::selective}) {
      d.arch = arch;
      RunOptions run;
      run.fused_kernels = std::string(arch) == "llama";
      run.ac = ac;
      const std::string what = concat(arch, ac == RunOptions::Ac::full        ? " with full checkpointing"
                                             : ac == RunOptions::Ac::selective ? " with selective checkpointing"
                                                                            : "");
      const auto zero2 = zero3_probe(d, run, *c, torch::kCPU, Precision::fp32, false);
      const auto zero3 = zero3_probe(d, run, *c, torch::kCPU, Precision::fp32, true);
      EXPECT_TRUE(torch::equal(zero2.loss, zero3.loss)) << what;
      ASSERT_EQ(zero2.grad_shards.size(), zero3.grad_shards.size());
      for (size_t b = 0; b < zero2.grad_shards.size(); ++b) {
        EXPECT_GT(zero2.grad_shards[b].abs().sum().item<double>(), 0) << what << ": unit " << b;
        EXPECT_TRUE(torch::equal(zero2.grad_shards[b], zero3.grad_shards[b])) << what << ": unit " << b;
      }
      EXPECT_EQ(zero3.max_whole, 3u) << what << ": the outside unit, one block and the next";
      EXPECT_EQ(zero3.whole_after, 0u) << what;
      EXPECT_TRUE(zero3.gather_all_exact) << what;
      // train's start-up: the model made without values, each parameter drawn on its own into
      // the shards (GPT::initialize, ParamShards::set_param): the same step, bit for bit.
      const auto deferred = zero3_probe(d, run, *c, torch::kCPU, Precision::fp32, true, torch::kFloat32, /*from_host=*/true);
      EXPECT_TRUE(torch::equal(zero2.loss, deferred.loss)) << what << ", made deferred";
      for (size_t b = 0; b < zero2.grad_shards.size(); ++b)
        EXPECT_TRUE(torch::equal(zero2.grad_shards[b], deferred.grad_shards[b])) << what << ", made deferred: unit " << b;
      EXPECT_TRUE(deferred.gather_all_exact) << what << ", made deferred";
    }
}

// comm.param_dtype bf16: ZeRO-3's gathers send the fp32 shards rounded to bf16, so one forward and
// backward equals, bit for bit, ZeRO-2's over a model whose weights were rounded to bf16 first
// (prefetched gathers included: every block but the first arrives through one); it differs from
// the fp32 gathers' (the rounding happened); and gather_all (checkpoints, the final parameters)
// still gives back the fp32 master weights exactly.
TEST(ParamShards, SixteenBitGathersComputeWithTheRoundedWeights) {
  auto c = world();
  if (c->size() < 2) GTEST_SKIP() << "ZeRO-3 shards over 2 or more ranks";
  GPTDims d;
  d.n_layer = 3, d.n_head = 2, d.n_embd = 16, d.seq_len = 8, d.vocab_size = 40;
  for (const char* arch : {"gpt2", "llama"}) {
    d.arch = arch;
    const auto rounded = zero3_probe(d, RunOptions(), *c, torch::kCPU, Precision::fp32, false, torch::kBFloat16);
    const auto zero3 = zero3_probe(d, RunOptions(), *c, torch::kCPU, Precision::fp32, true, torch::kBFloat16);
    const auto fp32 = zero3_probe(d, RunOptions(), *c, torch::kCPU, Precision::fp32, true);
    EXPECT_TRUE(torch::equal(zero3.loss, rounded.loss)) << arch;
    EXPECT_FALSE(torch::equal(zero3.loss, fp32.loss)) << arch << ": the bf16 gathers rounded nothing";
    ASSERT_EQ(zero3.grad_shards.size(), rounded.grad_shards.size());
    for (size_t b = 0; b < rounded.grad_shards.size(); ++b)
      EXPECT_TRUE(torch::equal(zero3.grad_shards[b], rounded.grad_shards[b])) << arch << ": unit " << b;
    EXPECT_TRUE(zero3.gather_all_exact) << arch;
  }
}
