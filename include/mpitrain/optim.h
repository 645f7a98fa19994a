// AdamW with decoupled weight decay (matrices only: never biases or LayerNorm parameters),
// global-norm gradient clipping, and the warm-up + cosine learning-rate schedule.
// Our own small optimizer rather than torch::optim: its state is plain named tensors, which
// makes the checkpoint format explicit and resume bitwise exact.
#pragma once

#include <torch/torch.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mpitrain/config.h"
#include "mpitrain/error.h"
#include "mpitrain/model.h"

namespace mpitrain {

// Learning rate at optimizer step `step` (0-based) of `total_steps`: linear warm-up from lr/warmup
// to lr over warmup_steps, then cosine decay to min_lr at the last step.
double lr_at(const OptimConfig& cfg, int64_t total_steps, int64_t step);

// Whether this libtorch has PyTorch's fused AdamW kernel (torch.optim.AdamW(fused=True)) for
// parameters on `device`: CUDA from libtorch 2.0 (GPU builds), the CPU from libtorch 2.4.
bool fused_adamw_available(torch::DeviceType device);

// ZeRO's split of the parameters (a sharded GradSync's, grad_sync.h). OwnedSlice: a contiguous run
// of one parameter's elements that this rank updates (flattened parameter index begin..begin +
// length) and where its averaged gradient sits in grads[bucket], this rank's part of the bucket.
struct OwnedSlice {
  size_t param;
  int64_t begin, length;
  size_t bucket;
  int64_t shard_offset;
};
struct GradShards {
  std::vector<OwnedSlice> slices;
  std::vector<torch::Tensor> grads;  // per bucket; padding elements are zero
};

// x (fp32) rounded to bf16 stochastically: up with probability equal to the fraction of the bf16
// step that x lies above the bf16 value below it (in magnitude), so E[result] = x and a moment
// updated by a small amount each step keeps those amounts on average, where round-to-nearest
// would drop every one smaller than half a bf16 step. The random bits are a hash of (seed, key,
// begin + element index): the same element of the same tensor gets the same bits however the
// tensor is cut (ZeRO's slices pass their offset as `begin`), so the optim.zero stages stay the
// same run bit for bit, as with fp32 moments.
// `chunk`: elements hashed at a time (the 64-bit temporaries of a large tensor stay small).
torch::Tensor round_bf16_stochastic(const torch::Tensor& x, int64_t seed, int64_t key, int64_t begin,
                                    int64_t chunk = int64_t{1} << 22);

class AdamW {
 public:
  // fused: update with PyTorch's fused AdamW kernel (fused_adamw_available() must hold for the
  // parameters' device), else with multi-tensor (foreach) kernels.
  AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_params, const OptimConfig& cfg, bool fused = false);
  // ZeRO-1: state for the slices of `named_params` that `shards` (GradSync::grad_shards() of a
  // sharded GradSync over the same parameters in the same order) gives this rank, gradients read
  // from its gradient shards. Each
  // slot is a 1-D view of a run of one parameter's elements; the moments of bucket b's slices are
  // views into bucket_moments(b), this rank's part of the bucket's padded layout.
  // ZeRO-3 (`param_shards`: ParamShards::param_shards(), one per bucket): the slots are views of
  // this rank's parameter shards instead of the parameters, which are not whole between steps.
  // Expert parallelism with ZeRO (`whole`: indices into named_params, ascending): those
  // parameters (each rank's experts) are held whole, as by the first constructor, in slots after
  // the slices; `shards` is then over the other parameters, in order (its parameter j is the j-th
  // of named_params not in `whole`).
  AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_params, const GradShards& shards,
        const OptimConfig& cfg, bool fused = false, const std::vector<torch::Tensor>* param_shards = nullptr,
        const std::vector<size_t>& whole = {});

  // One update from the parameters' .grad(): one fused kernel per group, or the foreach kernels,
  // which equal the textbook per-parameter loop bit for bit on the CPU. The fused kernel
  // computes the same formula in another order (equal to rounding; tests/test_optim.cpp).
  void step(double lr);
  bool fused() const { return fused_; }
  void zero_grad();      // drops the gradients (set to undefined)

  // Slots: whole parameters, or (sharded) slices of them.
  size_t size() const { return params_.size(); }
  bool sharded() const { return !bucket_exp_avg_.empty(); }
  // Slot i's parameter (its index in named_params), and whether the slot is that parameter whole
  // (every slot unsharded; the `whole` ones after the slices when sharded).
  size_t param_index(size_t i) const { return static_cast<size_t>(key_[i]); }
  bool holds_whole(size_t i) const { return i >= grads_.size(); }
  const std::string& name(size_t i) const { return names_[i]; }
  torch::Tensor& param(size_t i) { return params_[i]; }
  torch::Tensor& exp_avg(size_t i) { return exp_avg_[i]; }
  torch::Tensor& exp_avg_sq(size_t i) { return exp_avg_sq_[i]; }
  bool decays(size_t i) const { return decay_[i]; }
  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }
  // Sharded: the moments of this rank's part of bucket b (padding elements stay zero).
  torch::Tensor& bucket_exp_avg(size_t b) { return bucket_exp_avg_[b]; }
  torch::Tensor& bucket_exp_avg_sq(size_t b) { return bucket_exp_avg_sq_[b]; }
  // Bytes of AdamW state this rank holds (both moments).
  int64_t state_bytes() const;
  // optim.state_dtype: bf16: the moments are bf16 (else the parameters' dtype); the step computes
  // them in fp32 from the stored values and stores them back stochastically rounded
  // (round_bf16_stochastic).
  bool bf16_state() const { return bf16_state_; }
  // The gradient of slot i: its parameter's .grad(), or (a slice) its view of the gradient shard.
  torch::Tensor grad(size_t i) const { return holds_whole(i) ? params_[i].grad() : grads_[i]; }

 private:
  OptimConfig cfg_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_, exp_avg_, exp_avg_sq_;
  std::vector<torch::Tensor> grads_;  // the slices' (sharded only; the whole slots follow them)
  std::vector<torch::Tensor> bucket_exp_avg_, bucket_exp_avg_sq_;  // sharded only
  std::vector<bool> decay_;
  // Per slot: its parameter's index and the slot's first element in it (the stochastic rounding's
  // key and offset: the same for an element whatever the sharding).
  std::vector<int64_t> key_, begin_;
  bool bf16_state_ = false;
  int64_t t_ = 0;
  bool fused_ = false;
  torch::Tensor step_tensor_;  // the step count on the parameters' device (fused kernel)
  // A slot holding parameter k (`p`) whole, its moments made here.
  void add_whole(const std::string& name, const torch::Tensor& p, size_t k);
};

