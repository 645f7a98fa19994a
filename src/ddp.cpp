// Bucketed gradient all-reduce (see ddp.h).
#include "mpitrain/ddp.h"

namespace mpitrain {

GradSync::GradSync(std::vector<torch::Tensor> params, Communicator& comm, double bucket_mb)
    : params_(std::move(params)), comm_(comm) {
  const double limit = bucket_mb * 1024.0 * 1024.0;
  Bucket current;
  double bytes = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    const double b = static_cast<double>(p.numel() * p.element_size());
    if (!current.params.empty() && bytes + b > limit) {
      buckets_.push_back(std::move(current));
      current = Bucket{};
      bytes = 0;
    }
    current.params.push_back(k);
    bytes += b;
  }
  if (!current.params.empty()) buckets_.push_back(std::move(current));
  for (auto& bucket : buckets_) {
    int64_t n = 0;
    for (size_t k : bucket.params) n += params_[k].numel();
    bucket.flat = torch::empty({n}, params_[bucket.params.front()].options());
  }
}

void GradSync::all_reduce_grads() {
  if (comm_.size() == 1) return;
  torch::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    int64_t off = 0;
    for (size_t k : bucket.params) {
      auto& p = params_[k];
      auto slot = bucket.flat.narrow(0, off, p.numel());
      if (p.grad().defined()) slot.copy_(p.grad().reshape({-1}));
      else slot.zero_();
      off += p.numel();
    }
    comm_.all_reduce(bucket.flat, ReduceOp::avg);
    off = 0;
    for (size_t k : bucket.params) {
      auto& p = params_[k];
      auto slot = bucket.flat.narrow(0, off, p.numel()).view(p.sizes());
      if (p.grad().defined()) p.mutable_grad().copy_(slot);
      else p.mutable_grad() = slot.clone();
      off += p.numel();
    }
  }
}

}  // namespace mpitrain
