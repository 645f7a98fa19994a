// The parallel layout of a job, as numbers (torchtitan's ParallelDims): world = islands x pp x dp x tp.
// Pipeline stages (pp) are the outermost runs of consecutive ranks (stage s: ranks [s world / pp,
// (s + 1) world / pp)), so that a pipeline spans hosts and its stages' dp and tp groups stay
// within one stage; everything below applies within a stage, whose ranks are numbered from 0.
// Rank r has tensor-parallel coordinate r % tp, so a tp group is tp consecutive ranks, and those
// must share a host (tensor parallelism talks every layer; it belongs on NVLink, never on the
// network). Islands (DiLoCo, diloco.h; one without it) are runs of consecutive ranks; inside one,
// rank r's data-parallel coordinate is (r mod island size) / tp and its dp group every rank of the
// island with r's tp coordinate. Torch- and MPI-free: the rules are unit-tested on hand-made
// topologies; mesh.h builds the communicators.
#pragma once

#include <string>
#include <vector>

#include "mpitrain/mpi_env.h"

namespace mpitrain {

struct MeshLayout {
  int world = 1;
  int dp = 1;       // data-parallel ranks per island (the whole world's without islands)
  int tp = 1;
  int islands = 1;  // DiLoCo's islands (diloco.h): world = islands x pp x dp x tp, each island consecutive ranks
  // Expert parallelism (parallel.ep): each run of ep consecutive dp ranks is an ep group, whose
  // ranks hold one share of the experts each and exchange tokens (dp = ep groups x ep).
  int ep = 1;
  // Pipeline parallelism (parallel.pp, pipeline.h): the stages, each island's ranks in pp runs of
  // consecutive ranks (a pipeline inside each island).
  int pp = 1;

  int island_size() const { return world / islands; }
  int island(int rank) const { return rank / island_size(); }
  int stage_size() const { return island_size() / pp; }  // one stage's ranks in one island
  int stage(int rank) const { return (rank % island_size()) / stage_size(); }
  int dp_rank(int rank) const { return (rank % stage_size()) / tp; }  // within its island
  int tp_rank(int rank) const { return rank % tp; }
  // Data replicas over all islands: each reads its own windows (rank's is island x dp + dp_rank);
  // every stage of a pipeline reads its replica's.
  int replicas() const { return islands * dp; }
  int replica(int rank) const { return island(rank) * dp + dp_rank(rank); }
  // The rank's place in its ep group: its share of the experts.
  int ep_rank(int rank) const { return dp_rank(rank) % ep; }
  // The ranks of rank's tp group, of its dp group (its island's ranks with its tp coordinate), of
  // its replica group (every island's: the data order, evaluation) and of its island group (the
  // rank at its place in every island: DiLoCo's outer all-reduce), ascending.
  std::vector<int> tp_group(int rank) const;
  std::vector<int> dp_group(int rank) const;
  std::vector<int> replica_group(int rank) const;
  std::vector<int> island_group(int rank) const;
  // The ranks of rank's ep group (its dp group's run of ep ranks holding every expert between them)
  // and of its expert-replica group (its dp group's ranks holding the same experts), ascending.
  std::vector<int> ep_group(int rank) const;
  std::vector<int> expert_replica_group(int rank) const;
  // The ranks of rank's pipeline (the rank at its place in every stage), ascending: stage order.
  std::vector<int> pp_group(int rank) const;

  // "mesh: 4 ranks = dp 2 x tp 2; tp groups hostA[0-1] hostB[2-3]" (tp 1: "mesh: 4 ranks = dp 4";
  // islands: "mesh: 4 ranks = 2 islands x dp 2; islands hostA[0-1] hostB[2-3]")
  std::string describe(const Topology& topo) const;
};

// The layout for parallel.tp = `tp` and parallel.islands = `islands` (config.h's islands_count:
// -1 = one per host) on `topo`. UsageError naming the key, and the host where it applies, when tp
// does not divide the world size or a tp group would span hosts, or the islands do not divide the
// world into equal runs of whole tp groups.
// parallel.ep = `ep`: UsageError naming the key when it does not divide the data-parallel ranks.
// parallel.pp = `pp`: UsageError naming the key when it does not divide the world into stages of
// whole tp groups.
MeshLayout plan_layout(const Topology& topo, int64_t tp, int64_t islands = 1, int64_t ep = 1, int64_t pp = 1);

// parallel.islands: auto (docs/diloco.md). `gbit[i][j]`: the measured bandwidth between hosts i and
// j in Gbit/s (symmetric; the diagonal is not read). A link is slow when it is below `slow_gbit`
// (parallel.slow_link_gbit) or below a quarter of the fastest link; hosts joined by links that are
// not slow, directly or through other hosts, form a group. Returns each host's group, numbered in
// the order of the groups' first hosts.
std::vector<int> group_hosts(const std::vector<std::vector<double>>& gbit, double slow_gbit);
// The islands the groups make: every group's ranks one run of consecutive ranks, every group as
// many ranks. UsageError naming parallel.islands: auto and the groups otherwise.
int64_t islands_of_groups(const Topology& topo, const std::vector<int>& group);
// "slow-node1-slow-node2 9.6, slow-node1-slow-node3 0.1 (slow), ...; 2 islands: slow-node1 slow-node2 | slow-node3"
std::string describe_groups(const Topology& topo, const std::vector<std::vector<double>>& gbit,
                            const std::vector<int>& group, double slow_gbit);

}  // namespace mpitrain