// Scales all gradients so their global L2 norm is at most max_norm (0 = no clipping); returns the
// norm before clipping as a 0-dim fp32 tensor on the gradients' device (reading it is the only
// host synchronisation, so the training loop reads it only when it logs). The gradients must
// already be identical on every rank (after all-reduce).
torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& params, double max_norm);
// The same for a sharded AdamW (ZeRO-1): each rank holds a disjoint part of the averaged
// gradients (AdamW::grad), so the squared norms are summed over `group` (the dp group) first.
torch::Tensor clip_sharded_grad_norm_(AdamW& opt, double max_norm, Communicator& group);
// Tensor parallel (tensor_parallel.h): the norm of the whole model's gradients when the ranks of
// `tp` hold shards of the parameters: AdamW's slots' squared norms, summed over `dp` first when the
// optimizer is sharded (ZeRO-1), then over `tp`, with the parameters every tp rank holds whole
// (TpSplit::replicated, as `model` declares them) counted once, on tp rank 0.
torch::Tensor clip_tp_grad_norm_(AdamW& opt, const GPT& model, double max_norm, Communicator& tp, Communicator& dp);
// Expert parallelism: `expert[k]` whether parameter k is one of this rank's experts (which the
// ranks of `ep` hold apart; every other whole gradient is the same on each of them, counted once,
// on ep rank 0); the squared norms summed over `ep`. ZeRO (a sharded AdamW, `expert` whole
// slots): the slices' squared norms are summed over `dp` (each rank holds its own) and added.
// Tensor parallelism (`tp`; `replicated[k]`: parameter k is whole on every tp rank, counted on tp
// rank 0 only): the sum then over `tp` as well. Pipeline parallelism (`pp`): the stages' sums
// summed over it, parameter `elsewhere` left out (the last stage's tied embedding: the first's counts).
torch::Tensor clip_ep_grad_norm_(AdamW& opt, const std::vector<bool>& expert, double max_norm, Communicator& ep,
                                 Communicator& dp, Communicator* tp = nullptr, const std::vector<bool>& replicated = {},
                                 Communicator* pp = nullptr, std::optional<size_t> elsewhere = std::nullopt);
// Pipeline parallelism: each rank of `pp` holds its stage's gradients `grads` (undefined: none;
// `counted[i]` false for a copy another stage counts: the last stage's tied embedding, whose
// gradient the two ends summed between them; tensor parallel: a parameter every tp rank holds
// whole, on tp ranks but the first); the squared norms summed over `dp` first when they are ZeRO's
// slices (`sliced`), then over `tp` (tensor parallel: each rank's shards), then over `pp`.
torch::Tensor clip_pp_grad_norm_(const std::vector<torch::Tensor>& grads, const std::vector<bool>& counted,
                                 double max_norm, Communicator& pp, Communicator* sliced = nullptr,
                                 Communicator* tp = nullptr);
// The same, returning the norm as a double (synchronises).
double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm);

}  // namespace mpitrain
