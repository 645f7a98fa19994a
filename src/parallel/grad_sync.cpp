// Bucketed gradient all-reduce, optionally overlapped with backward (see grad_sync.h).
#include "mpitrain/grad_sync.h"

#include <algorithm>

#include "mpitrain/error.h"

namespace mpitrain {

GradSync::GradSync(std::vector<torch::Tensor> params, Communicator& comm, double bucket_mb, bool overlap, bool shard,
                   torch::ScalarType wire, bool free_grads, std::vector<std::vector<size_t>> groups,
                   c10::optional<torch::Device> device)
    : params_(std::move(params)), comm_(comm), overlap_(overlap && comm.size() > 1), shard_(shard || free_grads),
      free_grads_(free_grads), wire_(wire) {
  const double limit = bucket_mb * 1024.0 * 1024.0;
  bucket_of_.assign(params_.size(), 0);
  offset_.assign(params_.size(), 0);
  seen_.assign(params_.size(), false);
  if (!groups.empty()) {
    std::vector<int> placed(params_.size(), 0);
    for (auto& g : groups) {
      MPITRAIN_CHECK(!g.empty(), "GradSync: an empty group");
      for (size_t k : g) {
        MPITRAIN_CHECK(k < params_.size(), "GradSync: a group names no parameter");
        ++placed[k];
      }
      buckets_.emplace_back();
      buckets_.back().params = std::move(g);
    }
    MPITRAIN_CHECK(std::all_of(placed.begin(), placed.end(), [](int n) { return n == 1; }),
                   "GradSync: every parameter must be in exactly one group");
  } else {
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
  }
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
    auto options = params_[bucket.params.front()].options().requires_grad(false);
    if (device) options = options.device(*device);
    options_ = options;
    // Padding stays zero: slots never cover it, and the all-gather writes zeros back into it.
    // ZeRO-2 makes flat and wire only while a reduce-scatter needs them.
    if (!free_grads_) {
      bucket.flat = shard_ ? torch::zeros({bucket.padded}, options) : torch::empty({n}, options);
      if (wire != options.dtype().toScalarType()) {
        bucket.wire = torch::zeros({bucket.flat.numel()}, options.dtype(wire));
        if (shard_) bucket.wire_shard = torch::zeros({bucket.padded / n_ranks}, options.dtype(wire));
      }
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
  if (overlap_ || free_grads_)
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
  if (!overlap_ && !free_grads_) return;
  armed_ = true;
  next_launch_ = 0;
  completed_ = 0;
  max_held_ = 0;
  launched_in_backward_ = 0;
  for (auto& b : buckets_) b.ready = 0;
  std::fill(seen_.begin(), seen_.end(), false);
}

void GradSync::on_grad(size_t k, const torch::Tensor& grad) {
  if (!armed_ || seen_[k]) return;
  torch::NoGradGuard no_grad;
  seen_[k] = true;
  if (free_grads_) {
    on_grad_freeing(k, grad);
    return;
  }
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

// ZeRO-2: the gradient goes into its bucket's flat buffer (made when the bucket's first gradient
// arrives) and nowhere else. .grad() of the parameters whose hooks ran before this one is dropped
// here: a leaf's hook runs just before its AccumulateGrad, so by the next hook theirs has written
// .grad(), which the bucket already holds. A complete bucket is reduce-scattered at once (overlap)
// in bucket order. At most kInFlight reduce-scatters are outstanding: launching one more first
// completes the oldest (its part added into the shard, its flat buffer freed), so backward holds
// at most that many buckets besides the one filling, not the whole gradient (bench/memory.sh
// measured the whole gradient held until the end of backward before this bound).
constexpr size_t kInFlight = 2;
void GradSync::on_grad_freeing(size_t k, const torch::Tensor& grad) {
  for (size_t j : spent_) params_[j].mutable_grad() = torch::Tensor();
  spent_.clear();
  Bucket& b = buckets_[bucket_of_[k]];
  if (!b.flat.defined()) b.flat = torch::zeros({b.padded}, options_);
  b.flat.narrow(0, static_cast<int64_t>(offset_[k]), params_[k].numel()).copy_(grad.reshape({-1}));
  spent_.push_back(k);
  if (++b.ready == b.params.size()) {
    if (on_filled_) on_filled_(bucket_of_[k]);
    if (overlap_) {
      const size_t before = next_launch_;
      launch_ready();
      launched_in_backward_ += next_launch_ - before;
      bound_in_flight();
    }
  }
  const auto held = std::count_if(buckets_.begin(), buckets_.end(), [](const Bucket& x) { return x.flat.defined(); });
  max_held_ = std::max(max_held_, static_cast<size_t>(held));
}

void GradSync::bound_in_flight() {
  while (next_launch_ - completed_ > kInFlight) complete(buckets_[completed_++]);
}

void GradSync::complete(Bucket& b) {
  b.work->wait();
  b.work.reset();
  torch::Tensor got = b.wire.defined() ? b.wire_shard.to(b.shard.scalar_type()) : b.shard_in;
  if (accumulating_) b.shard.add_(got);
  else b.shard.copy_(got);
  b.flat = b.wire = b.wire_shard = b.shard_in = torch::Tensor();
}

void GradSync::reduce_micro_step() {
  MPITRAIN_CHECK(free_grads_, "reduce_micro_step is ZeRO-2's");
  finish_buckets();
}

// ZeRO-2, after a backward: the buckets backward did not launch (parameters without a gradient
// contribute zeros), then every reduce-scatter waited for and added into this rank's shards (the
// first micro-step of a step writes them), and every flat buffer and .grad() dropped.
void GradSync::finish_buckets() {
  torch::NoGradGuard no_grad;
  if (on_filled_)
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (buckets_[b].ready != buckets_[b].params.size()) on_filled_(b);
  while (next_launch_ < buckets_.size()) {
    Bucket& b = buckets_[next_launch_++];
    if (!b.flat.defined()) b.flat = torch::zeros({b.padded}, options_);
    launch(b);
    bound_in_flight();
  }
  for (; completed_ < buckets_.size(); ++completed_) complete(buckets_[completed_]);
  completed_ = 0;
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  spent_.clear();
  armed_ = false;
  accumulating_ = true;
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
  if (free_grads_) {  // ZeRO-2: into this micro-step's own output, added to the shard when done
    const int64_t part = b.padded / comm_.size();
    if (wire_ == options_.dtype().toScalarType()) {
      b.shard_in = torch::empty({part}, options_);
      b.work = comm_.reduce_scatter_async(b.flat, b.shard_in, ReduceOp::avg);
    } else {
      b.flat.div_(comm_.size());  // as below: the average's division before the cast
      b.wire = b.flat.to(wire_);
      b.wire_shard = torch::empty({part}, options_.dtype(wire_));
      b.work = comm_.reduce_scatter_async(b.wire, b.wire_shard, ReduceOp::sum);
    }
    return;
  }
  if (!b.wire.defined()) {
    b.work = shard_ ? comm_.reduce_scatter_async(b.flat, b.shard, ReduceOp::avg) : comm_.all_reduce_async(b.flat, ReduceOp::avg);
    return;
  }
  b.flat.div_(comm_.size());  // the average's division before the cast: fp16 sums cannot overflow
  b.wire.copy_(b.flat);
  b.work = shard_ ? comm_.reduce_scatter_async(b.wire, b.wire_shard, ReduceOp::sum) : comm_.all_reduce_async(b.wire, ReduceOp::sum);
}

GradShards GradSync::grad_shards() const {
  MPITRAIN_CHECK(shard_, "GradSync: gradient shards exist only when sharded (ZeRO-1/2/3)");
  GradShards out{owned_, {}};
  for (const Bucket& b : buckets_) out.grads.push_back(b.shard);
  return out;
}

uint64_t GradSync::bytes_per_step() const {
  uint64_t bytes = 0;
  for (const auto& b : buckets_) bytes += static_cast<uint64_t>(b.padded) * c10::elementSize(wire_);
  return bytes;
}

void GradSync::all_reduce_grads() {
  if (comm_.size() == 1 && !shard_) return;
  torch::NoGradGuard no_grad;
  if (free_grads_) {
    finish_buckets();
    accumulating_ = false;  // the next step's first micro-step writes the shards
    return;
  }
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
    // The gradients in flat were consumed by the reduce-scatter (ZeRO-2: flat is made for this).
    torch::Tensor whole = free_grads_ ? torch::empty({bucket.padded}, options_) : bucket.flat;
    comm_.all_gather(mine, whole);
    for (size_t k : bucket.params) {
      auto& p = params_[k];
      p.detach().view({-1}).copy_(whole.narrow(0, static_cast<int64_t>(offset_[k]), p.numel()));
    }
  }
}

}  // namespace mpitrain
