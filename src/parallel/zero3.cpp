// ZeRO-3: parameters as per-unit shards, gathered around each unit's use (see zero3.h).
#include "mpitrain/zero3.h"

#include <ATen/autocast_mode.h>

#include <algorithm>
#include <string>

#include "mpitrain/error.h"

namespace mpitrain {

namespace {

// The memory of `t`'s storage, taken away (returned) or given again (the storage object, and
// with it every view of it, autograd's saved tensors included, stays).
c10::DataPtr take_memory(const torch::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  c10::DataPtr old = impl->set_data_ptr(c10::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
  return old;
}

void give_memory(const torch::Tensor& t, c10::DataPtr memory, size_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (!memory) {
    c10::Allocator* allocator = impl->allocator();
    if (!allocator) allocator = c10::GetAllocator(t.device().type());
    memory = allocator->allocate(nbytes);
  }
  impl->set_data_ptr_noswap(std::move(memory));
  impl->set_nbytes(nbytes);
}

}  // namespace

Units model_units(const std::vector<std::string>& names, int64_t n_layer) {
  // The blocks this model holds (a pipeline stage: its chunks'), and whether it holds any
  // parameter outside them (a middle stage holds none).
  std::vector<bool> held(static_cast<size_t>(n_layer), false);
  bool outside = false;
  for (const std::string& name : names) {
    const int64_t block = block_of(name);
    MPITRAIN_CHECK(block < n_layer, concat("ZeRO-3: parameter ", name, " of no block"));
    if (block >= 0) held[static_cast<size_t>(block)] = true;
    else outside = true;
  }
  Units u;
  u.block_unit.assign(static_cast<size_t>(n_layer), Units::none);
  for (int64_t i = n_layer - 1; i >= 0; --i)
    if (held[static_cast<size_t>(i)]) u.block_unit[static_cast<size_t>(i)] = u.groups.size(), u.groups.emplace_back();
  if (outside) u.outside = u.groups.size(), u.groups.emplace_back();
  for (size_t k = 0; k < names.size(); ++k) {
    const int64_t block = block_of(names[k]);
    u.groups[block >= 0 ? u.block_unit[static_cast<size_t>(block)] : u.outside].push_back(k);
  }
  return u;
}

ParamShards::ParamShards(std::vector<torch::Tensor> params, GradSync& sync, Units units, bool reshard_after_forward,
                         c10::ScalarType wire)
    : sync_(sync), units_(std::move(units)), wire_(wire), reshard_after_forward_(reshard_after_forward) {
  MPITRAIN_CHECK(sync.sharded() && sync.frees_grads() && sync.num_buckets() == units_.groups.size(),
                 "ZeRO-3: needs a ZeRO-2 GradSync with one bucket per unit");
  torch::NoGradGuard no_grad;
  Communicator& comm = sync.communicator();
  const size_t n = sync.num_buckets();
  whole_.resize(n);
  shards_.resize(n);
  is_whole_.assign(n, true);
  rounded_.assign(n, false);
  pending_.resize(n);
  for (const auto& p : params) param_numel_.push_back(p.numel());
  for (size_t u = 0; u < n; ++u) {
    const auto& ks = sync.bucket_params(u);
    const torch::Tensor& first = params.at(ks.front());
    const int64_t padded = sync.padded_length(u), part = padded / comm.size();
    // On the GradSync's device: the parameters may come from the host, where the whole model was
    // built, and move to the device one unit at a time (their host memory goes with set_data).
    whole_[u] = torch::zeros({padded}, first.options().device(sync.device()).requires_grad(false));
    for (size_t k : ks) {
      torch::Tensor& p = params.at(k);
      torch::Tensor slot = whole_[u].narrow(0, sync.flat_offset(k), p.numel());
      if (param_has_values(p)) slot.copy_(p.detach().reshape({-1}));
      p.set_data(slot.view(p.sizes()));
    }
    shards_[u] = whole_[u].narrow(0, comm.rank() * part, part).clone();
    release(u);
  }
  spare_.clear();  // nothing kept from the start-up: its peak stays the shards and one unit whole
  max_whole_ = 0;
  sync_.on_bucket_filled([this](size_t u) { release(u); });
  // Autocast keeps the 16-bit copy of every weight it cast until the autocast region ends (the
  // whole forward): under ZeRO-3 that would hold every block's weights again. Without the cache
  // each use casts anew; in this model only the tied embedding is used twice.
  autocast_cache_was_ = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_cache_enabled(false);
}

ParamShards::~ParamShards() {
  at::autocast::set_autocast_cache_enabled(autocast_cache_was_);
  sync_.on_bucket_filled(nullptr);
  for (size_t u = 0; u < pending_.size(); ++u) finish_prefetch(u);
}

void ParamShards::need_block(int64_t block, bool backward) {
  const size_t n_layer = units_.block_unit.size(), b = static_cast<size_t>(block);
  MPITRAIN_CHECK(b < n_layer && units_.block_unit[b] != Units::none, concat("ZeRO-3: block ", block, " is not held here"));
  gather(units_.block_unit[b]);
  // The next block to run, where this model holds it (a pipeline stage's chunk ends before it).
  const size_t next = !backward ? b + 1 : b - 1;  // (b = 0 in backward: wraps past n_layer)
  if (next < n_layer && units_.block_unit[next] != Units::none) prefetch(units_.block_unit[next]);
}

void ParamShards::done_with_block(int64_t block) {
  if (reshard_after_forward_ || !torch::GradMode::is_enabled()) release(units_.block_unit.at(static_cast<size_t>(block)));
}

void ParamShards::finish_prefetch(size_t u) {
  Pending& p = pending_.at(u);
  if (!p.work) return;
  p.work->wait();
  if (p.received.defined()) {
    torch::NoGradGuard no_grad;
    whole_[u].copy_(p.received);  // widened: every 16-bit value is an fp32 one
  }
  p = Pending();
}

void ParamShards::start_gather(size_t u, c10::ScalarType wire) {
  Pending& p = pending_.at(u);
  rounded_[u] = wire != whole_[u].scalar_type();
  if (!rounded_[u]) {
    p.work = sync_.communicator().all_gather_async(shards_[u], whole_[u]);
    return;
  }
  torch::NoGradGuard no_grad;
  p.sent = shards_[u].to(wire);
  p.received = torch::empty({whole_[u].numel()}, p.sent.options());
  p.work = sync_.communicator().all_gather_async(p.sent, p.received);
}

void ParamShards::make_whole(size_t u) {
  const size_t nbytes = static_cast<size_t>(whole_[u].numel()) * whole_[u].element_size();
  c10::DataPtr memory;
  auto same = std::find_if(spare_.begin(), spare_.end(), [&](const auto& s) { return s.first == nbytes; });
  if (same != spare_.end()) {
    memory = std::move(same->second);
    spare_.erase(same);
  }
  give_memory(whole_[u], std::move(memory), nbytes);
  is_whole_[u] = true;
  max_whole_ = std::max(max_whole_, units_whole());
}

void ParamShards::gather(size_t u) { gather_as(u, wire_); }

void ParamShards::gather_exact(size_t u) { gather_as(u, whole_.at(u).scalar_type()); }

void ParamShards::gather_as(size_t u, c10::ScalarType wire) {
  finish_prefetch(u);
  const bool exact = wire == whole_[u].scalar_type();
  if (is_whole_.at(u) && (!rounded_[u] || !exact)) return;  // whole already, as exact as asked
  if (!is_whole_[u]) make_whole(u);
  if (exact) {
    sync_.communicator().all_gather(shards_[u], whole_[u]);
    rounded_[u] = false;
    return;
  }
  start_gather(u, wire);
  finish_prefetch(u);
}

void ParamShards::prefetch(size_t u) {
  if (is_whole_.at(u)) return;
  make_whole(u);
  start_gather(u, wire_);
}

void ParamShards::release(size_t u) {
  if (held_ || !is_whole_.at(u)) return;
  finish_prefetch(u);  // a prefetch nobody used (a forward that stopped early) completes first
  const size_t nbytes = static_cast<size_t>(whole_[u].numel()) * whole_[u].element_size();
  c10::DataPtr memory = take_memory(whole_[u]);
  if (spare_.size() < kSpare) spare_.emplace_back(nbytes, std::move(memory));
  is_whole_[u] = false;
}

void ParamShards::gather_all() {
  for (size_t u = 0; u < whole_.size(); ++u) gather_exact(u);
  held_ = true;
}

void ParamShards::release_all() {
  held_ = false;
  for (size_t u = 0; u < whole_.size(); ++u) release(u);
}

void ParamShards::for_each_unit_whole(const std::function<void(const std::vector<size_t>&)>& f) {
  for (size_t u = 0; u < whole_.size(); ++u) {
    const bool was_whole = is_whole_[u];
    gather_exact(u);
    f(units_.groups[u]);
    if (!was_whole) release(u);
  }
}

void ParamShards::set_param(size_t k, const torch::Tensor& values) {
  torch::NoGradGuard no_grad;
  const size_t u = sync_.bucket_of(k);
  const int64_t part = shards_.at(u).numel(), mine = sync_.communicator().rank() * part;
  const int64_t offset = sync_.flat_offset(k), n = values.numel();
  MPITRAIN_CHECK(n == param_numel_.at(k), "ZeRO-3: set_param's values have another size");
  const int64_t first = std::max(offset, mine), last = std::min(offset + n, mine + part);  // [first, last) is mine
  if (first >= last) return;
  shards_[u].narrow(0, first - mine, last - first).copy_(values.reshape({-1}).narrow(0, first - offset, last - first));
}

size_t ParamShards::units_whole() const {
  return static_cast<size_t>(std::count(is_whole_.begin(), is_whole_.end(), true));
}

}  // namespace mpitrain
