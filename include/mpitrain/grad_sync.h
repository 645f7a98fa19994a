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
//
// ZeRO-1 (shard = true; optim.zero: 1): each bucket's flat buffer is padded to a multiple of the
// group size n and reduce-scattered instead of all-reduced, so rank r receives the averaged
// gradients of elements [r*S, (r+1)*S) of every bucket (S = padded length / n) and nothing else;
// .grad() is not written. owned_slices() says which parts of which parameters those elements
// are (.grad() itself is dropped once packed): the optimizer keeps AdamW state for them only and
// updates them in place, and
// all_gather_params() then gives every rank every updated parameter (one all-gather per bucket,
// using the bucket's gradient buffer as its destination). As in DeepSpeed stage 1 and Megatron's
// distributed optimizer, the parameters stay whole on every rank.
//
// ZeRO-2 (free_grads = true; optim.zero: 2): the same shards, but no rank ever holds the whole
// gradient. Every micro-step's backward copies each parameter's gradient into its bucket from the
// parameter's hook and drops .grad() at the next hook (by then it has been written: a leaf's hook
// runs just before its AccumulateGrad); a complete bucket is reduce-scattered at once (overlap)
// and its flat buffer freed when that is done; this rank's part is added into its shard (the
// first micro-step of a step writes it). Per rank: the shards, plus the buckets in flight. With
// gradient accumulation every micro-step communicates (ZeRO-1 communicates once per step): the
// sum over micro-steps is taken after the average over ranks, which reorders the additions.
//
// ZeRO-3 (zero3.h) uses ZeRO-2's buckets with `groups` given: one bucket per unit of parameters
// (a transformer block; the rest of the model), in the order backward completes them, and a
// callback (on_bucket_filled) that frees a unit's whole parameters once backward has given every
// one of them its gradient.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "mpitrain/comm.h"
#include "mpitrain/optim.h"

namespace mpitrain {

class GradSync {
 public:
  // `wire`: the dtype buckets travel in (comm.grad_dtype). bf16/fp16: each bucket is divided by
  // the group size in fp32 (so fp16 cannot overflow where the fp32 average would not), cast, summed
  // in 16 bits, and cast back into the fp32 gradients, as PyTorch DDP's fp16/bf16 compression
  // hooks do; half the bytes of fp32.
  // `groups` (non-empty): the buckets, each a list of indices into `params` in the order their
  // gradients are laid out, the buckets in the order backward completes them; bucket_mb is then
  // not used. Every parameter must be in exactly one group.
  // `device`: where the buckets and shards live (default: the parameters' device). ZeRO-3 makes
  // its GradSync over parameters still on the host, which ParamShards then moves to the device
  // one unit at a time.
  GradSync(std::vector<torch::Tensor> params, Communicator& comm, double bucket_mb, bool overlap,
           bool shard = false, torch::ScalarType wire = torch::kFloat32, bool free_grads = false,
           std::vector<std::vector<size_t>> groups = {}, c10::optional<torch::Device> device = c10::nullopt);
  ~GradSync();
  GradSync(const GradSync&) = delete;  // the hooks hold `this`
  GradSync& operator=(const GradSync&) = delete;

  // Call before the backward whose gradients complete an optimizer step (the last micro-step);
  // ZeRO-2: before every micro-step's backward.
  void arm();
  // ZeRO-2: after a backward that does not complete the step: its reduce-scatters finished and
  // added into the shards, its buffers and .grad() dropped.
  void reduce_micro_step();
  bool frees_grads() const { return free_grads_; }
  // ZeRO-2: called with a bucket's index once the backward under way has given all of its
  // parameters their gradients (from the last one's hook), or, for a bucket some of whose
  // parameters got none, when that backward's buckets are finished (ZeRO-3 frees the bucket's
  // whole parameters here).
  void on_bucket_filled(std::function<void(size_t)> f) { on_filled_ = std::move(f); }
  // Averages every parameter's .grad() across ranks (a no-op with one rank); sharded: this
  // rank's slices of the averaged gradients into grad_shard().
  void all_reduce_grads();

