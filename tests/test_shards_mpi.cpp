// TokenDataset under a real mpirun: each rank's batch slices are disjoint, together they are the
// global window order a single reader sees (so the order does not depend on the world size), and
// a fresh reader resumed from a cursor continues exactly where the old one was.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>

#include "mpitrain/shards.h"
#include "mpi_world.h"

using namespace mpitrain;
namespace fs = std::filesystem;

namespace {

// ---- fixture: shards written by rank 0 into a temp dir every rank can see ----------------------

class ShardsMpi : public ::testing::Test {
 protected:
  static constexpr int64_t kSeq = 8;
  static constexpr int64_t kRows = 3;
  static constexpr uint64_t kSeed = 11;

  void SetUp() override {
    rank_ = world_rank();
    world_ = world_size();
    char buf[256] = {};
    if (rank_ == 0) {
      std::strcpy(buf, "/tmp/mpitrain-shards-mpi-XXXXXX");
      if (!::mkdtemp(buf)) buf[0] = '\0';
      // Distinct tokens throughout, so a window's first token identifies it.
      try {
        uint32_t next = 0;
        int index = 0;
        for (uint32_t n : {1201u, 677u, 2345u}) {
          std::vector<uint32_t> t(n);
          for (auto& x : t) x = next++;
          ShardMeta m;
          m.vocab_size = 70000;
          m.tokenizer = "test";
          write_shard(std::string(buf) + "/s-train-0000" + std::to_string(index++) + ".h5", t, {},
                      m);
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        buf[0] = '\0';  // the other ranks must still get past the broadcast
      }
    }
    mpi::broadcast(buf, sizeof buf, 0, mpi::world());
    dir_ = buf;
    ASSERT_FALSE(dir_.empty());
    paths_ = expand_shard_paths({dir_}, "data.train");
    ASSERT_EQ(paths_.size(), 3u);
  }

  void TearDown() override {
    mpi::barrier(mpi::world());  // nobody may still be opening a shard
    std::error_code ec;
    if (rank_ == 0 && !dir_.empty()) fs::remove_all(dir_, ec);
  }

  // Everyone's slice of one micro-step, in rank order (every rank gets the whole step).
  std::vector<int32_t> gather_step(const TokenDataset& ds, uint64_t start) const {
    const int64_t per_rank = kRows * (kSeq + 1);
    std::vector<int32_t> mine(static_cast<size_t>(per_rank));
    ds.batch(start, rank_, kRows, mine.data());
    std::vector<int32_t> all(static_cast<size_t>(per_rank * world_));
    mpi::all_gather(mine.data(), all.data(), mine.size() * sizeof(int32_t), mpi::world());
    return all;
  }

  int rank_ = 0, world_ = 1;
  std::string dir_;
  std::vector<std::string> paths_;
};

// ---- tests -------------------------------------------------------------------------------------

TEST_F(ShardsMpi, SlicesPartitionTheGlobalOrder) {
  TokenDataset ds(paths_, kSeq, kSeed, true);
  const uint64_t n = ds.num_windows();
  EXPECT_EQ(n, 1200u / 8 + 676u / 8 + 2344u / 8);
  const uint64_t step = static_cast<uint64_t>(kRows * world_);
  const uint64_t steps = (3 * n / 2) / step + 1;  // past the first epoch boundary

  std::vector<int64_t> first_token;  // by global window index, as gathered from all ranks
  size_t mismatches = 0;
  std::vector<int32_t> single(static_cast<size_t>(step * (kSeq + 1)));
  for (uint64_t s = 0; s < steps; ++s) {
    const uint64_t start = s * step;
    // Each rank also reports the global indices it read: together exactly [start, start+step).
    std::vector<uint64_t> mine(kRows), all_idx(step);
    for (int64_t i = 0; i < kRows; ++i)
      mine[static_cast<size_t>(i)] = start + static_cast<uint64_t>(rank_ * kRows + i);
    mpi::all_gather(mine.data(), all_idx.data(), mine.size() * sizeof(uint64_t), mpi::world());
    for (uint64_t i = 0; i < step; ++i) mismatches += all_idx[i] != start + i;

    // The ranks' slices, concatenated, are what one reader with rows*world rows gets.
    std::vector<int32_t> all = gather_step(ds, start);
    ds.batch(start, 0, static_cast<int64_t>(step), single.data());
    mismatches += all != single;
    for (uint64_t i = 0; i < step; ++i) {
      const int32_t* w = all.data() + i * (kSeq + 1);
      for (int64_t j = 0; j < kSeq; ++j) mismatches += w[j + 1] != w[j] + 1;  // one shard, in order
      first_token.push_back(w[0]);
    }
  }
  EXPECT_EQ(mismatches, 0u);

  // Disjoint slices: the first epoch visits every window exactly once; so does the second.
  ASSERT_GE(first_token.size(), n + n / 2);
  std::set<int64_t> epoch0(first_token.begin(), first_token.begin() + static_cast<int64_t>(n));
  EXPECT_EQ(epoch0.size(), n);
  std::set<int64_t> epoch1(first_token.begin() + static_cast<int64_t>(n), first_token.end());
  EXPECT_EQ(epoch1.size(), first_token.size() - n);
  for (int64_t t : epoch1) EXPECT_TRUE(epoch0.count(t)) << t;

  // The order itself is the same on every rank (and so under any world size): compare a digest.
  uint64_t digest = 1469598103934665603ull;
  for (int64_t t : first_token) digest = (digest ^ static_cast<uint64_t>(t)) * 1099511628211ull;
  std::vector<uint64_t> digests(static_cast<size_t>(world_));
  mpi::all_gather(&digest, digests.data(), sizeof digest, mpi::world());
  const auto [lo, hi] = std::minmax_element(digests.begin(), digests.end());
  EXPECT_EQ(*lo, *hi);
}

TEST_F(ShardsMpi, ResumeFromCursorContinuesExactly) {
  const uint64_t step = static_cast<uint64_t>(kRows * world_);
  TokenDataset running(paths_, kSeq, kSeed, true);
  const uint64_t done = running.num_windows() / step - 1;  // resume just before an epoch ends
  for (uint64_t s = 0; s < done; ++s) gather_step(running, s * step);
  const uint64_t cursor = done * step;  // what a checkpoint saves

  // A fresh reader (the restarted job) from the cursor vs. the old one carrying on; and the
  // same windows for a job restarted on one rank with rows*world rows.
  TokenDataset resumed(paths_, kSeq, kSeed, true);
  std::vector<int32_t> single(static_cast<size_t>(step * (kSeq + 1)));
  size_t mismatches = 0;
  for (uint64_t s = 0; s < 4; ++s) {
    const uint64_t start = cursor + s * step;
    std::vector<int32_t> a = gather_step(running, start), b = gather_step(resumed, start);
    resumed.batch(start, 0, static_cast<int64_t>(step), single.data());
    mismatches += (a != b) + (a != single);
  }
  EXPECT_EQ(mismatches, 0u);
}

}  // namespace
