// Start-up consistency: before training, every rank fingerprints what it is about to run — the
// mpitrain binary, the resolved config and the shard list — and the ranks compare. A mismatch
// is the classic "code not synced on node 2": an error naming the odd hosts and ranks.
#pragma once

#include "mpitrain/mpi_ops.h"

#include <cstdint>
#include <string>
#include <vector>

#include "mpitrain/mpi_env.h"

namespace mpitrain {

// CRC-32 of this process's executable (/proc/self/exe), computed once.
uint32_t binary_fingerprint();

// CRC-32 of each shard's base name, size in bytes and modification-independent identity (name +
// size), in order.
uint32_t shard_list_fingerprint(const std::vector<std::string>& paths);

struct Fingerprints {
  uint32_t binary = 0;
  uint32_t config = 0;
  uint32_t shards = 0;
};

// Collective over `comm`. Returns one line per mismatch ("mpitrain binary differs on host nodeB
// (ranks 2-3) from rank 0's on nodeA"), empty when every rank agrees with rank 0.
std::vector<std::string> compare_fingerprints(MpiComm comm, const Topology& topo, const Fingerprints& mine);

// compare_fingerprints, throwing UsageError (identically on every rank) on any mismatch.
void check_consistency(MpiComm comm, const Topology& topo, const Fingerprints& mine);

}  // namespace mpitrain
