// How one run's model and optimizer are spread over the ranks: the one place that knows.
//
// The parallelisms compose on the mesh (mesh.h; world = islands x pp x dp x tp):
// - tensor parallelism (parallel.tp): the modules are made as this rank's shards (model.h's
//   GPTDims tp; tensor_parallel.h's splits); here: the gradient norm over the tp group, a
//   checkpoint's shards assembled (rank 0's whole copy, or each tp rank its share) and the
//   final parameters unsharded;
// - the data-parallel stage over the dp group (optim.zero, grad_sync.h, zero3.h):
//     0  replicated: gradients all-reduced in buckets (comm.compress: powersgd, its factors);
//     1  gradients reduce-scattered once per step, AdamW on this rank's slices, the updated
//        slices all-gathered (ZeRO-1, Megatron's distributed optimizer);
//     2  the same, every micro-step's gradients reduce-scattered as backward fills each bucket,
//        no rank holding the whole gradient (ZeRO-2);
//     3  the parameters sharded too, one unit per block, gathered around their use (ZeRO-3).
//   With one dp rank every stage is 0: there is nothing to shard.
// - expert parallelism (parallel.ep, a mixture of experts): each ep group of
//   consecutive dp ranks holds every expert once between them (model.h's MoE exchanges the tokens);
//   here: the experts' gradients averaged over their replicas, the gradient norm over the ep
//   group, a checkpoint's experts written whole by the ranks of the first ep group (each rank
//   writing its share), or gathered to rank 0, and handed out again on resume. ZeRO-1/2/3
//   shard the shared parameters over the dp group as above (ZeRO-3's units hold them only); each
//   rank's experts stay whole, their AdamW state in slots after the slices (optim.h). With tensor
//   parallelism (any stage) each rank holds its tp shards of its experts; a checkpoint makes
//   them whole over tp, then over ep.
// - pipeline parallelism (parallel.pp, pipeline.h; any optim.zero, over each stage's dp group):
//   each stage's model holds its blocks, the dp group is the stage's; here: a tied embedding's gradient summed between the
//   first and last stage, the gradient norm over the pipeline, checkpoints of the whole model
//   (each stage's rank writing its share, or rank 0 gathering them) and stages resumed from any.
// With DiLoCo's islands (diloco.h) the dp group is the island's; the outer steps act on the
// optimizer's slots and then ask after_update() as an update does.
//
// Applied to a built model as torchtitan applies apply_tp / apply_fsdp: make_model() (the modules,
// deferred under ZeRO-3), apply() (the gradient hooks, the units), initial_weights(),
// make_optimizer(). The training loop then asks what to do around backward, the update and a
// checkpoint (before_backward, reduce_gradients, unscale_and_clip, after_update, params_finite,
// save, resume) without knowing which stage is on.
#pragma once

#include "mpitrain/mpi_ops.h"
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mpitrain/amp.h"
#include "mpitrain/checkpoint.h"
#include "mpitrain/config.h"
#include "mpitrain/grad_sync.h"
#include "mpitrain/model.h"
#include "mpitrain/optim.h"
#include "mpitrain/powersgd.h"
#include "mpitrain/mesh.h"
#include "mpitrain/mpi_env.h"
#include "mpitrain/state_sync.h"
#include "mpitrain/zero3.h"

namespace mpitrain {

class Parallelism {
 public:
  // `mesh`: the dp and tp groups; `tp`: this rank's place in its tp group, which make_model
  // applies to the model; `checkpoint_dir_blind_rank`: the lowest rank that does not see
  // checkpoint.dir, or -1 (startup.h).
  Parallelism(const Config& cfg, Mesh& mesh, const Topology& topo, const GPTDims& dims, const TpPlace& tp,
              torch::Device device, int checkpoint_dir_blind_rank, MpiComm mpi_comm);
  Parallelism(const Parallelism&) = delete;
  Parallelism& operator=(const Parallelism&) = delete;

