// ZeRO-3 (optim.zero: 3), FSDP-style: the parameters live as shards, one per unit.
//
// A unit is one transformer block, or everything outside the blocks (embeddings, final norm,
// output layer). Each unit is one bucket of a ZeRO-2 GradSync (grad_sync.h; buckets given as
// groups, last block first, the outside unit last: the order backward completes them), so the
// unit's flat layout (padded to a multiple of the dp group) is the gradient bucket's, and this
// rank's part of it is the same elements in both: the parameter shard that AdamW updates in place
// (AdamW's ZeRO constructor with param_shards) and the gradient shard it reads.
//
// Every parameter is a view of its unit's flat `whole` buffer, whose memory exists only while the
// unit is gathered: the model (GPTImpl's UnitHooks) asks for a block before it runs and gives it
// back after its forward; a block's output passes through an identity whose backward asks for
// the block again before the block's backward; once backward has given all of a unit's
// parameters their gradients (GradSync::on_bucket_filled) the unit's memory is released again.
// While a block runs, the next one's all-gather is in flight (block + 1 in forward, block - 1 in
// backward; Communicator::all_gather_async: MPI's nonblocking collective on the CPU, NCCL's
// communication stream on a GPU), so a rank holds up to two blocks whole besides the outside unit.
// Releasing keeps the buffer's storage object and drops only its memory, so the tensors that
// autograd saved in forward (views of the same storage) see the gathered values again in
// backward: PyTorch FSDP's storage-resize scheme. The gathers write through the flat buffer,
// whose version counter is not the parameters', so autograd's saved-tensor checks hold.
//
// comm.param_dtype bf16 / fp16: the training step's gathers send the shards rounded to it (half
// the bytes) and widen what arrives into the fp32 buffer, so the step computes with the rounded
// weights; the fp32 shards stay the master weights. Under autocast to the same dtype the matmuls
// see the weights they would see anyway (autocast casts them to it); the fp32 ops that read
// weights (embedding lookups, norms) see them rounded.
//
// Outside the training step (checkpoints, resume, the final parameters) WholeParams gathers
// every unit for its lifetime, exactly (fp32 on the wire: a rounded unit is gathered again).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mpitrain/grad_sync.h"
#include "mpitrain/model.h"

namespace mpitrain {

// The units of a model with `n_layer` blocks, from its parameter names (named_params order):
// the GradSync groups (the blocks it holds, n_layer - 1 .. 0, then the parameters outside the
// blocks), and which group each block is (block_unit[i]) and the outside one; `none` for a block
// it does not hold and for an outside unit without parameters (a pipeline stage's model).
struct Units {
  static constexpr size_t none = static_cast<size_t>(-1);
  std::vector<std::vector<size_t>> groups;
  std::vector<size_t> block_unit;
  size_t outside = none;
};
Units model_units(const std::vector<std::string>& names, int64_t n_layer);

class ParamShards : public UnitHooks {
 public:
  // `params`: the model's parameters (named_params order), whole and equal on every rank of the
  // GradSync's group, on its device or on the host; they become views of the units' buffers on the
  // GradSync's device, each rank keeping its shard, and every unit is released: a model built on
  // the host reaches the device one unit at a time. A parameter without memory (GPT made
  // `deferred`: fewer bytes of storage than elements) gives zeros until set_param().
  // `reshard_after_forward` (optim.reshard_after_forward) false: a block stays whole from its
  // forward to the end of its backward (one gather per micro-step instead of two); a forward
  // without gradients releases it either way. `wire`: the training step's gathers' dtype
  // (comm.param_dtype).
  ParamShards(std::vector<torch::Tensor> params, GradSync& sync, Units units, bool reshard_after_forward = true,
              c10::ScalarType wire = torch::kFloat32);
  ~ParamShards() override;
  ParamShards(const ParamShards&) = delete;
  ParamShards& operator=(const ParamShards&) = delete;

  void need_outside_blocks() override {
    if (units_.outside != Units::none) gather(units_.outside);
  }
  void need_block(int64_t block, bool backward) override;
  void done_with_block(int64_t block) override;

