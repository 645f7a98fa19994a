// `mpitrain netcheck`: what the launch sees, run under the same mpirun as training. Prints the
// host map, ranks and GPUs per host, the network interfaces of each host and the ones MPI was
// told to use, point-to-point latency and bandwidth between hosts, all-reduce bus bandwidth over
// message sizes (nccl-tests' definition: busbw = algbw x 2(n-1)/n), per-rank memory bandwidth,
// the pre-flight record of every rank (preflight.h), and flags links and ranks far below the
// median. Exit code 1 on inconsistency (different binaries, a pre-flight error), else 0. It replaces the hand-run network scripts users write today.
#pragma once

#include "mpitrain/mpi_ops.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mpitrain/mpi_env.h"
#include "mpitrain/preflight.h"

namespace mpitrain {

struct NetcheckOptions {
  int64_t max_bytes = 64 << 20;  // largest all-reduce message
  int64_t p2p_bytes = 16 << 20;  // point-to-point bandwidth message
  int iters = 10;                // timed repetitions per measurement (more for small messages)
  double slow_factor = 0.5;      // flag links/ranks below this fraction of the median
};

// NCCL's socket interface follows the one MPI was told to use: when NCCL_SOCKET_IFNAME is unset
// and OMPI_MCA_btl_tcp_if_include names interfaces or CIDR ranges (or, for MPICH, UCX_NET_DEVICES
// or FI_TCP_IFACE names network interfaces), sets NCCL_SOCKET_IFNAME to the matching local
// interface names (exact match). Returns the value now in force ("" = NCCL's own
// choice).
std::string follow_mpi_interface_for_nccl();

// parallel.islands: auto: the bandwidth in Gbit/s between every pair of hosts, on every rank: the
// hosts' first ranks ping-pong `bytes` twice after a small warm-up, disjoint pairs at once (a
// round-robin of hosts - 1 rounds). Collective over `comm`.
std::vector<std::vector<double>> host_bandwidths(MpiComm comm, const Topology& topo, int64_t bytes);

// Collective over `comm`; rank 0 prints. `local_gpus` is the number of GPUs this rank sees;
// `torch_version` and `gpu_facts` (of a device index, -1 = none) fill the pre-flight record,
// printed as a table of every distinct value with its ranks.
int run_netcheck(const NetcheckOptions& opts, MpiComm comm, int local_gpus, const std::string& torch_version,
                 const std::function<GpuFacts(int)>& gpu_facts);

}  // namespace mpitrain
