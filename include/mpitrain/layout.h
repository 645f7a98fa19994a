// The parallel layout of a job, as numbers (torchtitan's ParallelDims): world = dp x tp. Rank r
// has tensor-parallel coordinate r % tp and data-parallel coordinate r / tp, so a tp group is tp
// consecutive ranks, and those must share a host (tensor parallelism talks every layer; it
// belongs on NVLink, never on the network). The dp group of rank r is every rank with r's tp
// coordinate. Torch- and MPI-free: the rules are unit-tested on hand-made topologies; mesh.h
// builds the communicators.
#pragma once

#include <string>
#include <vector>

#include "mpitrain/mpi_env.h"

namespace mpitrain {

struct MeshLayout {
  int world = 1;
  int dp = 1;
  int tp = 1;

  int dp_rank(int rank) const { return rank / tp; }
  int tp_rank(int rank) const { return rank % tp; }
  // The ranks of rank's tp group and of its dp group, ascending.
  std::vector<int> tp_group(int rank) const;
  std::vector<int> dp_group(int rank) const;

  // "mesh: 4 ranks = dp 2 x tp 2; tp groups hostA[0-1] hostB[2-3]" (tp 1: "mesh: 4 ranks = dp 4")
  std::string describe(const Topology& topo) const;
};

// The layout for parallel.tp = `tp` on `topo`. UsageError naming parallel.tp, and the host where
// it applies, when tp does not divide the world size or a tp group would span hosts.
MeshLayout plan_layout(const Topology& topo, int64_t tp);

}  // namespace mpitrain
