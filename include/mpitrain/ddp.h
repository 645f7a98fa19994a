// Data-parallel gradient averaging in size-bounded buckets.
//
// Parameters are grouped, in reverse registration order (roughly the order backward produces
// their gradients), into buckets of at most bucket_mb MiB; each bucket is averaged across ranks
// with one all-reduce of a flat buffer: a few large collectives instead of one per parameter.
// Non-final micro-steps of gradient accumulation do no communication at all.
//
// With overlap (comm.overlap, the default), a gradient hook on every parameter copies its
// gradient (plus what earlier micro-steps accumulated) into its bucket during the last
// micro-step's backward; when a bucket is complete, its all-reduce starts at once
// (Communicator::all_reduce_async: NCCL on its own stream), while backward goes on computing
// earlier layers. Buckets are always launched in bucket order, so every rank issues the same
// sequence of collectives whatever order its hooks fire in. all_reduce_grads() then launches the
// buckets that backward did not complete (parameters without a gradient contribute zeros), waits
// for all of them and writes the averages into .grad().
// Without overlap, everything happens in all_reduce_grads(), after backward.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "mpitrain/comm.h"

namespace mpitrain {

class GradSync {
 public:
  GradSync(std::vector<torch::Tensor> params, Communicator& comm, double bucket_mb, bool overlap);
  ~GradSync();
  GradSync(const GradSync&) = delete;  // the hooks hold `this`
  GradSync& operator=(const GradSync&) = delete;

  // Call before the backward whose gradients complete an optimizer step (the last micro-step).
  void arm();
  // Averages every parameter's .grad() across ranks (a no-op with one rank).
  void all_reduce_grads();

  size_t num_buckets() const { return buckets_.size(); }
  bool overlapping() const { return overlap_; }
  // Buckets whose all-reduce the hooks started during the last backward (tests, logging).
  size_t launched_during_backward() const { return launched_in_backward_; }

 private:
  struct Bucket {
    std::vector<size_t> params;  // indices into params_
    torch::Tensor flat;          // packed gradients
    size_t ready = 0;            // parameters whose gradient is in `flat` (overlap)
    std::unique_ptr<Work> work;  // the all-reduce in flight
  };
  void on_grad(size_t k, const torch::Tensor& grad);
  void fill_slot(size_t k);  // p.grad (or zeros) into its slot
  void launch_ready();
  void launch(Bucket& b);

  std::vector<torch::Tensor> params_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_, offset_;
  std::vector<bool> seen_;
  Communicator& comm_;
  bool overlap_;
  bool armed_ = false;
  size_t next_launch_ = 0;
  size_t launched_in_backward_ = 0;
  std::vector<std::pair<size_t, unsigned>> hooks_;  // (param, hook handle)
};

}  // namespace mpitrain
