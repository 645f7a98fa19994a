// Which device a rank trains on, from MPI's host split alone: local rank r uses GPU r of those
// the process can see (CUDA_VISIBLE_DEVICES is honoured by CUDA itself, so "GPU r" is the r-th
// visible one). Torch-free so the rule is unit-tested on machines without GPUs.
#pragma once

#include <chrono>
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
// Local rank r takes visible GPU r % gpus. UsageError (key train.device) for cuda without GPUs.
// Two ranks on one physical GPU under NCCL is refused later, by the pre-flight's bus ids
// (preflight.h): a rank only sees its own GPUs, so only all ranks together can tell.
DeviceChoice choose_device(const std::string& requested, const std::string& backend, int gpus,
                           int local_rank, int local_size, const std::string& host);

// Peak bytes libtorch's CUDA caching allocator has handed out on `device` (what PyTorch's
// torch.cuda.max_memory_allocated reports); -1 in CPU builds.
int64_t cuda_peak_allocated_bytes(int device);

// Bytes libtorch's CUDA caching allocator has handed out on `device` now (torch.cuda.memory_allocated),
// and the device's whole memory (cudaMemGetInfo's total); -1 in CPU builds.
int64_t cuda_allocated_bytes(int device);
int64_t cuda_total_memory_bytes(int device);

// The GPU's name as CUDA reports it ("NVIDIA H100 80GB HBM3"); "" in CPU builds.
std::string cuda_device_name(int device);

// ---- timing spans of the device's work ---------------------------------------------------------
// CUDA events on the current stream (cuda_stats.cpp); never created in CPU builds.
struct CudaSpans;
CudaSpans* cuda_spans_new(int device);
void cuda_spans_delete(CudaSpans* spans);
void cuda_spans_begin(CudaSpans& spans);
void cuda_spans_end(CudaSpans& spans);
double cuda_spans_take_seconds(CudaSpans& spans);  // waits for the recorded events

// Sums the time the device's work spends between begin() and end(), e.g. the wait for gradient
// communication that backward did not hide. On a GPU the host only queues work, so the span is
// measured by CUDA events on the current stream: from when the stream reaches begin() (backward
// done) to when it reaches end() (the last all-reduce waited for). On the CPU, the host clock.
class SpanTimer {
 public:
  SpanTimer(bool cuda, int device) : cuda_(cuda ? cuda_spans_new(device) : nullptr) {}
  ~SpanTimer() {
    if (cuda_) cuda_spans_delete(cuda_);
  }
  SpanTimer(const SpanTimer&) = delete;
  SpanTimer& operator=(const SpanTimer&) = delete;
  void begin() {
    if (cuda_) cuda_spans_begin(*cuda_);
    else t0_ = Clock::now();
  }
  void end() {
    if (cuda_) cuda_spans_end(*cuda_);
    else seconds_ += std::chrono::duration<double>(Clock::now() - t0_).count();
  }
  // The sum since the last call (on a GPU: after the spans' work has run).
  double take_seconds() {
    const double s = cuda_ ? cuda_spans_take_seconds(*cuda_) : seconds_;
    seconds_ = 0;
    return s;
  }

 private:
  using Clock = std::chrono::steady_clock;
  CudaSpans* cuda_;
  Clock::time_point t0_;
  double seconds_ = 0;
};

}  // namespace mpitrain