  // ---- ZeRO-1 (sharded) ----
  bool sharded() const { return shard_; }
  // A contiguous run of one parameter's elements that this rank owns (flattened parameter index
  // `begin`..begin+length) and where its averaged gradient sits in grad_shard(bucket).
  using Slice = OwnedSlice;
  const std::vector<Slice>& owned_slices() const { return owned_; }
  // This rank's averaged gradients of bucket b (padding elements are zero).
  const torch::Tensor& grad_shard(size_t b) const { return buckets_[b].shard; }
  // The slices and every bucket's gradient shard: what a sharded AdamW updates (optim.h).
  GradShards grad_shards() const;
  // Every rank's updated slices to every rank, written into the parameters.
  void all_gather_params();
  // The layout, for moving sharded optimizer state (checkpoints): bucket b's parameters, where
  // parameter k starts in its bucket's flat buffer, and the buffer's padded length.
  const std::vector<size_t>& bucket_params(size_t b) const { return buckets_[b].params; }
  int64_t flat_offset(size_t k) const { return static_cast<int64_t>(offset_[k]); }
  size_t bucket_of(size_t k) const { return bucket_of_[k]; }
  int64_t padded_length(size_t b) const { return buckets_[b].padded; }
  Communicator& communicator() const { return comm_; }

  size_t num_buckets() const { return buckets_.size(); }
  torch::Device device() const { return options_.device(); }  // the buckets' and shards'
  // Bytes one step hands to the reducing collectives (all buckets, in the wire dtype).
  uint64_t bytes_per_step() const;
  bool overlapping() const { return overlap_; }
  // Buckets whose all-reduce the hooks started during the last backward (tests, logging).
  size_t launched_during_backward() const { return launched_in_backward_; }
  // ZeRO-2: the most bucket buffers held at once during the last backward (tests: at most two
  // reduce-scatters in flight plus the bucket being filled).
  size_t max_buckets_held() const { return max_held_; }

 private:
  struct Bucket {
    std::vector<size_t> params;  // indices into params_
    torch::Tensor flat;          // packed gradients (sharded: padded to `padded` elements)
    int64_t padded = 0;          // flat's length (sharded: a multiple of the group size)
    torch::Tensor shard;         // sharded: this rank's reduce-scattered part of flat
    torch::Tensor wire, wire_shard;  // compressed: flat (and shard) in the wire dtype
    torch::Tensor shard_in;          // ZeRO-2: this micro-step's reduce-scattered part
    size_t ready = 0;            // parameters whose gradient is in `flat` (overlap)
    std::unique_ptr<Work> work;  // the all-reduce in flight
  };
  void on_grad(size_t k, const torch::Tensor& grad);
  void on_grad_freeing(size_t k, const torch::Tensor& grad);  // ZeRO-2's hook
  void finish_buckets();                                       // ZeRO-2: after a backward
  void complete(Bucket& b);  // ZeRO-2: wait for b's reduce-scatter, add it into the shard, free b's buffers
  void bound_in_flight();    // ZeRO-2: complete the oldest launched buckets until at most two are in flight
  void fill_slot(size_t k);  // p.grad (or zeros) into its slot
  void launch_ready();
  void launch(Bucket& b);

  std::vector<torch::Tensor> params_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_, offset_;
  std::vector<bool> seen_;
  Communicator& comm_;
  bool overlap_;
  bool shard_;
  bool free_grads_ = false;
  torch::ScalarType wire_;
  torch::TensorOptions options_;
  std::vector<size_t> spent_;  // ZeRO-2: parameters whose hook ran: their .grad() is in a bucket
  bool accumulating_ = false;  // ZeRO-2: an earlier micro-step of this step wrote the shards
  size_t completed_ = 0;       // ZeRO-2: buckets before this one are reduced and freed (this backward)
  size_t max_held_ = 0;        // ZeRO-2: max_buckets_held()
  std::vector<Slice> owned_;
  bool armed_ = false;
  size_t next_launch_ = 0;
  size_t launched_in_backward_ = 0;
  std::vector<std::pair<size_t, unsigned>> hooks_;  // (param, hook handle)
  std::function<void(size_t)> on_filled_;
};

}  // namespace mpitrain
