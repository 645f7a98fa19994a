// Which device a rank trains on, from MPI's host split alone: local rank r uses GPU r of those
// the process can see (CUDA_VISIBLE_DEVICES is honoured by CUDA itself, so "GPU r" is the r-th
// visible one). Torch-free so the rule is unit-tested on machines without GPUs.
#pragma once

#include <cstdint>
#include <string>

namespace mpitrain {

struct DeviceChoice {
  bool cuda = false;
  int index = -1;         // CUDA device index (cuda only)
  bool shared = false;    // more ranks than GPUs on this host share them (MPI backend only)
  std::string describe;   // "cpu" or "cuda:1 (CUDA_VISIBLE_DEVICES=2,3: physical GPU 3)"
};

// `requested` is train.device (auto | cpu | cuda), `backend` comm.backend, `gpus` the GPUs this
// process sees on `host`, where it is local rank `local_rank` of `local_size`.
// UsageError (key train.device) for cuda without GPUs, and for more ranks on a host than GPUs
// unless comm.backend is mpi (then ranks share GPUs round-robin).
DeviceChoice choose_device(const std::string& requested, const std::string& backend, int gpus,
                           int local_rank, int local_size, const std::string& host);

// Peak bytes libtorch's CUDA caching allocator has handed out on `device` (what PyTorch's
// torch.cuda.max_memory_allocated reports); -1 in CPU builds.
int64_t cuda_peak_allocated_bytes(int device);

}  // namespace mpitrain