  // ---- facts (start-up lines, the checkpoint's record) -----------------------------------------
  int zero_stage() const { return stage_; }  // 0 with one dp rank, whatever optim.zero says
  bool tensor_parallel() const { return tp_; }
  bool expert_parallel() const { return ep_; }
  bool pipeline_parallel() const { return pp_; }
  // Pipeline parallelism: the whole model's parameter names and shapes (empty with pp 1).
  const ParamShapes& whole_names() const { return whole_names_; }
  // Checkpoint writers: each holder of a part of the state writes its share (all ranks see
  // checkpoint.dir), else rank 0 the whole state, gathered to it; how many ranks write.
  bool writes_shares() const { return shares_; }
  int writers() const { return writer_count_; }

  // ---- start-up, in order ----------------------------------------------------------------------
  // This rank's modules from the current seed: tp shards; on the device, or, under ZeRO-3, on the
  // host without values (GPT deferred: at most one block exists while it is made); running as
  // `run` says (GPT::apply).
  GPT make_model(const RunOptions& run);
  // The stage applied to `model` (kept): gradient buckets and their hooks, PowerSGD's factors, and
  // under ZeRO-3 the units (the model's UnitHooks); rank 0's whole host copy when it assembles a
  // tensor-parallel checkpoint alone. A stage this MPI or device cannot run is exit 2 here.
  void apply(GPT model);
  // A fresh run's initial weights, the same on every rank of a dp group: `init_from` (the first
  // replica's ranks read the files, each its tp shards; ZeRO-3: one tensor at a time, each rank
  // keeping its part) or those make_model() drew (ZeRO-3: drawn again one parameter at a time).
  // Returns the number of tensors read from `init_from` (0 when empty). Bad files: exit 2, naming
  // them (`cfg`'s model.init_from).
  int64_t initial_weights(const std::string& init_from);
  // AdamW over what this rank updates: every parameter (stage 0), its slices (1, 2) or its
  // shards (3); rank 0 logs the optimizer state per rank.
  void make_optimizer(bool fused);
  AdamW& optimizer() { return *opt_; }
  // The state of the newest readable checkpoint of `candidates` (rank 0's list), any layout;
  // returns the file loaded (rank 0; "" elsewhere).
  std::string resume(const std::vector<std::string>& candidates, TrainState& st);
  // This rank's parameters, whole or tp shards (ZeRO-3: views of units, whole only when gathered).
  const std::vector<torch::Tensor>& params() const { return params_; }

  // Start-up lines: "N all-reduce buckets (overlapped with backward)", and the gradient traffic
  // per step (empty with one dp rank).
  std::string describe_buckets() const;
  std::string describe_gradient_traffic(int64_t accum) const;
  std::string describe_initial_weights() const;
  // Expert parallelism: the all-to-all MiB a rank sends per step of `accum` micro-batches
  // (memory_plan.h's expert_exchange_bytes; 0 with ep 1).
  double expert_exchange_mib(int64_t accum) const;

  // ---- one step ----------------------------------------------------------------------------
  // Before a step: whether its gradients travel compressed (PowerSGD from powersgd_start on).
  void begin_step(int64_t step);
  // Around each micro-step's backward: `completes_step` for the step's last one.
  void before_backward(bool completes_step);
  void after_backward(bool completes_step);
  // The step's gradients averaged over the dp group, each rank holding what it updates.
  void reduce_gradients();
  // fp16's overflow verdict and the gradient clip over what the ranks hold, agreed where the
  // gradients are in parts; returns (finite, the norm before clipping, on the device).
  std::pair<bool, torch::Tensor> unscale_and_clip(LossScaler& scaler, double max_norm);
  // After AdamW's update: every rank's updated slices to every rank (ZeRO-1/2), or the units
  // still whole marked stale (ZeRO-3).
  void after_update();
  // Every parameter finite, agreed over the ranks that hold parts (a collective).
  bool params_finite();

