// Pre-flight: before any NCCL communicator exists, every rank allgathers one fixed record of what
// it runs on (mpitrain build, libtorch, MPI library, CUDA runtime and driver, NCCL, GPU model and
// PCI bus id, /dev/shm, the interface NCCL will use, the launcher's idea of its local rank), and
// every rank draws the same conclusions from the same records:
//  - a difference that breaks training (another mpitrain build, libtorch, MPI library, CUDA
//    runtime or NCCL on some ranks) is an error naming the ranks and hosts that differ;
//  - two ranks on one GPU under NCCL is an error naming both ranks, the host and the bus id;
//  - a risk (a /dev/shm under 1 GiB where ranks share a host, NCCL about to use lo or docker0,
//    NCCL's interface not the one MPI was pinned to, another CUDA driver or GPU model on some
//    hosts, a launcher whose local rank disagrees with MPI's host split) is a warning with the fix.
// `train` logs one line of what all ranks agree on and the warnings; `mpitrain netcheck` prints
// the whole record as a table of every distinct value with its ranks. Torch-free: the GPU fields come from the caller (cuda_stats.cpp in GPU builds).
#pragma once

#include "mpitrain/mpi_ops.h"

#include <string>
#include <vector>

#include "mpitrain/mpi_env.h"

namespace mpitrain {

// What the GPU side knows; all empty in CPU builds or on the CPU.
struct GpuFacts {
  std::string cuda_runtime;  // "13.0"
  std::string cuda_driver;   // "13.0"
  std::string nccl;          // "2.28.3"
  std::string gpu;           // "NVIDIA H100 80GB HBM3"
  std::string bus_id;        // "0000:1b:00.0": which physical GPU this rank trains on
};

// GPU builds: cuda_stats.cpp asks the CUDA runtime and NCCL (`device` < 0: no GPU chosen, the
// versions only); CPU builds: all empty.
GpuFacts gpu_facts(int device);

// The record's fields, in the order printed. How a difference across ranks is treated:
//   kBreaks  the same on every rank or the job is refused (exit 2)
//   kWarns   differences are allowed but named (another driver or GPU model on some hosts)
//   kOwn     per rank or per host by nature (bus id, interface, /dev/shm, local rank): checked by
//            their own rules, not compared with rank 0
enum class PreflightRule { kBreaks, kWarns, kOwn };
struct PreflightFieldInfo {
  const char* key;    // the record's key, and the test hook's: MPITRAIN_TEST_PREFLIGHT=RANK:KEY=VALUE
  const char* label;  // as printed
  PreflightRule rule;
};
const std::vector<PreflightFieldInfo>& preflight_fields();

struct PreflightRecord {
  std::vector<std::string> values;  // one per preflight_fields() entry; "" = not applicable here

  const std::string& get(const std::string& key) const;
  std::string& at(const std::string& key);
};

// This rank's record. `torch_version` from the caller's libtorch headers.
PreflightRecord collect_preflight(const Topology& topo, const std::string& torch_version, const GpuFacts& gpu);

struct PreflightVerdict {
  std::vector<std::string> errors;    // each names the field, the ranks and hosts, the fix
  std::vector<std::string> warnings;  // each names the risk and the fix
  std::string summary;                // one line: what every rank agrees on
  std::vector<std::string> table;     // field | value | ranks (hosts), every distinct value
};

// Pure: the same records give every rank the same verdict. `nccl_backend`: whether NCCL will be
// used (the GPU-sharing and interface rules only matter then).
PreflightVerdict judge_preflight(const std::vector<PreflightRecord>& all, const Topology& topo, bool nccl_backend);

// Collective over `comm`: collects, allgathers and judges; prints nothing, throws nothing.
PreflightVerdict gather_preflight(MpiComm comm, const Topology& topo, const std::string& torch_version,
                                  const GpuFacts& gpu, bool nccl_backend);

// gather_preflight for a run: rank 0 logs the summary line and every warning once; an error is a UsageError on every rank (use
// it inside agree(), which prints it once).
PreflightVerdict run_preflight(MpiComm comm, const Topology& topo, const std::string& torch_version,
                               const GpuFacts& gpu, bool nccl_backend);

// The launcher's own idea of this process's local rank, when it says: the first set of
// OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), MPI_LOCALRANKID (hydra: MPICH, Intel MPI),
// PALS_LOCAL_RANKID (Cray PALS), MV2_COMM_WORLD_LOCAL_RANK (MVAPICH), SLURM_LOCALID (only for a
// task srun started directly: an mpirun inside a batch script inherits the batch step's 0).
// "" when none is set, else "NAME=VALUE".
std::string launcher_local_rank(int world_size);

}  // namespace mpitrain
