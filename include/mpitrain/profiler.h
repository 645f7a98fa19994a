// log.profile_start / log.profile_steps: libtorch's profiler around a few training steps on
// rank 0, for finding where a step's time goes (bench/profile_summary.py tabulates the trace).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace mpitrain {

// Profiles steps [first, first + count) (1-based step numbers; first 0 = off) with every libtorch
// operator on the CPU and, where libtorch has Kineto with CUPTI (CUDA builds), every GPU kernel
// and copy. The profile is written when the last of those steps ends (or the run ends first) to
// `path` as a Chrome trace (chrome://tracing, Perfetto): complete events with "cat" cpu_op,
// user_annotation (one "ProfilerStep#N" per step) or gpu, times in microseconds. Where libtorch
// can save Kineto's own trace it is written beside it as <path without .json>.kineto.json
// (TensorBoard's profiler plugin reads it).
class StepProfiler {
 public:
  StepProfiler(int64_t first, int64_t count, std::string path, int gpu);  // gpu: CUDA index, -1 = CPU
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  void begin_step(int64_t step);  // the step about to run
  void end_step(int64_t step);    // the step that just finished (after its optimizer update)

 private:
  void finish();
  struct Active;
  int64_t first_, count_;
  std::string path_;
  int gpu_;
  std::unique_ptr<Active> active_;
};

}  // namespace mpitrain
