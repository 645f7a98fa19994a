// Device per rank from MPI's host split (device.h): local rank r -> GPU r % visible, CUDA_VISIBLE_DEVICES
// named in the description; the pre-flight's rules (preflight.h) on records of made-up ranks; the
// memory plan's terms per layout (memory_plan.h) from made-up counts.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>

#include "mpitrain/device.h"
#include "mpitrain/error.h"
#include "mpitrain/layout.h"
#include "mpitrain/memory_plan.h"
#include "mpitrain/preflight.h"

using namespace mpitrain;

TEST(Device, CpuWhenAskedOrWhenThereAreNoGpus) {
  EXPECT_FALSE(choose_device("cpu", "auto", 8, 0, 1, "h").cuda);
  DeviceChoice c = choose_device("auto", "auto", 0, 3, 4, "h");
  EXPECT_FALSE(c.cuda);
  EXPECT_EQ(c.describe, "cpu");
}

TEST(Device, LocalRankPicksItsGpu) {
  unsetenv("CUDA_VISIBLE_DEVICES");
  for (int r = 0; r < 4; ++r) {
    DeviceChoice c = choose_device("auto", "nccl", 4, r, 4, "node1");
    EXPECT_TRUE(c.cuda);
    EXPECT_EQ(c.index, r);
    EXPECT_FALSE(c.shared);
    EXPECT_EQ(c.describe, "cuda:" + std::to_string(r));
  }
}

TEST(Device, VisibleDevicesAreNamed) {
  setenv("CUDA_VISIBLE_DEVICES", "2,3", 1);
  DeviceChoice c = choose_device("cuda", "auto", 2, 1, 2, "node1");
  EXPECT_EQ(c.index, 1);
  EXPECT_EQ(c.describe, "cuda:1 (CUDA_VISIBLE_DEVICES=2,3: physical GPU 3)");
  unsetenv("CUDA_VISIBLE_DEVICES");
}

// More ranks than visible GPUs is not refused here: with srun --gpus-per-task=1 every task sees
// one GPU, its own; the pre-flight's bus ids decide (PreflightJudge tests below).
TEST(Device, MoreRanksThanVisibleGpusTakeLocalRankModuloGpus) {
  DeviceChoice c = choose_device("auto", "nccl", 1, 3, 4, "frontier-node");
  EXPECT_TRUE(c.cuda);
  EXPECT_EQ(c.index, 0);
  EXPECT_FALSE(c.shared);
  c = choose_device("auto", "auto", 2, 2, 3, "gpu-node7");
  EXPECT_EQ(c.index, 0);
}

TEST(Device, MpiBackendSharesGpus) {
  DeviceChoice c = choose_device("auto", "mpi", 1, 1, 2, "h");
  EXPECT_TRUE(c.cuda);
  EXPECT_TRUE(c.shared);
  EXPECT_EQ(c.index, 0);
}

TEST(Device, CudaWithoutGpusIsAnError) {
  EXPECT_THROW(choose_device("cuda", "auto", 0, 0, 1, "h"), UsageError);
}

// ---- the dp x tp layout (layout.h) -------------------------------------------------------------

namespace {
// `per_host` ranks on each of the hosts, in rank order (mpirun's default by-slot placement).
Topology hosts_of(const std::vector<std::pair<std::string, int>>& per_host) {
  Topology t;
  t.size = 0;
  for (size_t h = 0; h < per_host.size(); ++h) {
    t.hosts.push_back(per_host[h].first);
    for (int i = 0; i < per_host[h].second; ++i) t.host_of_rank.push_back(static_cast<int>(h));
    t.size += per_host[h].second;
  }
  return t;
}
}  // namespace

