// Device per rank from MPI's host split (device.h): local rank r -> GPU r, CUDA_VISIBLE_DEVICES
// named in the description, too many ranks for the GPUs refused unless the MPI backend shares.
#include <gtest/gtest.h>

#include <cstdlib>

#include "mpitrain/device.h"
#include "mpitrain/error.h"

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
