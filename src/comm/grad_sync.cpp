// Bucketed gradient all-reduce, optionally overlapped with backward (see grad_sync.h).
#include "mpitrain/grad_sync.h"

#include "mpitrain/error.h"

namespace mpitrain {

GradSync::GradSync(std::vector<torch::Tensor> params, Communicator& comm, double bucket_mb, bool overlap, bool shard,
                   torch::ScalarType wire)
    : params_(std::move(params)), comm_(comm), overlap_(overlap && comm.size() > 1), shard_(shard) {
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
    const int64_t n_ranks = comm_.size();
    bucket.padded = shard_ ? (n + n_ranks - 1) / n_ranks * n_ranks : n;
    const auto options = params_[bucket.params.front()].options().requires_grad(false);
    // Padding stays zero: slots never cover it, and the all-gather writes zeros back into it.
    bucket.flat = shard_ ? torch::zeros({bucket.padded}, options) : torch::empty({n}, options);
    if (wire != options.dtype().toScalarType()) {
      bucket.wire = torch::zeros({bucket.flat.numel()}, options.dtype(wire));
      if (shard_) bucket.wire_shard = torch::zeros({bucket.padded / n_ranks}, options.dtype(wire));
    }
    if (!shard_) continue;
    bucket.shard = torch::zeros({bucket.padded / n_ranks}, options);
    const int64_t lo = comm_.rank() * (bucket.padded / n_ranks), hi = lo + bucket.padded / n_ranks;
    for (size_t k : bucket.params) {
      const int64_t from = std::max<int64_t>(lo, static_cast<int64_t>(offset_[k]));
      const int64_t to = std::min<int64_t>(hi, static_cast<int64_t>(offset_[k]) + params_[k].numel());
      if (from < to) owned_.push_back({k, from - static_cast<int64_t>(offset_[k]), to - from, b, from - lo});
    }
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

void GradSync::launch(Bucket& b) {
  if (!b.wire.defined()) {
    b.work = shard_ ? comm_.reduce_scatter_async(b.flat, b.shard, ReduceOp::avg) : comm_.all_reduce_async(b.flat, ReduceOp::avg);
    return;
  }
  b.flat.div_(comm_.size());  // the average's division before the cast: fp16 sums cannot overflow
  b.wire.copy_(b.flat);
  b.work = shard_ ? comm_.reduce_scatter_async(b.wire, b.wire_shard, ReduceOp::sum) : comm_.all_reduce_async(b.wire, ReduceOp::sum);
}

uint64_t GradSync::bytes_per_step() const {
  uint64_t bytes = 0;
  for (const auto& b : buckets_) bytes += static_cast<uint64_t>((b.wire.defined() ? b.wire : b.flat).nbytes());
  return bytes;
}

void GradSync::all_reduce_grads() {
  if (comm_.size() == 1 && !shard_) return;
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
    if (b.wire.defined()) (shard_ ? b.shard : b.flat).copy_(shard_ ? b.wire_shard : b.wire);  // back to fp32
    if (shard_) {  // the optimizer reads grad_shard(); the whole gradients are spent
      for (size_t k : b.params) params_[k].mutable_grad() = torch::Tensor();
      continue;
    }
    for (size_t k : b.params) {
      auto& p = params_[k];
      auto avg = b.flat.narrow(0, static_cast<int64_t>(offset_[k]), p.numel()).view(p.sizes());
      if (p.grad().defined()) p.mutable_grad().copy_(avg);
      else p.mutable_grad() = avg.clone();
    }
  }
}

void GradSync::all_gather_params() {
  MPITRAIN_CHECK(shard_, "all_gather_params needs a sharded GradSync");
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    torch::Tensor mine = torch::zeros_like(bucket.shard);
    for (const Slice& s : owned_)
      if (s.bucket == b)
        mine.narrow(0, s.shard_offset, s.length).copy_(params_[s.param].detach().view({-1}).narrow(0, s.begin, s.length));
    comm_.all_gather(mine, bucket.flat);  // the gradients in flat were consumed by the reduce-scatter
    for (size_t k : bucket.params) {
      auto& p = params_[k];
      p.detach().view({-1}).copy_(bucket.flat.narrow(0, static_cast<int64_t>(offset_[k]), p.numel()));
    }
  }
}

}  // namespace mpitrain
