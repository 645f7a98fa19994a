// `mpitrain netcheck`: what the launch sees, run under the same mpirun as training. Prints the
// host map, ranks and GPUs per host, the network interfaces of each host and the ones MPI was
// told to use, point-to-point latency and bandwidth between hosts, all-reduce bus bandwidth over
// message sizes (nccl-tests' definition: busbw = algbw x 2(n-1)/n), per-rank memory bandwidth,
// and flags links and ranks far below the median. Exit code 1 on inconsistency (different
// binaries across ranks), else 0. It replaces the hand-run network scripts users write today.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>

namespace mpitrain {

struct NetcheckOptions {
  int64_t max_bytes = 64 << 20;  // largest all-reduce message
  int64_t p2p_bytes = 16 << 20;  // point-to-point bandwidth message
  int iters = 10;                // timed repetitions per measurement (more for small messages)
  double slow_factor = 0.5;      // flag links/ranks below this fraction of the median
};

// NCCL's socket interface follows the one MPI was told to use: when NCCL_SOCKET_IFNAME is unset
// and OMPI_MCA_btl_tcp_if_include names interfaces or CIDR ranges, sets NCCL_SOCKET_IFNAME to the
// matching local interface names (exact match). Returns the value now in force ("" = NCCL's own
// choice).
std::string follow_mpi_interface_for_nccl();

// Collective over `comm`; rank 0 prints. `local_gpus` is the number of GPUs this rank sees.
int run_netcheck(const NetcheckOptions& opts, MPI_Comm comm, int local_gpus);

}  // namespace mpitrain