TEST(Layout, TpGroupsAreConsecutiveRanksAndDpGroupsShareTheTpCoordinate) {
  const Topology topo = hosts_of({{"a", 4}, {"b", 4}});
  const MeshLayout l = plan_layout(topo, 2);
  EXPECT_EQ(l.world, 8);
  EXPECT_EQ(l.dp, 4);
  EXPECT_EQ(l.tp, 2);
  EXPECT_EQ(l.tp_group(5), (std::vector<int>{4, 5}));
  EXPECT_EQ(l.dp_group(5), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(l.dp_rank(5), 2);
  EXPECT_EQ(l.tp_rank(5), 1);
  EXPECT_EQ(l.describe(topo), "mesh: 8 ranks = dp 4 x tp 2; tp groups a[0-1] a[2-3] b[4-5] b[6-7]");
  const MeshLayout flat = plan_layout(topo, 1);
  EXPECT_EQ(flat.dp, 8);
  EXPECT_EQ(flat.dp_group(3).size(), 8u);
  EXPECT_EQ(flat.describe(topo), "mesh: 8 ranks = dp 8");
}

// Pipeline stages are the outermost runs of ranks; within a stage everything is as without them,
// and a pipeline is the ranks at one place in every stage.
TEST(Layout, PipelineStagesAreRunsOfRanksEachWithItsOwnDpGroup) {
  const Topology topo = hosts_of({{"a", 4}, {"b", 4}});
  const MeshLayout l = plan_layout(topo, 1, 1, 1, 2);  // pp 2 x dp 4
  EXPECT_EQ(l.pp, 2);
  EXPECT_EQ(l.dp, 4);
  EXPECT_EQ(l.stage(5), 1);
  EXPECT_EQ(l.dp_group(5), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(l.dp_rank(5), 1);
  EXPECT_EQ(l.replica(5), l.replica(1));  // every stage of a pipeline reads its replica's data
  EXPECT_EQ(l.pp_group(5), (std::vector<int>{1, 5}));
  EXPECT_EQ(l.describe(topo), "mesh: 8 ranks = pp 2 x dp 4; stages a[0-3] b[4-7]");
  EXPECT_THROW(plan_layout(topo, 1, 1, 1, 3), UsageError);
}

// DiLoCo's islands are the outermost runs, a pipeline inside each: 2 hosts x 4 ranks as 2 islands
// (one per host) x pp 2 x dp 2. A stage's dp group and a pipeline stay inside their island; the
// replica group of a stage and the island group (the outer all-reduce) cross the islands.
TEST(Layout, IslandsHoldWholePipelines) {
  const Topology topo = hosts_of({{"a", 4}, {"b", 4}});
  const MeshLayout l = plan_layout(topo, 1, -1, 1, 2);  // islands: host
  EXPECT_EQ(l.islands, 2);
  EXPECT_EQ(l.dp, 2);
  EXPECT_EQ(l.island(5), 1);
  EXPECT_EQ(l.stage(5), 0);
  EXPECT_EQ(l.stage(6), 1);
  EXPECT_EQ(l.dp_group(5), (std::vector<int>{4, 5}));
  EXPECT_EQ(l.pp_group(5), (std::vector<int>{5, 7}));
  EXPECT_EQ(l.replica(5), 3);
  EXPECT_EQ(l.replica(7), 3);  // every stage of a pipeline reads its replica's data
  EXPECT_EQ(l.replica_group(6), (std::vector<int>{2, 3, 6, 7}));
  EXPECT_EQ(l.island_group(6), (std::vector<int>{2, 6}));
  EXPECT_EQ(l.describe(topo), "mesh: 8 ranks = 2 islands x pp 2 x dp 2; stages a[0-1] a[2-3] b[4-5] b[6-7]; islands a[0-3] b[4-7]");
  EXPECT_THROW(plan_layout(hosts_of({{"a", 3}, {"b", 3}}), 1, -1, 1, 2), UsageError);  // an island of 3 ranks in 2 stages
}

TEST(Layout, ALayoutThatDoesNotFitTheHostsIsRefusedNamingKeyAndHost) {
  try {
    plan_layout(hosts_of({{"a", 3}, {"b", 3}}), 2);  // ranks 2-3 would span a and b
    FAIL() << "expected UsageError";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("parallel.tp: 2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 2 is on host a and rank 3 on host b"), std::string::npos) << msg;
  }
  try {
    plan_layout(hosts_of({{"a", 3}}), 2);
    FAIL() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.tp: 2 does not divide the world size 3"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(plan_layout(hosts_of({{"a", 4}, {"b", 2}}), 2));
}

TEST(Layout, IslandsAreRunsOfConsecutiveRanksWithTheirOwnDpGroups) {
  const Topology topo = hosts_of({{"a", 4}, {"b", 4}});
  const MeshLayout l = plan_layout(topo, 2, 2);  // 2 islands x dp 2 x tp 2
  EXPECT_EQ(l.islands, 2);
  EXPECT_EQ(l.dp, 2);
  EXPECT_EQ(l.replicas(), 4);
  EXPECT_EQ(l.island(5), 1);
  EXPECT_EQ(l.dp_rank(5), 0);
  EXPECT_EQ(l.replica(5), 2);
  EXPECT_EQ(l.tp_group(5), (std::vector<int>{4, 5}));
  EXPECT_EQ(l.dp_group(5), (std::vector<int>{5, 7}));
  EXPECT_EQ(l.replica_group(5), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(l.island_group(5), (std::vector<int>{1, 5}));
  EXPECT_EQ(l.describe(topo), "mesh: 8 ranks = 2 islands x dp 2 x tp 2; tp groups a[0-1] a[2-3] b[4-5] b[6-7]; "
                              "islands a[0-3] b[4-7]");
  const MeshLayout per_host = plan_layout(topo, 1, -1);  // parallel.islands: host
  EXPECT_EQ(per_host.islands, 2);
  EXPECT_EQ(per_host.dp, 4);
  EXPECT_EQ(plan_layout(topo, 1, 4).describe(topo), "mesh: 8 ranks = 4 islands x dp 2; islands a[0-1] a[2-3] b[4-5] b[6-7]");
  EXPECT_EQ(plan_layout(topo, 1, 1).dp_group(3).size(), 8u);  // one island: plain data parallelism
}

TEST(Layout, IslandsThatDoNotFitAreRefusedNamingTheKey) {
  auto message = [](const Topology& t, int64_t tp, int64_t islands) {
    try {
      plan_layout(t, tp, islands);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  const std::string three = message(hosts_of({{"a", 4}, {"b", 4}}), 1, 3);
  EXPECT_NE(three.find("parallel.islands: 3 does not divide the world size 8"), std::string::npos) << three;
  const std::string split = message(hosts_of({{"a", 4}}), 4, 2);
  EXPECT_NE(split.find("parallel.islands: 2 islands of 2 ranks would split a tp group of parallel.tp 4"),
            std::string::npos) << split;
  const std::string uneven = message(hosts_of({{"a", 4}, {"b", 2}}), 1, -1);
  EXPECT_NE(uneven.find("parallel.islands: host needs every host to run as many consecutive ranks"), std::string::npos)
      << uneven;
}

// parallel.islands: auto on made-up measurements (Gbit/s between hosts): a link is slow below
// parallel.slow_link_gbit or a quarter of the fastest; hosts joined by other links are one group.
TEST(Layout, AutoIslandsGroupHostsJoinedByFastLinks) {
  const double X = 0;  // (the diagonal is not read)
  // a-b on 100 Gbit/s, c and d each reached at 1 Gbit/s, c-d at 100: {a, b} {c, d}
  const std::vector<std::vector<double>> two_sites = {
      {X, 100, 1, 1}, {100, X, 1, 1}, {1, 1, X, 100}, {1, 1, 100, X}};
  EXPECT_EQ(group_hosts(two_sites, 10), (std::vector<int>{0, 0, 1, 1}));
  // the quarter rule alone: 40 and 8 Gbit/s against a floor of 1: 8 < 40 / 4 parts them
  EXPECT_EQ(group_hosts({{X, 40, 8}, {40, X, 8}, {8, 8, X}}, 1), (std::vector<int>{0, 0, 1}));
  // the floor alone: every link alike at 1 Gbit/s (two machines on Ethernet): an island each
  EXPECT_EQ(group_hosts({{X, 1, 1}, {1, X, 1}, {1, 1, X}}, 10), (std::vector<int>{0, 1, 2}));
  // a chain of fast links joins hosts that are not directly fast: a-b and b-c fast, a-c slow
  EXPECT_EQ(group_hosts({{X, 50, 1}, {50, X, 50}, {1, 50, X}}, 10), (std::vector<int>{0, 0, 0}));
  // groups number in the order of their first hosts
  EXPECT_EQ(group_hosts({{X, 1, 100}, {1, X, 1}, {100, 1, X}}, 10), (std::vector<int>{0, 1, 0}));

  const Topology four = hosts_of({{"a", 1}, {"b", 1}, {"c", 2}});
  EXPECT_EQ(islands_of_groups(four, {0, 0, 1}), 2);  // {a, b}: ranks 0-1, {c}: ranks 2-3
  EXPECT_EQ(plan_layout(four, 1, islands_of_groups(four, {0, 0, 1})).describe(four),
            "mesh: 4 ranks = 2 islands x dp 2; islands a-b[0-1] c[2-3]");
  EXPECT_EQ(islands_of_groups(four, {0, 0, 0}), 1);  // one group: plain training
  auto refusal = [](const Topology& t, const std::vector<int>& g) {
    try {
      islands_of_groups(t, g);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  const std::string uneven = refusal(hosts_of({{"a", 1}, {"b", 1}, {"c", 1}}), {0, 0, 1});
  EXPECT_NE(uneven.find("parallel.islands: auto: the links make 2 groups of hosts, which do not divide the world of 3"),
            std::string::npos) << uneven;
  const std::string apart = refusal(hosts_of({{"a", 1}, {"b", 1}, {"c", 1}, {"d", 1}}), {0, 1, 0, 1});
  EXPECT_NE(apart.find("parallel.islands: auto: the links make 2 groups of hosts, but rank 1 (host b)"),
            std::string::npos) << apart;
}

// ---- the pre-flight's rules (judge_preflight) on records of made-up ranks -----------------------
namespace {
PreflightRecord record(const std::map<std::string, std::string>& values) {
  PreflightRecord r;
  r.at("mpitrain") = "0.1.0 (build 1a2b3c4d)";
  r.at("libtorch") = "2.11.0";
  r.at("mpi") = "Open MPI v4.1.6";
  r.at("cuda_runtime") = "13.0";
  r.at("nccl") = "2.28.3";
  r.at("cuda_driver") = "13.0";
  r.at("gpu") = "NVIDIA H100 80GB HBM3";
  r.at("shm") = "8.0 GiB";
  r.at("nccl_if") = "auto: eth0";
  for (const auto& [k, v] : values) r.at(k) = v;
  return r;
}
std::vector<PreflightRecord> records(int n, const std::vector<std::map<std::string, std::string>>& per_rank = {}) {
  std::vector<PreflightRecord> all;
  for (int r = 0; r < n; ++r) {
    auto values = r < static_cast<int>(per_rank.size()) ? per_rank[r] : std::map<std::string, std::string>{};
    if (!values.count("bus_id")) values["bus_id"] = concat("0000:", 10 + r % 4, ":00.0");
    all.push_back(record(values));
  }
  return all;
}
bool any_has(const std::vector<std::string>& lines, const std::string& text) {
  for (const auto& l : lines)
    if (l.find(text) != std::string::npos) return true;
  return false;
}
}  // namespace

TEST(PreflightJudge, AgreeingRanksGiveOneLineAndNothingElse) {
  const Topology t = hosts_of({{"a", 4}, {"b", 4}});
  const PreflightVerdict v = judge_preflight(records(8), t, true);
  EXPECT_TRUE(v.errors.empty()) << v.errors.front();
  EXPECT_TRUE(v.warnings.empty()) << v.warnings.front();
  EXPECT_EQ(v.summary.rfind("preflight: 8 ranks on 2 hosts agree: mpitrain 0.1.0 (build 1a2b3c4d), libtorch 2.11.0, "
                            "MPI library Open MPI v4.1.6, CUDA runtime 13.0, NCCL 2.28.3", 0), 0u)
      << v.summary;
}

TEST(PreflightJudge, AnotherNcclOrBuildOnSomeRanksIsAnErrorNamingRanksAndHosts) {
  const Topology t = hosts_of({{"a", 2}, {"b", 2}});
  PreflightVerdict v = judge_preflight(records(4, {{}, {}, {{"nccl", "2.21.5"}}, {{"nccl", "2.21.5"}}}), t, true);
  ASSERT_EQ(v.errors.size(), 1u);
  EXPECT_EQ(v.errors[0], "preflight: NCCL 2.21.5 on host b (ranks 2-3) differs from rank 0's 2.28.3 on host a: "
                         "install the same version on every host (the same container image or modules)");
  v = judge_preflight(records(4, {{}, {{"mpitrain", "0.1.0 (build ffffffff)"}}}), t, false);
  ASSERT_EQ(v.errors.size(), 1u);
  EXPECT_TRUE(any_has(v.errors, "mpitrain 0.1.0 (build ffffffff) on host a (rank 1) differs")) << v.errors[0];
  EXPECT_TRUE(any_has(v.errors, "copy the same build to every host")) << v.errors[0];
  // A table row per distinct value, with its ranks.
  EXPECT_TRUE(any_has(v.table, "mpitrain\t0.1.0 (build ffffffff)\thost a (rank 1)"));
}

TEST(PreflightJudge, AnotherDriverOrGpuModelIsOnlyAWarning) {
  const Topology t = hosts_of({{"a", 1}, {"b", 1}});
  const PreflightVerdict v =
      judge_preflight(records(2, {{}, {{"cuda_driver", "12.8"}, {"gpu", "NVIDIA A100-SXM4-80GB"}}}), t, true);
  EXPECT_TRUE(v.errors.empty());
  EXPECT_EQ(v.warnings.size(), 2u);
  EXPECT_TRUE(any_has(v.warnings, "GPU NVIDIA A100-SXM4-80GB on host b (rank 1) differs"));
}

TEST(PreflightJudge, TwoRanksOnOneGpuUnderNcclNameBothRanksAndTheHost) {
  const Topology t = hosts_of({{"a", 2}, {"b", 2}});
  auto same = records(4, {{}, {}, {{"bus_id", "0000:1b:00.0"}}, {{"bus_id", "0000:1b:00.0"}}});
  PreflightVerdict v = judge_preflight(same, t, true);
  ASSERT_EQ(v.errors.size(), 1u);
  EXPECT_EQ(v.errors[0].rfind("train.device: ranks 2-3 on host b would all train on GPU 0000:1b:00.0; NCCL needs one "
                              "GPU per rank", 0), 0u) << v.errors[0];
  // The MPI backend shares GPUs; one bus id on two hosts is two GPUs.
  EXPECT_TRUE(judge_preflight(same, t, false).errors.empty());
  auto across = records(2, {{{"bus_id", "0000:1b:00.0"}}, {{"bus_id", "0000:1b:00.0"}}});
  const Topology two = hosts_of({{"a", 1}, {"b", 1}});
  EXPECT_TRUE(judge_preflight(across, two, true).errors.empty());
}

TEST(PreflightJudge, RisksAreWarningsWithTheFix) {
  const Topology t = hosts_of({{"a", 2}, {"b", 2}});
  // A container's 64 MiB /dev/shm where two ranks share the host; not where a rank is alone.
  PreflightVerdict v = judge_preflight(records(4, {{}, {}, {{"shm", "64 MiB"}}, {{"shm", "64 MiB"}}}), t, true);
  ASSERT_EQ(v.warnings.size(), 1u);
  EXPECT_TRUE(any_has(v.warnings, "/dev/shm is under 1 GiB (64 MiB) on host b (ranks 2-3)")) << v.warnings[0];
  EXPECT_TRUE(any_has(v.warnings, "--shm-size"));
  const Topology alone = hosts_of({{"a", 1}, {"b", 1}});
  EXPECT_TRUE(judge_preflight(records(2, {{}, {{"shm", "64 MiB"}}}), alone, true).warnings.empty());
  // NCCL on loopback or docker0 between hosts; NCCL_SOCKET_IFNAME against MPI's pinned interface.
  v = judge_preflight(records(4, {{}, {}, {{"nccl_if", "auto: docker0"}}, {{"nccl_if", "NCCL_SOCKET_IFNAME=lo"}}}), t, true);
  ASSERT_EQ(v.warnings.size(), 1u);
  EXPECT_TRUE(any_has(v.warnings, "NCCL would use auto: docker0 on host b (ranks 2-3)")) << v.warnings[0];
  EXPECT_TRUE(judge_preflight(records(4, {{}, {}, {{"nccl_if", "auto: docker0"}}}), t, false)
                  .warnings.empty());  // the MPI backend: NCCL is not used
  v = judge_preflight(records(4, {{{"nccl_if", "NCCL_SOCKET_IFNAME=eth0"}, {"mpi_if", "UCX_NET_DEVICES=eth1"}}}), t, true);
  ASSERT_EQ(v.warnings.size(), 1u);
  EXPECT_TRUE(any_has(v.warnings, "NCCL_SOCKET_IFNAME=eth0 but MPI is pinned to UCX_NET_DEVICES=eth1")) << v.warnings[0];
  EXPECT_TRUE(judge_preflight(records(4, {{{"nccl_if", "NCCL_SOCKET_IFNAME==eth1"}, {"mpi_if", "UCX_NET_DEVICES=eth1:1"}}}),
                              t, true).warnings.empty());
}

TEST(PreflightJudge, ALauncherLocalRankThatDisagreesWithMpiIsNamed) {
  // MPIR_CVAR_NOLOCAL=1: MPI makes every rank a node of its own while hydra says local ranks 0, 1.
  Topology t = hosts_of({{"n", 1}, {"n", 1}});
  const PreflightVerdict v =
      judge_preflight(records(2, {{{"local_rank", "MPI_LOCALRANKID=0"}}, {{"local_rank", "MPI_LOCALRANKID=1"}}}), t, false);
  ASSERT_EQ(v.warnings.size(), 1u);
  EXPECT_TRUE(any_has(v.warnings, "rank 1 has MPI_LOCALRANKID=1, MPI's split says 0.")) << v.warnings[0];
  const Topology ok = hosts_of({{"a", 2}});
  EXPECT_TRUE(judge_preflight(records(2, {{{"local_rank", "MPI_LOCALRANKID=0"}}, {{"local_rank", "MPI_LOCALRANKID=1"}}}),
                              ok, false).warnings.empty());
}

// ---- memory_plan.h ----------------------------------------------------------------------------

namespace {
MemoryInputs made_up() {
  MemoryInputs in;
  in.params = 1000;
  in.largest_block = 100;
  in.outside_params = 150;
  in.n_layer = 4;
  in.dp = 4;
  in.bucket_mb = 1e-3;  // 1048.576 bytes: zero 2 keeps two buckets in flight
  in.block_none = 100, in.block_selective = 40, in.block_full = 10, in.outside = 50;
  return in;
}
}  // namespace

TEST(MemoryPlan, ModelStatePerStageAsDocumented) {
  const MemoryInputs in = made_up();
  const auto rows = memory_rows(in);
  ASSERT_EQ(rows.size(), 12u);  // zero 0-3 x none, selective, full
  const MemoryRow z0 = memory_row(in, 0, "none");  // 4 + 4 + 8 bytes per parameter, flat buckets 4
  EXPECT_EQ(z0.weights, 4000);
  EXPECT_EQ(z0.gradients, 4000);
  EXPECT_EQ(z0.buffers, 4000);
  EXPECT_EQ(z0.optimizer, 8000);
  const MemoryRow z1 = memory_row(in, 1, "none");  // the moments over dp, the received shard beside the buckets
  EXPECT_EQ(z1.optimizer, 2000);
  EXPECT_EQ(z1.buffers, 5000);
  EXPECT_EQ(z1.gradients, 4000);
  const MemoryRow z2 = memory_row(in, 2, "none");  // the gradient shard, two buckets in flight
  EXPECT_EQ(z2.gradients, 1000);
  EXPECT_DOUBLE_EQ(z2.buffers, 2 * 1e-3 * 1024 * 1024);
  EXPECT_EQ(z2.optimizer, 2000);
  EXPECT_EQ(z2.weights, 4000);
  // The weight shard, the parameters outside the blocks and two blocks gathered (the one running,
  // the next prefetched); the outside unit's gradient and three blocks' in the buckets.
  const MemoryRow z3 = memory_row(in, 3, "none");
  EXPECT_EQ(z3.weights, 1000 + 600 + 2 * 400);
  EXPECT_EQ(z3.buffers, 600 + 3 * 400);
  EXPECT_EQ(z3.gradients, 1000);
  EXPECT_EQ(z3.optimizer, 2000);
}

// Expert parallelism: this rank's experts (400 of its 1000 elements) stay whole under ZeRO-1/2/3,
// their gradients in flat buckets of their own (made_up's blocks and outside: the others').
TEST(MemoryPlan, ExpertsStayWholeUnderZero) {
  MemoryInputs in = made_up();
  in.whole_params = 400;
  const auto rows = memory_rows(in);
  ASSERT_EQ(rows.size(), 12u);
  EXPECT_EQ(memory_row(in, 0, "none").optimizer, 8000);
  const MemoryRow z1 = memory_row(in, 1, "none");
  EXPECT_EQ(z1.optimizer, 8 * (600 / 4 + 400));
  EXPECT_EQ(z1.buffers, 4000 + 4 * 600 / 4);
  EXPECT_EQ(z1.gradients, 4000);
  const MemoryRow z2 = memory_row(in, 2, "none");
  EXPECT_EQ(z2.gradients, 4 * 600 / 4 + 4 * 400);
  EXPECT_DOUBLE_EQ(z2.buffers, 2 * 1e-3 * 1024 * 1024 + 4 * 400);
  EXPECT_EQ(z2.optimizer, z1.optimizer);
  const MemoryRow z3 = memory_row(in, 3, "none");  // the shared shard, outside and two blocks; the experts
  EXPECT_EQ(z3.weights, 4 * 600 / 4 + 600 + 2 * 400 + 4 * 400);
  EXPECT_EQ(z3.gradients, z2.gradients);
  EXPECT_EQ(z3.buffers, 600 + 3 * 400 + 4 * 400);
  EXPECT_EQ(z3.optimizer, z1.optimizer);
}

TEST(MemoryPlan, OneRankShardsNothing) {
  MemoryInputs in = made_up();
  in.dp = 1;
  for (const auto& r : memory_rows(in)) {
    EXPECT_EQ(r.weights, 4000) << r.zero;
    EXPECT_EQ(r.gradients, 4000) << r.zero;
    EXPECT_EQ(r.buffers, 0) << r.zero;  // GradSync does nothing with one rank
    EXPECT_EQ(r.optimizer, 8000) << r.zero;
  }
}

TEST(MemoryPlan, ActivationsScaleByBlocksAndCheckpointing) {
  MemoryInputs in = made_up();
  EXPECT_EQ(memory_row(in, 0, "none").activations, 4 * 100 + 50);
  // Each checkpointed block keeps its input; one block runs again in backward with its activations.
  EXPECT_EQ(memory_row(in, 0, "full").activations, 4 * 10 + 100 + 50);
  EXPECT_EQ(memory_row(in, 0, "selective").activations, 4 * 40 + 100 + 50);
  in.ac_every = 2;  // blocks 1 and 3 checkpointed
  EXPECT_EQ(memory_row(in, 0, "full").activations, 2 * 100 + 2 * 10 + 100 + 50);
  EXPECT_EQ(memory_row(in, 0, "selective").activations, 2 * 100 + 2 * 40 + 100 + 50);
  in.ac_every = 5;  // more than the blocks: none checkpointed
  EXPECT_EQ(memory_row(in, 0, "full").activations, memory_row(in, 0, "none").activations);
}

TEST(MemoryPlan, RecommendsTheFastestLayoutThatFitsAndSaysWhy) {
  MemoryInputs in = made_up();
  in.params = 1 << 28;  // 1 GiB per 4 bytes
  in.largest_block = 1 << 24;
  in.outside_params = 0;
  in.bucket_mb = 25;
  in.block_none = 1 << 28, in.block_selective = 1 << 26, in.block_full = 1 << 20, in.outside = 0;
  const double gib = 1024.0 * 1024 * 1024;
  // 4N = 1 GiB. zero 1 + none: 1 + 1 + (1 + 0.25) + 0.5 + 1 (4 blocks x 0.25) = 4.75 GiB;
  // zero 2 + none: 1 + 0.25 + 50 MiB + 0.5 + 1 = 2.80 GiB; zero 2 + full: 2.05 GiB; zero 3 + full: 1.57 GiB
  // (0.25 + 0.125 weights: the shard and two 64 MiB blocks; 0.25 + 0.1875 + 0.5 + 0.254).
  EXPECT_NEAR(memory_row(in, 2, "none").peak() / gib, 2.7988, 1e-3);
  EXPECT_NEAR(memory_row(in, 3, "full").peak() / gib, 1.5664, 1e-3);
  const std::string text = memory_report(in, 3, "--memory");
  EXPECT_NE(text.find("memory recommendation (--memory: 3 GiB): optim.zero: 2, train.activation_checkpointing: none"),
            std::string::npos) << text;
  EXPECT_NE(text.find("zero 0 + none needs 6144 MiB"), std::string::npos) << text;
  EXPECT_NE(text.find("zero 1 + none needs 4864 MiB"), std::string::npos) << text;
  // 2.2 GiB: no layout without checkpointing fits; zero 3 + selective (1.81 GiB: 4 blocks x 64 MiB
  // + one block's 256 MiB recomputed) comes before any full checkpointing.
  EXPECT_NEAR(memory_row(in, 3, "selective").peak() / gib, 1.8125, 1e-3);
  const std::string selective_fits = memory_report(in, 2.2, "--memory");
  EXPECT_NE(selective_fits.find("optim.zero: 3, train.activation_checkpointing: selective"), std::string::npos)
      << selective_fits;
  EXPECT_NE(selective_fits.find("zero 2 + selective needs 2354 MiB"), std::string::npos) << selective_fits;
  // 1.8 GiB: only zero 3 + full checkpointing (1.57 GiB) fits; 1.4 GiB: nothing, said with why.
  const std::string z3_fits = memory_report(in, 1.8, "--memory");
  EXPECT_NE(z3_fits.find("optim.zero: 3, train.activation_checkpointing: full"), std::string::npos) << z3_fits;
  EXPECT_NE(z3_fits.find("zero 3 + none needs 2368 MiB"), std::string::npos) << z3_fits;
  const std::string none_fit = memory_report(in, 1.4, "--memory");
  EXPECT_NE(none_fit.find("no layout fits"), std::string::npos) << none_fit;
  EXPECT_NE(none_fit.find("zero 3 + full needs 1604 MiB"), std::string::npos) << none_fit;
  // No limit: the table only.
  EXPECT_NE(memory_report(in, 0, "").find("no recommendation"), std::string::npos);
  EXPECT_NE(text.find("| 3 | full |"), std::string::npos) << text;
}
