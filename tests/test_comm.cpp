// The MPI communicator under a real mpirun (-np 2 and -np 4): all_reduce sum/avg/max,
// broadcast, all_gather, large tensors, asynchronous all-reduce, and the bucketed gradient
// all-reduce with and without overlap with backward; reduce-scatter and ZeRO-1's sharded GradSync.
#include <gtest/gtest.h>

#include "mpitrain/comm.h"
#include "mpitrain/grad_sync.h"
#include "mpitrain/error.h"
#include "mpitrain/layout.h"
#include "mpitrain/mesh.h"
#include "mpitrain/mpi_env.h"

using namespace mpitrain;

namespace {
std::unique_ptr<Communicator> world() { return make_mpi_communicator(MPI_COMM_WORLD); }
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
  std::vector<torch::Tensor> expected;
  for (auto& p : params) {
    auto e = p.grad().clone();
    c->all_reduce(e, ReduceOp::avg);
    expected.push_back(e);
  }
  GradSync sync(params, *c, /*bucket_mb=*/0.05, /*overlap=*/false, /*shard=*/true);
  EXPECT_GE(sync.num_buckets(), 2u);
  sync.all_reduce_grads();
  for (auto& p : params) EXPECT_FALSE(p.grad().defined());  // spent
  // Every rank's slices, gathered: each element of each parameter owned exactly once.
  std::vector<torch::Tensor> owners;
  for (auto& p : params) owners.push_back(torch::zeros({p.numel()}, torch::kInt32));
  for (const auto& s : sync.owned_slices()) {
    EXPECT_TRUE(torch::equal(sync.grad_shard(s.bucket).narrow(0, s.shard_offset, s.length),
                             expected[s.param].narrow(0, s.begin, s.length)));
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

// The mesh's groups are the layout's: a sum over the tp group adds the tp-group ranks, a sum over
// the dp group the ranks that share this rank's tp coordinate (tp 2 on one host's 2 or 4 ranks).
TEST(Mesh, GroupCommunicatorsFollowTheLayout) {
  const Topology topo = Topology::discover(MPI_COMM_WORLD);
  for (int tp : {1, 2}) {
    if (topo.size % tp != 0) continue;
    Mesh mesh(MPI_COMM_WORLD, plan_layout(topo, tp), "mpi", torch::Device(torch::kCPU));
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
