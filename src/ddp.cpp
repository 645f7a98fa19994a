// Bucketed gradient all-reduce, optionally overlapped with backward (see ddp.h).
#include "mpitrain/ddp.h"

namespace mpitrain {

GradSync::GradSync(std::vector<torch::Tensor> params, Communicator& comm, double bucket_mb, bool overlap)
    : params_(std::move(params)), comm_(comm), overlap_(overlap && comm.size() > 1) {
  const double limit = bucket_mb * 1024.0 * 1024.0;
  bucket_of_.assign(params_.size(), 0);
  offset_.assign(params_.size(), 0);
  seen_.assign(params_.size(), false);
  buckets_.emplace_back();
  double bytes = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    const double b = static_cast<double>(p.numel() * p.element_size());
    if (!buckets_.back().params.empty() && bytes + b > limit) {
      buckets_.emplace_back();
      bytes = 0;
    }
    buckets_.back().params.push_back(k);
    bytes += b;
  }
  if (buckets_.back().params.empty()) buckets_.pop_back();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    auto& bucket = buckets_[b];
    int64_t n = 0;
    for (size_t k : bucket.params) {
      bucket_of_[k] = b;
      offset_[k] = static_cast<size_t>(n);
      n += params_[k].numel();
    }
    bucket.flat = torch::empty({n}, params_[bucket.params.front()].options().requires_grad(false));
  }
  if (overlap_)
    for (size_t k = 0; k < params_.size(); ++k) {
      // A leaf's hook sees the gradient of this backward (all its uses summed), before it is
      // accumulated into .grad(); returning an undefined tensor leaves the gradient unchanged.
      unsigned h = params_[k].register_hook([this, k](torch::Tensor grad) -> torch::Tensor {
        on_grad(k, grad);
        return torch::Tensor();
      });
      hooks_.emplace_back(k, h);
    }
}

GradSync::~GradSync() {
  for (auto& [k, h] : hooks_) params_[k].remove_hook(h);
  for (auto& b : buckets_)
    if (b.work) b.work->wait();
}

void GradSync::arm() {
  if (!overlap_) return;
  armed_ = true;
  next_launch_ = 0;
  launched_in_backward_ = 0;
  for (auto& b : buckets_) b.ready = 0;
  std::fill(seen_.begin(), seen_.end(), false);
}

void GradSync::on_grad(size_t k, const torch::Tensor& grad) {
  if (!armed_ || seen_[k]) return;
  torch::NoGradGuard no_grad;
  seen_[k] = true;
  auto& p = params_[k];
  Bucket& b = buckets_[bucket_of_[k]];
  auto slot = b.flat.narrow(0, static_cast<int64_t>(offset_[k]), p.numel());
  slot.copy_(grad.reshape({-1}));
  if (p.grad().defined()) slot.add_(p.grad().reshape({-1}));  // earlier micro-steps of this step
  if (++b.ready == b.params.size()) {
    const size_t before = next_launch_;
    launch_ready();
    launched_in_backward_ += next_launch_ - before;
  }
}

void GradSync::fill_slot(size_t k) {
  auto& p = params_[k];
  auto slot = buckets_[bucket_of_[k]].flat.narrow(0, static_cast<int64_t>(offset_[k]), p.numel());
  if (p.grad().defined()) slot.copy_(p.grad().reshape({-1}));
  else slot.zero_();
}

void GradSync::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready == buckets_[next_launch_].params.size())
    launch(buckets_[next_launch_++]);
}

void GradSync::launch(Bucket& b) { b.work = comm_.all_reduce_async(b.flat, ReduceOp::avg); }

void GradSync::all_reduce_grads() {
  if (comm_.size() == 1) return;
  torch::NoGradGuard no_grad;
  if (overlap_ && armed_) {
    // Buckets backward did not complete: parameters unused in this step contribute zeros.
    for (; next_launch_ < buckets_.size(); ++next_launch_) {
      Bucket& b = buckets_[next_launch_];
      for (size_t k : b.params)
        if (!seen_[k]) fill_slot(k);
      launch(b);
    }
    armed_ = false;
  } else {
    for (auto& b : buckets_) {
      for (size_t k : b.params) fill_slot(k);
      launch(b);
    }
  }
  for (auto& b : buckets_) {
    b.work->wait();
    b.work.reset();
    for (size_t k : b.params) {
      auto& p = params_[k];
      auto avg = b.flat.narrow(0, static_cast<int64_t>(offset_[k]), p.numel()).view(p.sizes());
      if (p.grad().defined()) p.mutable_grad().copy_(avg);
      else p.mutable_grad() = avg.clone();
    }
  }
}

}  // namespace mpitrain
