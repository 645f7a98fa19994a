// Device per rank from MPI's host split (device.h): local rank r -> GPU r, CUDA_VISIBLE_DEVICES
// named in the description, too many ranks for the GPUs refused unless the MPI backend shares.
#include <gtest/gtest.h>

#include <cstdlib>

#include "mpitrain/device.h"
#include "mpitrain/error.h"
#include "mpitrain/layout.h"

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

TEST(Device, MoreRanksThanGpusIsAnErrorNamingTheHost) {
  try {
    choose_device("auto", "auto", 2, 2, 3, "gpu-node7");
    FAIL() << "no error";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("train.device"), std::string::npos) << msg;
    EXPECT_NE(msg.find("host gpu-node7 runs 3 ranks but has 2 GPUs"), std::string::npos) << msg;
    EXPECT_NE(msg.find("comm.backend: mpi"), std::string::npos) << msg;
  }
  EXPECT_THROW(choose_device("cuda", "nccl", 1, 1, 2, "h"), UsageError);
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