  void gather(size_t unit);    // all-gathers the unit's shards into its whole buffer (no-op if whole)
  void prefetch(size_t unit);  // starts that all-gather; gather() completes it
  void gather_exact(size_t unit);  // the same in fp32 on the wire (again if the unit is whole but rounded)
  void release(size_t unit);   // drops the whole buffer's memory (no-op if released, or while all are held)
  // Every unit whole, and kept whole (release() does nothing) until release_all(): a collective,
  // after which one rank alone may run the model (sampling) without any gather.
  void gather_all();
  void release_all();
  // Each unit whole in turn, exactly (fp32 on the wire), `f` called with its parameters' indices
  // (into `params`) while it is, then released unless it was whole before: a collective that
  // holds at most one unit whole beyond those already whole (rank 0 copying the parameters for a
  // checkpoint it writes alone).
  void for_each_unit_whole(const std::function<void(const std::vector<size_t>&)>& f);
  // Parameter k's values (its shape, on any device): this rank's part of them into its shard; no
  // communication, no unit made whole (GPT::initialize's and model.init_from's values, one
  // parameter at a time).
  void set_param(size_t k, const torch::Tensor& values);

  // Per unit (= GradSync bucket): this rank's part of its padded flat parameters.
  const std::vector<torch::Tensor>& param_shards() const { return shards_; }
  size_t num_units() const { return whole_.size(); }
  // Units whose whole buffer exists now (prefetched ones included), and the most at once since
  // the last reset (tests).
  size_t units_whole() const;
  size_t max_units_whole() const { return max_whole_; }

 private:
  // A prefetch in flight: its request, and with a 16-bit wire the rounded shard sent and the
  // buffer receiving, widened into the whole buffer when it completes.
  struct Pending {
    std::unique_ptr<Work> work;
    torch::Tensor sent, received;
  };
  void finish_prefetch(size_t unit);  // waits for the unit's prefetch, if one is in flight
  void make_whole(size_t unit);       // gives the unit's buffer its memory (contents: the gather's)
  // Starts the unit's all-gather with `wire` on the wire into its (whole) buffer: pending_[u].
  void start_gather(size_t unit, c10::ScalarType wire);
  // gather() and gather_exact(): the unit whole through `wire`, unless it is whole already
  // (through an fp32 wire, or through any when `wire` is 16-bit).
  void gather_as(size_t unit, c10::ScalarType wire);
  GradSync& sync_;
  Units units_;
  c10::ScalarType wire_ = torch::kFloat32;
  std::vector<torch::Tensor> whole_;   // per unit: the flat buffer the parameters are views of
  std::vector<torch::Tensor> shards_;  // per unit: this rank's part
  std::vector<bool> is_whole_;  // the buffer has memory (its gather may still be in flight)
  std::vector<bool> rounded_;   // its contents came through a 16-bit wire
  std::vector<Pending> pending_;  // per unit: a prefetch in flight
  std::vector<int64_t> param_numel_;  // per parameter
  bool held_ = false;  // between gather_all() and release_all()
  bool reshard_after_forward_ = true;
  bool autocast_cache_was_ = true;  // autocast's weight cache, off while this object lives
  size_t max_whole_ = 0;
  // Released units' memory kept for the next unit of the same size (at most kSpare buffers): the
  // blocks' buffers are then the same few allocations step after step. Freed and allocated anew
  // each time, they interleaved with the activations in glibc's heap, which keeps what is freed
  // (keep_freed_memory): ZeRO-3's peak RSS sat 449 MiB above its tensors, ZeRO-2's 290.
  static constexpr size_t kSpare = 2;
  std::vector<std::pair<size_t, c10::DataPtr>> spare_;  // (bytes, memory)
};

// Every unit whole for this object's lifetime (null: nothing to do), released after.
class WholeParams {
 public:
  explicit WholeParams(ParamShards* shards) : shards_(shards) {
    if (shards_) shards_->gather_all();
  }
  ~WholeParams() {
    if (shards_) shards_->release_all();
  }
  WholeParams(const WholeParams&) = delete;
  WholeParams& operator=(const WholeParams&) = delete;

 private:
  ParamShards* shards_;
};

}  // namespace mpitrain
