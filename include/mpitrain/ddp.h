// Data-parallel gradient averaging in size-bounded buckets.
//
// Parameters are grouped, in reverse registration order (the order backward produces their
// gradients), into buckets of at most bucket_mb MiB. After the last micro-step's backward each
// bucket's gradients are packed into one flat buffer, averaged across ranks with one all-reduce,
// and unpacked: a few large collectives instead of one per parameter. Non-final micro-steps of
// gradient accumulation do no communication at all.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "mpitrain/comm.h"

namespace mpitrain {

class GradSync {
 public:
  GradSync(std::vector<torch::Tensor> params, Communicator& comm, double bucket_mb);

  // Averages every parameter's .grad() across ranks (a no-op with one rank). Parameters with no
  // gradient contribute zeros, so every rank runs the same collectives.
  void all_reduce_grads();

  size_t num_buckets() const { return buckets_.size(); }

 private:
  struct Bucket {
    std::vector<size_t> params;  // indices into params_
    torch::Tensor flat;          // packed gradients
  };
  std::vector<torch::Tensor> params_;
  std::vector<Bucket> buckets_;
  Communicator& comm_;
};

}  // namespace mpitrain