  // ---- checkpoints and the end ------------------------------------------------------------------
  // Host buffers for checkpoint.async, made once (open_outputs).
  void prepare_checkpoints(AsyncCheckpointWriter& writer, const TrainState& st);
  // One checkpoint of the model and optimizer with `st` (rank 0's), assembled as writes_shares()
  // says; returns its path on rank 0. Collective.
  std::string save(AsyncCheckpointWriter& writer, const TrainState& st);
  // Whether `generate` can run here: not under tensor parallelism; under ZeRO-3 on every rank at
  // once (each block gathered around its use).
  // Expert parallelism: on every rank too (each sparse layer exchanges tokens over the ep group).
  bool can_sample() const { return !tp_; }
  bool samples_on_every_rank() const { return units_.has_value() || ep_; }
  // The whole final parameters (tests; collective): tp shards gathered, ZeRO-3 units gathered.
  std::vector<std::pair<std::string, std::vector<float>>> whole_params();

  // ZeRO-3's units (tests, sampling); null under the other stages.
  ParamShards* units() { return units_ ? &*units_ : nullptr; }
  // ZeRO-3: the most units whole at once so far (0 under the other stages).
  size_t units_peak() const { return units_ ? units_->max_units_whole() : 0; }

 private:
  bool shards_optimizer() const { return stage_ >= 1; }
  // Pipeline parallelism: the whole model's parameters and moments on rank 0 (`into`, `state`:
  // rank 0's, else null; collective over the world).
  void gather_stages(GPT* into, FullOptimState* state);
  void exchange_tied();  // pipeline parallelism: a tied embedding's gradient summed between its two ends
  const Config& cfg_;
  Mesh& mesh_;
  const Topology& topo_;
  const GPTDims dims_;
  const TpPlace tp_place_;
  MpiComm mpi_comm_;
  const torch::Device device_;
  const bool tp_;
  const bool ep_;  // parallel.ep > 1
  const bool pp_;  // parallel.pp > 1
  // Pipeline parallelism: the whole model's names and shapes (every rank's), and where this stage
  // holds a tied embedding that the other end of the pipeline holds too, its index in params_ (its
  // gradient summed between them; the first stage's counted in the gradient norm).
  ParamShapes whole_names_;
  std::optional<size_t> tied_;
  const int stage_;
  bool shares_ = false;
  int writer_count_ = 1;

  GPT model_{nullptr};
  std::vector<torch::Tensor> params_;
  // Rank 0 writing checkpoints alone under tp or ZeRO-3: the whole host copy they gather into.
  std::optional<GPT> whole_model_;
  std::optional<GradSync> grad_sync_;
  // Expert parallelism: grad_sync_ averages the parameters every rank holds over the dp group, and
  // expert_sync_ this rank's experts over its expert replicas (then divided by ep: each expert's
  // gradient already sums its whole ep group's tokens).
  std::optional<GradSync> expert_sync_;
  std::vector<bool> is_expert_;  // per params_ entry
  std::vector<bool> tp_replicated_;  // per params_ entry (ep, pp): whole on every tp rank
  std::optional<ParamShards> units_;   // ZeRO-3
  std::optional<PowerSgd> powersgd_;   // comm.compress: powersgd
  std::optional<AdamW> opt_;
  const GradSync* slice_owner_ = nullptr;  // ZeRO-1/2/3: who owns which slices (state_sync.h)
  bool compressed_ = false;                // this step's gradients go through PowerSGD
  std::optional<CommDup> checkpoint_comm_;  // the writer thread's collectives (shares)
  CheckpointShare share_buffers_;           // shares + async: this rank's host copies
  FullOptimState gathered_;                 // rank 0 writing alone: the assembled optimizer state
  // Pipeline and expert parallelism, rank 0 writing: the first pipeline's ranks' host copy of their
  // stage, whole over ep (and tp), into which gather_stages gathers the stage's experts before
  // sending them on (made at the first save).
  std::optional<GPT> ep_stage_whole_;
  FullOptimState ep_stage_state_;
};

}  // namespace mpitrain
