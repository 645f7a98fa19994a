// The training loop. train() at the bottom reads top to bottom as the run's steps; each step is a
// member of Run, in the order it runs:
//   start-up (startup.cpp: MPI, layout, device, data)  -> build_model -> build_optimizer
//   -> describe -> resume_or_start -> open_outputs
// What depends on the layout (tensor parallelism, the ZeRO stage, PowerSGD, how a checkpoint is
// assembled and a resume scattered) is asked of par_ (parallelism.h), never branched on here.
//   -> per step: micro_batches -> sync_gradients -> clip_and_update -> log_step -> evaluate_if_due
//                -> checkpoint_if_due (signals, --stop-after)
//   -> finish (last async write, sample, parameters for tests)
#include "mpitrain/train.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mpitrain/amp.h"
#include "mpitrain/checkpoint.h"
#include "mpitrain/comm.h"
#include "mpitrain/consistency.h"
#include "mpitrain/device.h"
#include "mpitrain/diloco.h"
#include "mpitrain/durable.h"
#include "mpitrain/error.h"
#include "mpitrain/h5.h"
#include "mpitrain/hf_format.h"
#include "mpitrain/host_memory.h"
#include "mpitrain/libtorch_version.h"
#include "mpitrain/mc_eval.h"
#include "mpitrain/log.h"
#include "mpitrain/memory_plan.h"
#include "mpitrain/mesh.h"
#include "mpitrain/mfu.h"
#include "mpitrain/model.h"
#include "mpitrain/mpi_env.h"
#include "mpitrain/optim.h"
#include "mpitrain/parallelism.h"
#include "mpitrain/profiler.h"
#include "mpitrain/progress.h"
#include "mpitrain/shards.h"
#include "mpitrain/signals.h"
#include "mpitrain/startup.h"
#include "mpitrain/state_sync.h"
#include "mpitrain/pipeline.h"
#include "mpitrain/tensor_parallel.h"
#include "mpitrain/watchdog.h"

namespace mpitrain {
namespace {

bool every(int64_t step, int64_t n) { return n > 0 && step % n == 0; }

// Test fault (tests/cli_test.sh, tests/pp_test.sh): MPITRAIN_TEST_NONFINITE=STEP:RANK:WHAT makes
// something of step STEP not finite on RANK (or "all" ranks): "norm" its gradient norm (the update
// applied), "skipped" its gradient norm with the update skipped as after an fp16 overflow (which
// only the fp16 loss scaler does, on a GPU), "grad" one of this rank's gradients before the loss
// scaler's overflow check (with the scaler, see loss_scale_for_test: the step skipped wherever the
// check is agreed), "param" a parameter after the update. "" when none.
std::string nonfinite_for_test(int64_t step, int rank) {
  const char* spec = std::getenv("MPITRAIN_TEST_NONFINITE");
  if (!spec) return "";
  long long at = -1;
  char who[16] = {0}, what[16] = {0};
  if (std::sscanf(spec, "%lld:%15[^:]:%15s", &at, who, what) != 3 || at != step) return "";
  if (std::string(who) != "all" && std::atoi(who) != rank) return "";
  log::any_rank(log::Level::warn, concat("test fault MPITRAIN_TEST_NONFINITE: ", what, " at step ", step));
  return what;
}

// Test hook (tests/pp_test.sh): MPITRAIN_TEST_LOSS_SCALE=S runs fp16's dynamic loss scaler, from
// scale S, in an fp32 or bf16 run, as fp16 itself cannot on a CPU (a power of two leaves fp32's
// gradients bitwise). 0 when unset.
double loss_scale_for_test() {
  const char* s = std::getenv("MPITRAIN_TEST_LOSS_SCALE");
  return s ? std::atof(s) : 0.0;
}

// Inputs [rows, T] (int32: the embedding takes them as they are) and targets [rows, T] (int64:
// cross_entropy in libtorch 1.13 wants Long; the conversion is the copy clone() made anyway)
// from rows x (T+1) int32 window tokens.
std::pair<torch::Tensor, torch::Tensor> to_tensors(const std::vector<int32_t>& buf, int64_t rows, int64_t T) {
  torch::Tensor all = torch::from_blob(const_cast<int32_t*>(buf.data()), {rows, T + 1}, torch::kInt32);
  return {all.slice(1, 0, T).clone(), all.slice(1, 1, T + 1).to(torch::kInt64)};
}

// One rank's slice of one micro-step, read synchronously (evaluation).
std::pair<torch::Tensor, torch::Tensor> get_batch(const TokenDataset& data, uint64_t start, int rank,
                                                  int64_t rows, std::vector<int32_t>& buf) {
  buf.resize(static_cast<size_t>(rows * (data.seq_len() + 1)));
  data.batch(start, rank, rows, buf.data());
  return to_tensors(buf, rows, data.seq_len());
}

// A batch for the device. From pageable memory a host-to-device copy synchronises the stream;
// from pinned memory it is asynchronous, so the host goes on queueing the step.
torch::Tensor to_device(const torch::Tensor& t, const torch::Device& device) {
  if (!device.is_cuda()) return t;
  return t.pin_memory().to(device, /*non_blocking=*/true);
}

// Mean validation loss over eval.batches micro-batches per rank of `comm`: the same windows every
// time. `loss_of(x, y, b)`: batch b's loss, under autocast (undefined: none on this rank).
double evaluate_batches(GPT& model, const TokenDataset& val, Communicator& comm, const Config& cfg,
                        const torch::Device& device, Precision precision,
                        const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, int64_t)>& loss_of) {
  torch::NoGradGuard no_grad;
  model->eval();
  std::vector<int32_t> buf;
  const int64_t rows = cfg.train.micro_batch;
  torch::Tensor sum = torch::zeros({1}, torch::dtype(torch::kFloat64).device(device));
  for (int64_t b = 0; b < cfg.eval.batches; ++b) {
    auto [x, y] = get_batch(val, static_cast<uint64_t>(b * comm.size() * rows), comm.rank(), rows, buf);
    Autocast autocast(precision, device);
    if (const torch::Tensor loss = loss_of(x, y, b); loss.defined()) sum += loss.to(torch::kFloat64);
  }
  comm.all_reduce(sum, ReduceOp::avg);
  model->train();
  return sum.item<double>() / static_cast<double>(cfg.eval.batches);
}

double evaluate(GPT& model, const TokenDataset& val, Communicator& comm, const Config& cfg,
                const torch::Device& device, Precision precision) {
  return evaluate_batches(model, val, comm, cfg, device, precision, [&](const torch::Tensor& x, const torch::Tensor& y, int64_t) {
    return model->loss(to_device(x, device), to_device(y, device));
  });
}

// Pipeline parallelism with experts: the whole model's router counts (GPT::router_counts, int64)
// ride behind an activation or its gradient as fp32 values, each as 4096 hi + lo (exact to 2^36).
torch::Tensor pack_pipeline_routing(const torch::Tensor& routing) {
  const torch::Tensor c = routing.to(torch::kCPU, torch::kLong);
  return torch::cat({torch::div(c, 4096, "floor"), torch::remainder(c, 4096)}).to(torch::kFloat32);
}
torch::Tensor unpack_pipeline_routing(const torch::Tensor& values) {
  const torch::Tensor v = values.to(torch::kCPU, torch::kLong);
  const int64_t k = v.numel() / 2;
  return v.narrow(0, 0, k) * 4096 + v.narrow(0, k, k);
}

// Pipeline parallelism: evaluate()'s batches through the stages, forward only (each batch's
// activation to the next virtual stage, round the pipeline once per chunk); the last stage's mean
// over the replicas (with islands: every island's), then summed over the pipeline, where only the last stage's is
// not zero.
// Pipeline parallelism, forward only: token ids `x` [B, T] through this rank's chunks, each chunk's
// input from the previous virtual stage and its output sent to the next (round the pipeline once
// per chunk), tagged as micro-batch `tag`; returns the last chunk's output (on the last stage:
// after the final norm). Evaluation, the tasks' scoring and the final sample share it.
torch::Tensor pipeline_forward(GPT& model, PipeLink& link, const torch::Tensor& x, int64_t tag, const torch::Device& device) {
  const GPTDims& d = model->dims();
  const int64_t P = d.virtual_stages(), prev = (d.pp_stage + d.pp - 1) % d.pp, next = (d.pp_stage + 1) % d.pp;
  torch::Tensor out;
  for (int64_t c = 0; c < d.pp_virtual; ++c) {
    const int64_t vs = c * d.pp + d.pp_stage;  // this chunk's virtual stage
    const torch::Tensor in = vs == 0 ? to_device(x, device)
                                     : link.recv({x.size(0), x.size(1), d.n_embd}, prev, activation_tag(tag, vs - 1, P), device);
    out = model->stage_forward(in, c);
    if (vs + 1 < P) link.send(out, next, activation_tag(tag, vs, P));
  }
  return out;
}

double evaluate_pipeline(GPT& model, const TokenDataset& val, Mesh& mesh, const Config& cfg, const torch::Device& device,
                         Precision precision) {
  PipeLink link(mesh.pp_mpi());
  const auto through = [&](const torch::Tensor& x, const torch::Tensor& y, int64_t b) {
    const torch::Tensor out = pipeline_forward(model, link, x, b, device);
    return model->dims().last_stage() ? model->stage_loss(out, to_device(y, device)) : torch::Tensor();
  };
  torch::Tensor mean = torch::full({1}, evaluate_batches(model, val, mesh.replicas_comm(), cfg, device, precision, through),
                                   torch::dtype(torch::kFloat64).device(device));
  link.finish();
  mesh.pp().all_reduce(mean, ReduceOp::sum);
  return mean.item<double>();
}

// optim.fused: PyTorch's fused AdamW kernel where this libtorch has one for the device.
bool choose_fused_adamw(const Config& cfg, MpiComm mpi_comm, const torch::Device& device, int rank) {
  bool fused = false;
  if (cfg.optim.name == "sgd") {
    if (rank == 0) log::info("optimizer: SGD with decoupled weight decay (optim.name: sgd)");
    return false;
  }
  agree(mpi_comm, [&] { naming_config_file(cfg, [&] {
    const bool available = fused_adamw_available(device.type());
    if (cfg.optim.fused == "on" && !available)
      throw UsageError(concat("optim.fused: on, but ", libtorch_version(), " has no fused AdamW kernel for ",
                              device.is_cuda() ? "CUDA" : "the CPU",
                              " (it has one for the CPU from libtorch 2.4, for CUDA from 2.0); use auto or off"));
    fused = cfg.optim.fused != "off" && available && cfg.optim.state_dtype == "fp32";
  }); });
  const bool bf16_state = cfg.optim.state_dtype == "bf16";
  if (rank == 0)
    log::info(concat("optimizer: AdamW with ", fused ? "the fused kernel" : "multi-tensor (foreach) kernels", " (",
                     libtorch_version(), cfg.optim.fused == "off" ? ", optim.fused: off" : "",
                     bf16_state ? ", optim.state_dtype: bf16: moments stored stochastically rounded, updated per tensor"
                     : !fused && cfg.optim.fused != "off" ? ": no fused AdamW kernel for this device" : "", ")"));
  return fused;
}

// One training run: the state that lives from start-up to the end, and the steps as members.
class Run {
 public:
  Run(Config& cfg, Startup& startup, MpiComm mpi_comm, const TrainHooks& hooks)
      : cfg_(cfg), s_(startup), mpi_comm_(mpi_comm), hooks_(hooks), topo_(startup.topo), dims_(startup.dims),
        device_(startup.device), precision_(startup.precision), par_(cfg, *startup.mesh, startup.topo, startup.dims, startup.tp, startup.device,
                                                         startup.checkpoint_dir_blind_rank, mpi_comm),
        T_(startup.dims.seq_len),
        micro_(cfg.train.micro_batch), accum_(cfg.train.grad_accum),
        tokens_per_step_(cfg.train.global_batch * startup.dims.seq_len) {}

  // ---- start-up, in order ----------------------------------------------------------------------
  void build_model();
  void build_optimizer();
  void describe();
  void warn_if_state_does_not_fit() const;
  void log_initial_weights(int64_t tensors) const;
  void resume_or_start();
  void open_outputs();

  // ---- one optimizer step, in order ------------------------------------------------------------
  bool done() const { return st_.step >= cfg_.train.steps; }
  void begin_step();
  void micro_batches();
  void pipeline_micro_batches();  // parallel.pp: the step's micro-batches through the stages (pipeline.h)
  void sync_gradients();
  void clip_and_update();
  void outer_step();
  void log_step();
  void evaluate_if_due();
  bool checkpoint_if_due();  // false: stop here (a signal, --stop-after)

  TrainResult finish();
  void report_cpu_peaks(const char* what, int64_t mine) const;
  int64_t startup_cpu_peak_ = 0;

 private:
  int64_t step_number() const { return st_.step + 1; }  // the step under way, 1-based
  bool last_step() const { return step_number() == cfg_.train.steps; }
  void run_eval(int64_t at_step);
  void load_tasks();
  void run_tasks(int64_t at_step);
  void save();
  void diverged(int64_t at_step, const std::string& what);  // exit 2 on every rank (agree)

  Config& cfg_;
  Startup& s_;
  MpiComm mpi_comm_;
  const TrainHooks& hooks_;
  const Topology& topo_;
  const GPTDims& dims_;
  const torch::Device device_;
  const Precision precision_;
  // Tensor parallelism and the data-parallel stage: the model's gradient sync, its shards, the
  // optimizer, how checkpoints are assembled (parallelism.h).
  Parallelism par_;
  const int64_t T_, micro_, accum_, tokens_per_step_;

  GPT model_{nullptr};
  LossScaler scaler_{false};
  int64_t whole_params_ = 0;  // the whole model's (tensor parallel: not this rank's shards)

  TrainState st_;
  TrainResult result_;
  bool config_recorded_ = false;  // out_dir/config.yaml written (rank 0, at the first save)
  std::optional<Progress> progress_;
  std::optional<BatchPrefetcher> prefetch_;
  std::optional<AsyncCheckpointWriter> checkpoints_;
  std::optional<SpanTimer> comm_wait_;  // what backward did not hide of the gradient communication
  std::optional<StepProfiler> profiler_;
  std::optional<Diloco> diloco_;  // parallel.islands > 1: the outer steps between islands
  // With islands: the per-step checks (bad data, stop signals) agreed inside the island at once and
  // over the world a step's compute later (mpi_env.h), so that no step waits on the slow links.
  std::optional<LaggedAgreement> step_checks_;
  int agreed_signal_ = 0;  // the world's highest stop signal as of the step's start (step_checks_)
  // eval.tasks: each task's name and examples, and the shards' tokenizer that encodes them.
  std::vector<std::pair<std::string, std::vector<McExample>>> tasks_;
  TextEncoder encode_;
  std::string resumed_from_;      // rank 0: the checkpoint resumed
  bool resumed_diloco_ = false;   // it was a DiLoCo run's: each rank's state lies beside it
  void check_resumed_layout();    // (st_ still the checkpoint's)

  // The step under way.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches_;  // its micro-batches (inputs, targets)
  void add_router_sums();  // the model's last aux and z-loss (if any) into aux_sum_, z_sum_
  // parallel.pp with experts: every sparse layer's expert load of the step's last micro-batch
  // (collective over the pipeline), and the share of its token copies dropped (-1: dropless).
  std::pair<std::vector<double>, double> pipeline_expert_load();
  std::vector<RouterLog> last_logs_;  // parallel.pp with experts: per chunk, the step's last micro-batch's
  torch::Tensor loss_sum_, aux_sum_, z_sum_, norm_;  // aux_sum_, z_sum_: the experts' load-balancing and z-loss
  bool applied_ = true;  // the step's update was applied (false: fp16 overflowed, skipped)
  double lr_ = 0;
  // parallel.ep: ep_collective_seconds() at the last report, and evaluation's share since then
  double ep_mark_ = 0, ep_in_eval_ = 0;
  // parallel.pp: pipeline_wait_seconds() likewise; and over the whole run, the wall time of the
  // steps' micro-batches (pipeline_micro_batches) and the waits within it
  double pp_mark_ = 0, pp_in_eval_ = 0, step_seconds_ = 0, step_waits_ = 0;
  std::unique_ptr<PipeChannels> channels_;  // parallel.pp: the step's transfers (made at the first step)
  // parallel.pp: the host waits for the transfers (PipeChannels::host_waits), so the waiting is measured
  bool pp_waits_measured() const { return !channels_ || channels_->host_waits(); }
};

// The model (this rank's modules: tp shards; ZeRO-3 without values), the parallelisms applied to
// it, its initial weights (model.init_from, else drawn from train.seed) the same on every rank of
// a dp group, then the dropout streams.
void Run::build_model() {
  // On the CPU, libtorch's allocations are counted from here: the run's peak is reported at the
  // end (finish), as a GPU run reports its caching allocator's.
  if (!device_.is_cuda()) count_cpu_allocations();
  torch::manual_seed(cfg_.train.seed);
  model_ = par_.make_model(s_.options);
  par_.apply(model_);
  if (!cfg_.model.init_from.empty() && s_.has_resume)
    log::info(concat("model: resuming from a checkpoint; model.init_from (", cfg_.model.init_from, ") is not read"));
  if (!s_.has_resume) {  // (a resumed run's weights come from its checkpoint)
    const int64_t n = par_.initial_weights(cfg_.model.init_from);
    if (!cfg_.model.init_from.empty()) log_initial_weights(n);
  }
  // Dropout streams differ per data replica (as in DDP; every island's); the ranks of a tp group share
  // theirs, so the dropout of the activations they all hold (embeddings, residual stream) is the
  // same on each. The model above was drawn before this.
  torch::manual_seed(cfg_.train.seed + 7919 * static_cast<uint64_t>(s_.mesh->replica() + 1));
  for (const auto& [name, p] : model_->named_params()) {
    int64_t n = 1;
    for (int64_t e : tp_whole_shape(p.sizes(), model_->tp_split(name), model_->tp().size)) n *= e;
    whole_params_ += n;
  }
  whole_params_ += model_->remote_expert_params();  // (expert parallelism: the experts other ranks hold)
  if (par_.pipeline_parallel()) {  // every stage's
    whole_params_ = 0;
    for (const auto& [name, shape] : par_.whole_names()) {
      int64_t n = 1;
      for (int64_t e : shape) n *= e;
      whole_params_ += n;
    }
  }
}

// AdamW over what this rank updates and the fp16 loss scaler.
void Run::build_optimizer() {
  par_.make_optimizer(choose_fused_adamw(cfg_, mpi_comm_, device_, topo_.rank));
  const double test_scale = loss_scale_for_test();
  scaler_ = test_scale > 0 ? LossScaler(true, test_scale) : LossScaler(precision_ == Precision::fp16);
  if (topo_.rank == 0 && device_.is_cuda()) warn_if_state_does_not_fit();
}

void Run::log_initial_weights(int64_t tensors) const {
  log::info(concat("model: initial weights from ", cfg_.model.init_from, " (", tensors, " tensors",
                   par_.describe_initial_weights(), ")"));
}

// On a GPU: the model state this layout keeps per rank (memory_plan.h's count, activations not
// included) against the device's memory; more than it is a warning naming `mpitrain plan`.
void Run::warn_if_state_does_not_fit() const {
  MemoryInputs in;
  for (const auto& p : par_.params()) in.params += p.numel();
  in.dp = s_.layout.dp;
  in.bucket_mb = cfg_.comm.bucket_mb;
  in.moment_bytes = cfg_.optim.state_dtype == "bf16" ? 2 : 4;
  const int zero = par_.zero_stage();
  const double state = memory_row(in, zero, "none").peak();  // no activations given: the state alone
  const double total = static_cast<double>(cuda_total_memory_bytes(device_.index()));
  if (total > 0 && state > 0.9 * total)
    log::warn(concat("memory: the model state alone (weights, gradients, their buffers, AdamW; optim.zero: ", zero,
                     ") needs ", state / (1 << 30), " GiB per rank of this GPU's ", total / (1 << 30),
                     " GiB, before any activation: this run will run out of memory; `mpitrain plan --memory GIB` ",
                     "under the same mpirun shows the layouts that fit"));
}

// The start-up lines: model, batch, gradient communication, data.
void Run::describe() {
  const MeshLayout& layout = s_.layout;
  log::info(describe_model(dims_, whole_params_));
  log::info(concat("batch: ", micro_, " micro x ", layout.replicas(), " ranks",
                   layout.islands > 1 ? concat(" (", layout.islands, " islands x ", layout.dp, ")") : std::string(),
                   " x ", accum_, " accum = ", cfg_.train.global_batch,
                   " sequences = ", tokens_per_step_, " tokens per step; ", par_.describe_buckets(), "; ", s_.threads,
                   " threads per rank; backend ", s_.mesh->dp().name()));
  if (const std::string traffic = par_.describe_gradient_traffic(accum_); !traffic.empty()) log::info(traffic);
  if (par_.pipeline_parallel()) {
    std::string stages;
    for (int64_t s = 0; s < dims_.pp; ++s) {
      GPTDims at = dims_;
      at.pp_stage = s;
      stages += s ? " | " : "";
      for (int64_t c = 0; c < at.pp_virtual; ++c) stages += concat(c ? " + " : "", at.chunk_begin(c), "-", at.chunk_end(c) - 1);
    }
    const int64_t v = dims_.pp_virtual;
    const double kib = static_cast<double>(micro_ * T_ * dims_.n_embd * 4) / 1024;
    log::info(concat("pipeline: ", dims_.pp, " stages of blocks ", stages, " (the embedding on the first, the head on the last",
                     !dims_.llama() || dims_.tie_embeddings ? ", the tied embedding's gradient summed between them" : "",
                     "); ", cfg_.parallel.pp_schedule, v > 1 ? concat(" (", v, " chunks per stage)") : std::string(), " over ",
                     accum_, " micro-batches per step: bubble (pp - 1) / ", v > 1 ? "(v m)" : "m", " = ",
                     std::lround(100 * pipeline_bubble(dims_.pp, accum_, v)), "% of the ideal step; ", kib,
                     " KiB per micro-batch's activation (and its gradient) between stages",
                     v > 1 ? concat(", ", v, " times each way") : std::string()));
  }
  const TokenDataset& train = *s_.train_data;
  log::info(concat("data: ", train.num_tokens(), " train tokens in ", train.paths().size(), " shards (",
                   train.num_windows(), " windows/epoch)",
                   s_.val_data ? concat(", ", s_.val_data->num_tokens(), " val tokens") : std::string()));
}

// The run's state: fresh, or the newest readable checkpoint's (any layout); then every rank
// checks that all run the same binary on the same config and data.
void Run::resume_or_start() {
  const TokenDataset& train = *s_.train_data;
  st_.world_size = topo_.size;
  st_.tokenizer = train.tokenizer();
  st_.tokenizer_file = train.tokenizer_file();
  st_.tokenizer_sha256 = train.tokenizer_sha256();
  st_.eot_token = train.eot_token();
  if (s_.has_resume) {
    resumed_from_ = par_.resume(s_.resume, st_);
    resumed_diloco_ = st_.islands > 1;
    check_resumed_layout();
    scaler_.restore(st_.loss_scale, st_.loss_scale_good_steps);  // fp16: the scale continues
    if (topo_.rank == 0) log_batch_change(st_, cfg_, s_.layout.replicas());
  }
  st_.world_size = topo_.size;
  st_.dp = s_.layout.dp;
  st_.tp = s_.layout.tp;
  st_.zero = par_.zero_stage();
  st_.islands = s_.layout.islands;
  st_.config_yaml = to_yaml(cfg_);
  // --stop-after N names an absolute step; a run resumed at or past it has nothing to do.
  if (hooks_.stop_after >= 0 && st_.step >= hooks_.stop_after)
    agree(mpi_comm_, [&] {
      throw UsageError(concat("command line: --stop-after ", hooks_.stop_after, ": the run resumes at step ",
                              st_.step, ", already there (it counts absolute steps; use a larger N)"));
    });
  // Same binary, config and data everywhere? ("code not synced on node 2")
  agree(mpi_comm_, [&] {
    check_consistency(mpi_comm_, topo_,
                      {binary_fingerprint(), h5::crc32(st_.config_yaml.data(), st_.config_yaml.size()),
                       shard_list_fingerprint(train.paths())});
  });
  result_.num_params = model_->num_params();
}

// A DiLoCo checkpoint (island 0's state in the file, each rank's own beside it) resumes only in
// the layout that wrote it; a plain checkpoint in any, with islands too (theta_outer: its weights).
void Run::check_resumed_layout() {
  const MeshLayout& l = s_.layout;
  const std::string was = diloco_layout(st_.world_size, st_.islands, st_.dp, st_.tp, st_.zero);
  const std::string now = diloco_layout(topo_.size, l.islands, l.dp, l.tp, par_.zero_stage());
  if (!resumed_diloco_ || was == now) return;
  agree(mpi_comm_, [&] {
    if (topo_.rank != 0) return;
    naming_config_file(cfg_, [&] {
      throw UsageError(concat("parallel.islands: checkpoint ", resumed_from_, " was written by a DiLoCo run of ",
                              was, "; this run is ", now,
                              ": a DiLoCo checkpoint resumes only in the layout that wrote it (each rank's state lies in ",
                              Diloco::state_dir(resumed_from_), "/); resume it so, or start a new run from its weights ",
                              "(mpitrain export, then model.init_from; or checkpoint.resume: none)"));
    });
  });
}

// Metrics (MFU, TensorBoard), the run's config.yaml, the batch prefetcher, the checkpoint writer
// and its host buffers, the timers; then the untrained baseline evaluation of a fresh run.
void Run::open_outputs() {
  RunFacts facts;
  facts.tokens_per_step = tokens_per_step_;
  facts.first_step = st_.step;
  // Parameters that cost no matrix FLOPs: GPT-2's position table, and an untied Llama's input
  // embedding (a lookup; tied, it is also the output layer and counts). SwiGLU's three matrices
  // and GQA's smaller k/v projections count through the parameter total.
  const int64_t lookup_only =
      dims_.llama() ? (dims_.tie_embeddings ? 0 : dims_.vocab_size * dims_.n_embd) : dims_.seq_len * dims_.n_embd;
  // A mixture of experts: the parameters each token uses (its k experts of each sparse layer).
  facts.flops_per_token = model_flops_per_token(whole_params_ - model_->inactive_params(), lookup_only, dims_.n_layer, dims_.attn_width(), T_);
  facts.communicates = s_.layout.replicas() > 1;
  facts.loss_scaling = scaler_.enabled();
  facts.host = topo_.host;
  {  // MFU against log.peak_tflops, else the known peak of this GPU (rank 0's; one kind per job)
    const std::string gpu = device_.is_cuda() ? cuda_device_name(device_.index()) : "";
    const double peak =
        cfg_.log.peak_tflops > 0 ? cfg_.log.peak_tflops : known_peak_tflops(gpu, precision_name(precision_));
    facts.peak_flops = peak * 1e12 * topo_.size;
    if (topo_.rank == 0)
      log::info(concat("MFU: ", facts.flops_per_token / 1e6, " MFLOPs per token (6N + 12 L d T; docs/operations.md) vs ",
                       peak > 0 ? concat(peak, " TFLOPS per ", device_.is_cuda() ? "GPU" : "rank",
                                         cfg_.log.peak_tflops > 0
                                             ? " (log.peak_tflops)"
                                             : concat(" (", gpu, ", ", precision_name(precision_), ")"))
                       : device_.is_cuda() ? concat("an unknown peak (", gpu, "): set log.peak_tflops for MFU")
                                           : std::string("no peak on the CPU: set log.peak_tflops for MFU")));
  }
  // The metrics file opens (or fails, naming log.metrics) before anything is written to out_dir.
  agree(mpi_comm_, [&] { naming_config_file(cfg_, [&] { progress_.emplace(cfg_, topo_.rank == 0, facts); }); });
  prefetch_.emplace(*s_.train_data, s_.mesh->replica(), micro_);
  result_.checkpoint_writers = par_.writers();
  checkpoints_.emplace(cfg_.checkpoint.dir, cfg_.checkpoint.keep, cfg_.checkpoint.async);
  par_.prepare_checkpoints(*checkpoints_, st_);
  comm_wait_.emplace(device_.is_cuda(), device_.is_cuda() ? device_.index() : -1);
  profiler_.emplace(topo_.rank == 0 ? cfg_.log.profile_start : 0, cfg_.log.profile_steps,
                    cfg_.train.out_dir + "/profile/rank-0.json", device_.is_cuda() ? device_.index() : -1);
  model_->train();
  if (s_.layout.islands > 1) {  // theta_outer from the weights the run starts from
    agree(mpi_comm_, [&] {
      naming_config_file(cfg_, [&] {
        if (cfg_.diloco.fragments > dims_.n_layer)
          throw UsageError(concat("diloco.fragments must be <= the model's ", dims_.n_layer,
                                  " blocks (a fragment is a set of whole blocks, L mod fragments), got ",
                                  cfg_.diloco.fragments));
      });
    });
    diloco_.emplace(cfg_.diloco, *s_.mesh, par_.optimizer(), par_.zero_stage(), dims_.n_layer);
    step_checks_.emplace(mpi_comm_, s_.mesh->island_mpi());
    if (resumed_diloco_) {  // each rank's state beside the checkpoint
      const std::string dir = allgather_text(mpi_comm_, Diloco::state_dir(resumed_from_), 1 << 16)[0];  // rank 0's
      if (model_->run().routing_bias) diloco_->set_island_state(model_->routing_bias());  // (its island's own)
      diloco_->load(dir, st_.step);
      if (model_->run().routing_bias) model_->set_routing_bias(diloco_->island_state());
    }
    par_.after_update();
    if (topo_.rank == 0) log::info(diloco_->describe(whole_params_));
  }
  if (cpu_allocations_counted()) {  // the steps' peak apart from start-up's (model, optimizer, resume)
    startup_cpu_peak_ = cpu_peak_allocated_bytes();
    reset_cpu_peak();
  }
  load_tasks();
  if (s_.val_data && cfg_.eval.every > 0 && st_.step == 0) run_eval(0);  // the untrained baseline
  if (!tasks_.empty() && (cfg_.eval.tasks_every > 0 || cfg_.eval.every > 0) && st_.step == 0) run_tasks(0);
}

// eval.tasks: every rank reads each task file (as it reads the shards) with the shards' tokenizer.
void Run::load_tasks() {
  if (cfg_.eval.tasks.empty()) return;
  agree(mpi_comm_, [&] { naming_config_file(cfg_, [&] {
    const TokenDataset& data = *s_.train_data;
    if (!cfg_.eval.tokenizer.empty()) {  // named: its vocabulary must be the shards'
      int64_t vocab = 0;
      try {
        encode_ = encoder_at(cfg_.eval.tokenizer, &vocab);
      } catch (const UsageError& e) {
        throw UsageError(concat("eval.tokenizer: ", e.what()));
      }
      if (vocab > data.vocab_size())
        throw UsageError(concat("eval.tokenizer: ", cfg_.eval.tokenizer, " has ", vocab, " tokens, the shards' vocabulary ",
                                data.vocab_size(), ": not the tokenizer they were packed with"));
    } else if (data.tokenizer() == "byte") {
      encode_ = byte_encoder();
    } else if (data.tokenizer() == "hf") {
      encode_ = tokenizer_encoder(data.tokenizer_file());
    } else {
      throw UsageError(concat("eval.tokenizer: the shards were packed with the '", data.tokenizer(),
                              "' tokenizer, whose files they do not record: name them (a GPT-2 BPE directory with "
                              "vocab.json + merges.txt or encoder.json + vocab.bpe, or a tokenizer.json)"));
    }
    for (const std::string& spec : cfg_.eval.tasks) {
      const TaskSpec t = parse_task_spec(spec, "eval.tasks");
      tasks_.emplace_back(t.name, read_mc_task(t.file, t.limit));
    }
  }); });
  if (topo_.rank == 0) {
    std::string list;
    for (const auto& [name, examples] : tasks_) list += concat(list.empty() ? "" : ", ", name, " (", examples.size(), " examples)");
    log::info(concat("eval.tasks: ", list, ", scored ",
                     cfg_.eval.tasks_every > 0 ? concat("every ", cfg_.eval.tasks_every, " steps")
                                               : concat("with each validation pass (every ", cfg_.eval.every, " steps)"),
                     " and at the end, split over ", s_.mesh->replicas_comm().size(), " replicas (acc and acc_norm as "
                     "lm-evaluation-harness scores them)"));
  }
}

void Run::run_tasks(int64_t at_step) {
  for (const auto& [name, examples] : tasks_) {
    const double ep0 = ep_collective_seconds();
    Communicator& replicas = s_.mesh->replicas_comm();
    LogProbs through;  // pipeline parallelism: each batch through the stages' chunks, forward only
    std::optional<PipeLink> link;
    int64_t batch = 0;
    if (par_.pipeline_parallel()) {
      link.emplace(s_.mesh->pp_mpi());
      through = [&](const torch::Tensor& x, const torch::Tensor& y) {
        // (tags below the tied embedding's, reused after kPipeTagEnd / 2P batches: each batch's sends are done before the next)
        const int64_t b = batch++ % (kPipeTagEnd / (2 * model_->dims().virtual_stages()));
        const torch::Tensor out = pipeline_forward(model_, *link, x, b, device_);
        link->finish();
        return model_->dims().last_stage() ? model_->stage_target_log_probs(out, y) : torch::Tensor();
      };
    }
    const McResult r = progress_->untimed([&] {
      return score_mc(model_, examples, encode_, replicas.rank(), replicas.size(), replicas, device_, precision_, micro_,
                      through, par_.pipeline_parallel() ? &s_.mesh->pp() : nullptr);
    });
    ep_in_eval_ += ep_collective_seconds() - ep0;
    result_.task_accuracies.push_back({at_step, name, r.acc, r.acc_norm});
    if (topo_.rank == 0) progress_->report_task(at_step, name, r.acc, r.acc_norm, r.examples, r.seconds);
  }
}

void Run::begin_step() {
  progress_->start_step();
  profiler_->begin_step(step_number());
  par_.begin_step(st_.step);
  Watchdog::set_step(step_number());
  maybe_hang_for_test(topo_.rank, step_number());
}

// Forward and backward of train.grad_accum micro-batches; the last backward starts the gradient
// communication (overlapped with it where comm.overlap allows). The loss stays on the device
// until a log step reads it: no host synchronisation per step.
void Run::micro_batches() {
  // The step's micro-batches are read first. A bad window (a token outside the vocabulary) that
  // several ranks find at once is then one message, the lowest rank's, and every rank ends
  // (exit 2) before any collective of the step: one small all-reduce per step. With islands that
  // all-reduce is the island's, and the world's verdict (with the stop signals) completes after
  // the step's compute (step_checks_): an island with bad data ends before its step, the others
  // after theirs, before any collective that crosses islands.
  const uint64_t micro_stride = static_cast<uint64_t>(s_.layout.replicas() * micro_);
  batches_.clear();
  std::string bad_data;
  try {
    for (int64_t m = 0; m < accum_; ++m) {
      const uint64_t start = st_.data_cursor + static_cast<uint64_t>(m) * micro_stride;
      // The next micro-batch follows in the global order, also across the step boundary.
      batches_.push_back(to_tensors(prefetch_->take(start, start + micro_stride), micro_, T_));
      if (log::enabled(log::Level::debug)) {  // which samples this rank trains on (tests/cli_test.sh)
        const uint64_t first = start + static_cast<uint64_t>(s_.mesh->replica() * micro_);
        log::debug(concat("data: step ", step_number(), " micro ", m, " windows ", first, "-", first + micro_ - 1));
      }
    }
  } catch (const UsageError& e) {
    bad_data = e.what();
  }
  const auto check = [&] {
    if (!bad_data.empty()) throw UsageError(bad_data);
  };
  if (step_checks_) {
    step_checks_->post(check, pending_stop_signal());
  } else {
    Watchdog::Scope watch("all_reduce(data check)");
    agree(mpi_comm_, check);
  }
  loss_sum_ = torch::zeros({1}, torch::dtype(torch::kFloat64).device(device_));
  aux_sum_ = torch::zeros({1}, torch::dtype(torch::kFloat64).device(device_));
  z_sum_ = torch::zeros({1}, torch::dtype(torch::kFloat64).device(device_));
  if (par_.pipeline_parallel()) {
    const auto t0 = std::chrono::steady_clock::now();
    const double w0 = pipeline_wait_seconds();
    pipeline_micro_batches();
    step_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    step_waits_ += pipeline_wait_seconds() - w0;
    return;
  }
  for (int64_t m = 0; m < accum_; ++m) {
    const auto& [x, y] = batches_[static_cast<size_t>(m)];
    torch::Tensor loss;
    {
      Autocast autocast(precision_, device_);
      loss = model_->loss(to_device(x, device_), to_device(y, device_));
    }
    par_.before_backward(m + 1 == accum_);
    scaler_.scale_loss(loss / static_cast<double>(accum_)).backward();
    par_.after_backward(m + 1 == accum_);
    loss_sum_ += loss.detach().to(torch::kFloat64);
    add_router_sums();
  }
}

void Run::add_router_sums() {
  if (model_->last_aux_loss().defined()) aux_sum_ += model_->last_aux_loss().detach().to(torch::kFloat64);
  if (model_->last_z_loss().defined()) z_sum_ += model_->last_z_loss().detach().to(torch::kFloat64);
}

std::pair<std::vector<double>, double> Run::pipeline_expert_load() {
  const GPTDims& d = model_->dims();
  // Each sparse layer's load at its row among the model's (every row some stage's; max over the
  // pipeline: the others leave it at 0, a load is >= 1).
  torch::Tensor load = torch::zeros({d.sparse_layers()}, torch::kFloat64);
  torch::Tensor dropped = torch::zeros({2}, torch::kFloat64);  // copies dropped, copies routed
  for (int64_t c = 0; c < d.pp_virtual && static_cast<size_t>(c) < last_logs_.size(); ++c) {
    const RouterLog& log = last_logs_[static_cast<size_t>(c)];
    const std::vector<double> mine = GPTImpl::expert_load(log);
    for (size_t k = 0; k < mine.size(); ++k) load[d.sparse_layers(d.chunk_begin(c)) + static_cast<int64_t>(k)] = mine[k];
    dropped[0] += static_cast<double>(log.dropped), dropped[1] += static_cast<double>(log.copies);
  }
  s_.mesh->pp().all_reduce(load, ReduceOp::max);
  s_.mesh->pp().all_reduce(dropped, ReduceOp::sum);
  const std::vector<double> out(load.data_ptr<double>(), load.data_ptr<double>() + load.numel());
  const double share = model_->run().capacity_factor > 0 && dropped[1].item<double>() > 0
                           ? dropped[0].item<double>() / dropped[1].item<double>()
                           : -1;
  return {out, share};
}

// Pipeline parallelism: the schedule's forwards and backwards of the step's micro-batches on this
// stage (pipeline.h). A forward takes its input from the previous stage (the first: the token
// ids), keeps it and its output for the backward and sends the output on; the last stage's is the
// micro-batch's loss. A backward takes the output's gradient from the next stage (the last: the
// loss's, scaled as the unpipelined step scales it) and sends the input's gradient back. Only the
// last stage's loss_sum_ (with experts: and every stage's load-balancing terms) is the step's
// (log_step sums it over the pipeline).
void Run::pipeline_micro_batches() {
  const GPTDims& d = model_->dims();
  if (!channels_)  // (the first step: every rank of the pipeline makes its channels here)
    channels_ = std::make_unique<PipeChannels>(s_.mesh->pp_mpi(), d.pp_virtual > 1, cfg_.comm.backend, device_);
  // Per chunk and micro-batch (interleaved: a chunk j is virtual stage j pp + stage, whose
  // neighbours are the previous and the next rank of the pipeline, round from the last to the first).
  const int64_t v = d.pp_virtual, P = d.virtual_stages();
  std::vector<torch::Tensor> inputs(static_cast<size_t>(accum_ * v)), outputs(static_cast<size_t>(accum_ * v));
  const std::vector<int64_t> shape{micro_, T_, d.n_embd};
  // With experts, the load-balancing loss needs every sparse layer's token counts: each forward
  // sends the counts and rows of the virtual stages so far behind its activation, the last one
  // adds its own to the whole model's and adds its layers' terms to the loss, and each backward
  // hands those totals back behind its gradient, so every chunk adds its layers' terms
  // (GPT::router_terms) before its backward.
  const bool routed = d.has_experts();
  const int64_t n = micro_ * T_ * d.n_embd, extra = routed ? 2 * model_->router_counts(RouterLog()).numel() : 0;
  std::vector<RouterLog> logs(routed ? static_cast<size_t>(accum_ * v) : 0);
  if (routed) last_logs_.resize(static_cast<size_t>(v));
  std::vector<torch::Tensor> totals(logs.size());  // the whole model's router_counts
  const auto unpack = [&](const torch::Tensor& got, torch::Tensor* routing) {  // a received activation or gradient
    if (routed && routing) *routing = unpack_pipeline_routing(got.narrow(0, n, extra));
    return got.narrow(0, 0, n).view(shape);
  };
  const auto pack = [&](const torch::Tensor& t, const torch::Tensor& routing) {
    return routed ? torch::cat({t.reshape({-1}).to(torch::kFloat32), pack_pipeline_routing(routing).to(t.device())}) : t;
  };
  const std::vector<PipeStep> steps = pipeline_schedule(cfg_.parallel.pp_schedule, d.pp, d.pp_stage, accum_, v);
  const PipeStep last_step = steps.back();  // (every schedule's last step is a backward: it completes the step)
  const auto forward = [&](const PipeStep& s, const torch::Tensor& got) {
    const auto at = static_cast<size_t>(s.chunk * accum_ + s.micro);
    const int64_t vs = s.chunk * d.pp + d.pp_stage;
    torch::Tensor routing;  // the counts and rows of the virtual stages before this one
    torch::Tensor in = vs == 0 ? to_device(batches_[static_cast<size_t>(s.micro)].first, device_)
                               : unpack(got, &routing).requires_grad_(true);
    torch::Tensor out;
    {
      Autocast autocast(precision_, device_);
      out = model_->stage_forward(in, s.chunk);
      if (routed) {
        logs[at] = model_->take_router_log();
        model_->count_routed(logs[at], s.chunk);
        const torch::Tensor mine = model_->router_counts(logs[at]);
        routing = routing.defined() ? routing + mine : mine;
      }
      if (vs + 1 == P) {
        out = model_->stage_loss(out, to_device(batches_[static_cast<size_t>(s.micro)].second, device_));
        if (routed) {
          totals[at] = routing;
          out = out + model_->router_terms(logs[at], routing);
          add_router_sums();
        }
      }
    }
    inputs[at] = in, outputs[at] = out;
    if (vs + 1 < P) return pack(out, routing);
    loss_sum_ += out.detach().to(torch::kFloat64);
    return torch::Tensor();
  };
  const auto backward = [&](const PipeStep& s, const torch::Tensor& got) {
    const auto at = static_cast<size_t>(s.chunk * accum_ + s.micro);
    const int64_t vs = s.chunk * d.pp + d.pp_stage;
    // (Overlapped gradient reduction armed for the last backward: the gradients of a chunk whose
    // backwards ended before it are read whole when the step reduces them.)
    const bool completes = s.micro == last_step.micro && s.chunk == last_step.chunk;
    par_.before_backward(completes);
    if (vs + 1 == P) {
      scaler_.scale_loss(outputs[at] / static_cast<double>(accum_)).backward();
    } else {
      const torch::Tensor grad = unpack(got, routed ? &totals[at] : nullptr).to(outputs[at].scalar_type());
      if (routed && !logs[at].prob_sums.empty()) {  // this chunk's layers' load-balancing terms
        const torch::Tensor terms = model_->router_terms(logs[at], totals[at]);
        add_router_sums();
        loss_sum_ += terms.detach().to(torch::kFloat64);
        const torch::Tensor scaled = scaler_.scale_loss(terms / static_cast<double>(accum_));
        torch::autograd::backward({outputs[at], scaled}, {grad, torch::ones_like(scaled)});
      } else {
        outputs[at].backward(grad);
      }
    }
    par_.after_backward(completes);
    const torch::Tensor back = vs > 0 ? pack(inputs[at].grad(), routed ? totals[at] : torch::Tensor()) : torch::Tensor();
    if (routed && s.micro + 1 == accum_) last_logs_[static_cast<size_t>(s.chunk)] = std::move(logs[at]);  // (the load reported)
    inputs[at] = torch::Tensor(), outputs[at] = torch::Tensor();  // this micro-batch's activations go
    if (routed) logs[at] = RouterLog(), totals[at] = torch::Tensor();
    return back;
  };
  run_pipeline_steps(*channels_, steps, d.pp, d.pp_stage, v, n + extra, forward, backward);
}

// The gradients averaged over the data-parallel ranks (ZeRO-1: reduce-scattered, each rank holds
// its slices; PowerSGD: its low-rank factors).
void Run::sync_gradients() {
  comm_wait_->begin();
  par_.reduce_gradients();
  comm_wait_->end();
}

// fp16's overflow check, gradient clipping and the AdamW update (ZeRO-1: then the all-gather of
// the updated slices); the step's counters advance either way.
void Run::clip_and_update() {
  const std::string fault = nonfinite_for_test(step_number(), topo_.rank);
  if (fault == "grad" && par_.optimizer().size() > 0 && par_.optimizer().grad(0).defined()) {
    torch::NoGradGuard no_grad;
    par_.optimizer().grad(0).fill_(std::numeric_limits<double>::infinity());
  }
  auto [finite, norm] = par_.unscale_and_clip(scaler_, cfg_.optim.grad_clip);  // the same verdict on every rank
  if (fault == "norm" || fault == "skipped") norm = torch::full_like(norm, std::numeric_limits<double>::infinity());
  if (fault == "skipped") finite = false;
  norm_ = norm;
  applied_ = finite;
  lr_ = lr_at(cfg_.optim, cfg_.train.steps, st_.step);
  if (finite) {
    par_.optimizer().step(lr_);
    comm_wait_->begin();  // (ZeRO-1/2: every rank's updated slices to every rank)
    par_.after_update();
    comm_wait_->end();
  } else if (topo_.rank == 0) {
    log::warn(concat("step ", step_number(), ": fp16 gradients overflowed at loss scale ", scaler_.scale(),
                     "; step skipped"));
  }
  if (fault == "param") {
    torch::NoGradGuard no_grad;
    model_->parameters().front().fill_(std::numeric_limits<double>::quiet_NaN());
  }
  scaler_.update(finite);
  // Aux-loss-free balancing: the step's expert loads over the dp group move the routing bias.
  if (cfg_.train.moe_bias_update_rate > 0) model_->update_routing_bias(cfg_.train.moe_bias_update_rate, s_.mesh->dp());
  par_.optimizer().zero_grad();
  profiler_->end_step(step_number());
  st_.step += 1;
  st_.data_cursor += static_cast<uint64_t>(cfg_.train.global_batch);
  st_.tokens_seen += tokens_per_step_;
  // The world's verdict on this step's checks, before the outer step crosses islands.
  if (step_checks_) agreed_signal_ = step_checks_->complete();
  if (diloco_) outer_step();
}

// DiLoCo: the exchanges due (the islands' pseudo-gradients averaged, theta_outer's Nesterov step,
// every island on from it; streaming: per fragment) and those whose turn it is started (diloco.h);
// when the slots changed, what after_update does after any update (ZeRO's all-gathers).
void Run::outer_step() {
  comm_wait_->begin();
  const bool changed = diloco_->after_step(st_.step, cfg_.train.steps);
  if (changed) par_.after_update();
  if (changed && model_->run().routing_bias) {  // the islands' routing biases averaged with the outer step
    torch::Tensor bias = model_->routing_bias().to(device_);
    s_.mesh->islands()->all_reduce(bias, ReduceOp::avg);
    model_->set_routing_bias(bias.cpu());
  }
  comm_wait_->end();
  if (changed && topo_.rank == 0)
    progress_->report_outer(st_.step, diloco_->outer_steps(), static_cast<double>(diloco_->bytes_sent()) / (1 << 20),
                            diloco_->seconds());
}

// Every log.every steps and at the last: the loss averaged over the ranks, the report (console,
// metrics.jsonl, TensorBoard), and the divergence check. The verdict must be every rank's (it
// ends them all): the loss is averaged, and so is a flag for a non-finite gradient norm of an
// applied step, because the norm is only its island's (DiLoCo) and a step that fp16 skipped
// (overflow) has a non-finite norm without anything having diverged.
void Run::log_step() {
  const int64_t step = st_.step;  // just completed
  if (!every(step, cfg_.log.every) && step != cfg_.train.steps) return;
  double grad_norm = 0;
  {
    Watchdog::Scope watch("device synchronize (gradient norm)");
    grad_norm = norm_.item<double>();
  }
  const bool bad_norm = applied_ && !std::isfinite(grad_norm);
  auto reduced = torch::cat({loss_sum_, torch::full({1}, bad_norm ? 1.0 : 0.0, loss_sum_.options()), aux_sum_, z_sum_});
  s_.mesh->replicas_comm().all_reduce(reduced, ReduceOp::avg);
  if (par_.pipeline_parallel()) s_.mesh->pp().all_reduce(reduced, ReduceOp::sum);  // (the last stage's loss; 0 elsewhere)
  double loss = 0, any_bad_norm = 0, aux = -1, z = -1;
  {
    Watchdog::Scope watch("device synchronize (loss)");  // a stuck GPU collective shows here
    const auto host = reduced.cpu();
    loss = host[0].item<double>() / static_cast<double>(accum_);
    any_bad_norm = host[1].item<double>();
    // (a pipeline: a stage may hold no sparse layer, but the sums are the pipeline's)
    const bool routed = par_.pipeline_parallel() && dims_.sparse_layers() > 0;
    if (model_->last_aux_loss().defined() || routed) aux = host[2].item<double>() / static_cast<double>(accum_);
    if (model_->last_z_loss().defined() || (routed && model_->run().z_loss_coef > 0))
      z = host[3].item<double>() / static_cast<double>(accum_);
  }
  result_.losses.emplace_back(step, loss);
  if (!std::isfinite(loss) || any_bad_norm > 0)  // the same values on every rank
    diverged(step, concat("the loss is ", loss, " and the gradient norm ", grad_norm,
                          any_bad_norm > 0 && !bad_norm ? " here, not finite on another rank" : ""));
  StepReport report{step - 1, loss, lr_, grad_norm, comm_wait_->take_seconds(),
                    scaler_.enabled() ? scaler_.scale() : 0.0, aux, {}};
  if (par_.pipeline_parallel() && aux >= 0)  // (collective over the pipeline)
    std::tie(report.expert_load, report.dropped) = pipeline_expert_load();
  else if (topo_.rank == 0 && aux >= 0)
    report.expert_load = model_->expert_load(), report.dropped = model_->dropped_share();
  if (s_.train_data->sources() > 0)  // the windows trained so far, per source, as tokens (each window's seq_len targets)
    for (uint64_t w : s_.train_data->source_windows(st_.data_cursor)) report.source_tokens.push_back(static_cast<double>(w * T_));
  report.z_loss = z;
  if (par_.expert_parallel()) {
    const double now = ep_collective_seconds();
    report.ep_seconds = std::max(0.0, now - ep_mark_ - ep_in_eval_);
    ep_mark_ = now, ep_in_eval_ = 0;
  }
  if (par_.pipeline_parallel() && pp_waits_measured()) {
    const double now = pipeline_wait_seconds();
    report.pp_wait_seconds = std::max(0.0, now - pp_mark_ - pp_in_eval_);
    pp_mark_ = now, pp_in_eval_ = 0;
  }
  if (topo_.rank == 0) progress_->report(report);
}

void Run::evaluate_if_due() {
  const int64_t step = st_.step;
  if (s_.val_data && (every(step, cfg_.eval.every) || (step == cfg_.train.steps && cfg_.eval.every > 0)))
    run_eval(step);
  const int64_t tasks_every = cfg_.eval.tasks_every > 0 ? cfg_.eval.tasks_every : cfg_.eval.every;
  if (!tasks_.empty() && (every(step, tasks_every) || step == cfg_.train.steps)) run_tasks(step);
}

void Run::run_eval(int64_t at_step) {
  const double ep0 = ep_collective_seconds(), pp0 = pipeline_wait_seconds();
  const double v = progress_->untimed([&] {
    return par_.pipeline_parallel() ? evaluate_pipeline(model_, *s_.val_data, *s_.mesh, cfg_, device_, precision_)
                                    : evaluate(model_, *s_.val_data, s_.mesh->replicas_comm(), cfg_, device_, precision_);
  });
  ep_in_eval_ += ep_collective_seconds() - ep0;
  pp_in_eval_ += pipeline_wait_seconds() - pp0;
  result_.val_losses.emplace_back(at_step, v);
  if (topo_.rank == 0) progress_->report_val(at_step, v);
}

// A stop signal on any rank stops every rank after this step, with a checkpoint (with islands: a
// signal that came before the step's start; one during it, after the next); so does
// --stop-after. Checkpoints every checkpoint.every steps and at the last (unless
// checkpoint.at_end is false), never of a diverged state. Returns whether training goes on.
bool Run::checkpoint_if_due() {
  const int64_t step = st_.step;
  const bool last = step == cfg_.train.steps;
  // With islands: a signal pending at the step's start (step_checks_).
  int any_signal = agreed_signal_;
  if (!step_checks_) {
    Watchdog::Scope watch("all_reduce(stop signal)");
    any_signal = mpi::all_reduced(pending_stop_signal(), ReduceOp::max, mpi_comm_);
  }
  const bool stop_here = (hooks_.stop_after >= 0 && step == hooks_.stop_after) || any_signal != 0;
  if (every(step, cfg_.checkpoint.every) || (last && cfg_.checkpoint.at_end) || stop_here) {
    // Never save a diverged state as the newest checkpoint: one check of every parameter (the
    // same on every rank) per save.
    if (!par_.params_finite()) diverged(step, "a parameter is NaN or infinite");
    progress_->untimed([&] { save(); });
  }
  if (any_signal != 0 && !last) {
    result_.exit_code = exit_code_for_signal(any_signal);
    if (topo_.rank == 0)
      log::warn(concat("stopped by signal ", any_signal, " after step ", step,
                       ": checkpoint written, exit code ", result_.exit_code));
    return false;
  }
  return !stop_here;
}

void Run::save() {
  Mesh& mesh = *s_.mesh;
  // out_dir/config.yaml is the record of the run whose checkpoints these are: written with this
  // run's first checkpoint, so a run that fails before it (bad data, a diverged start) leaves
  // the record of the run it would have continued.
  if (topo_.rank == 0 && !config_recorded_) {
    write_file_durably(cfg_.train.out_dir + "/config.yaml", st_.config_yaml);
    config_recorded_ = true;
  }
  torch::Tensor bias;  // the whole model's routing bias (a pipeline: each stage's rows summed into it)
  if (model_->run().routing_bias) {
    bias = model_->routing_bias();
    if (par_.pipeline_parallel()) mesh.pp().all_reduce(bias, ReduceOp::sum);
  }
  if (diloco_) {  // every rank's DiLoCo state first, beside the checkpoint that names it (diloco.h)
    const std::string dir = Diloco::state_dir(concat(cfg_.checkpoint.dir, "/", checkpoint_name(st_.step)));
    if (bias.defined()) diloco_->set_island_state(bias);  // (its island's own)
    agree(mpi_comm_, [&] { naming_config_file(cfg_, [&] { diloco_->save(dir, st_.step, cfg_.checkpoint.keep); }); });
  }
  auto rng = gather_rng_states(mesh.world(), device_);
  if (topo_.rank == 0) {
    st_.rng_states = std::move(rng);
    st_.loss_scale = scaler_.enabled() ? scaler_.scale() : 0.0;
    st_.loss_scale_good_steps = scaler_.good_steps();
    if (bias.defined()) st_.routing_bias = bias;
  }
  const std::string path = par_.save(*checkpoints_, st_);  // collective
  if (topo_.rank == 0) result_.last_checkpoint = path;
}

// A run whose loss or parameters became NaN/inf stops here, printed once (every rank sees the
// same all-reduced values), without saving that state; exit 2.
void Run::diverged(int64_t at_step, const std::string& what) {
  agree(mpi_comm_, [&] {
    throw UsageError(concat("step ", at_step, ": ", what, " (", precision_name(precision_),
                            "): training diverged; this state is not saved, the newest checkpoint stays ",
                            result_.last_checkpoint.empty() ? std::string("as it was") : result_.last_checkpoint,
                            ". Try a lower optim.lr, a longer optim.warmup_steps or optim.grad_clip > 0"));
  });
}

// The last asynchronous write completes (or its failure ends the job, exit 2) before any rank
// finishes, also when stopping on a signal; then the peak memory, the sample and (tests) the
// whole final parameters.
TrainResult Run::finish() {
  if (checkpoints_->async()) {
    checkpoints_->wait();  // ranks without a write in flight return at once
    s_.mesh->world().barrier();
  }
  result_.final_step = st_.step;
  if (par_.pipeline_parallel() && !pp_waits_measured() && topo_.rank == 0)
    log::info("pipeline: the waiting for the neighbouring stages is not measured: the GPUs wait for NCCL's transfers, "
              "the host does not (comm.backend: mpi measures it)");
  if (par_.pipeline_parallel() && pp_waits_measured()) {  // each stage's idle share of its forwards and backwards, against the bubble's
    const double mine[2] = {step_waits_, step_seconds_};
    std::vector<double> all(static_cast<size_t>(2 * topo_.size));
    mpi::gather(mine, all.data(), sizeof mine, 0, mpi_comm_);
    if (topo_.rank == 0) {
      const MeshLayout& l = s_.layout;
      std::string shares;
      for (int s = 0; s < l.pp; ++s) {
        double waits = 0, total = 0;
        for (int r = s * l.stage_size(); r < (s + 1) * l.stage_size(); ++r)
          waits += all[static_cast<size_t>(2 * r)], total += all[static_cast<size_t>(2 * r + 1)];
        shares += concat(s ? ", " : "", "stage ", s, " ", static_cast<double>(std::lround(total > 0 ? 1000 * waits / total : 0.0)) / 10, "%");
      }
      const int64_t v = dims_.pp_virtual;
      const double bubble = static_cast<double>(l.pp - 1) / static_cast<double>(v * accum_ + l.pp - 1);
      log::info(concat("pipeline: waiting for the neighbouring stages: ", shares, " of the micro-batches' time (the ",
                       cfg_.parallel.pp_schedule, " bubble alone: (pp - 1) / (", v > 1 ? "v m" : "m", " + pp - 1) = ",
                       static_cast<double>(std::lround(1000 * bubble)) / 10,
                       "%; the rest is the transfers and the stages' unequal work)"));
    }
  }
  if (diloco_) {
    result_.outer_steps = diloco_->outer_steps();
    result_.island_bytes = diloco_->bytes_sent();
    if (topo_.rank == 0)
      log::info(concat("diloco: ", diloco_->outer_steps(), " outer steps; ",
                       static_cast<double>(diloco_->bytes_sent()) / (1 << 20), " MiB sent between islands by rank 0; ",
                       diloco_->seconds(), " s in outer steps"));
  }
  if (device_.is_cuda() && topo_.rank == 0)
    log::info(concat("peak GPU memory (allocated by libtorch, rank 0): ",
                     static_cast<double>(cuda_peak_allocated_bytes(device_.index())) / (1 << 30), " GiB"));
  if (!device_.is_cuda() && cpu_allocations_counted()) {
    report_cpu_peaks("peak CPU memory at start-up", startup_cpu_peak_);
    report_cpu_peaks("peak CPU memory", cpu_peak_allocated_bytes());
  }
  result_.max_units_whole = par_.units_peak();
  const bool wants_sample = topo_.rank == 0 && cfg_.sample.tokens > 0;
  if (!par_.can_sample() && wants_sample)
    log::info(concat("sample: not generated by a tensor-parallel run; `mpitrain sample ", result_.last_checkpoint,
                     "` samples its checkpoint"));
  // ZeRO-3: every rank runs rank 0's sampling forward passes with it (the same prompt, seed and
  // gathered weights give every rank the same tokens), so each block is gathered around its use
  // as in training and no rank holds the whole model.
  // Pipeline parallelism: the first pipeline's ranks run each window through their stages' chunks,
  // the last stage's logits broadcast over the pipeline, every stage sampling the same token.
  const bool pipeline = par_.pipeline_parallel();
  if (par_.can_sample() && cfg_.sample.tokens > 0 && st_.tokenizer == "byte" &&
      (wants_sample || par_.samples_on_every_rank() || (pipeline && s_.mesh->replica() == 0))) {
    std::vector<int64_t> prompt{st_.eot_token};
    for (unsigned char c : cfg_.sample.prompt) prompt.push_back(c);
    std::function<torch::Tensor(const torch::Tensor&)> last_logits;
    std::optional<PipeLink> link;
    if (pipeline) {
      link.emplace(s_.mesh->pp_mpi());
      last_logits = [&](const torch::Tensor& idx) {
        const GPTDims& d = model_->dims();
        const torch::Tensor out = pipeline_forward(model_, *link, idx, 0, device_);
        link->finish();
        torch::Tensor logits = d.last_stage() ? model_->stage_logits(out).select(1, -1).squeeze(0).to(torch::kFloat32).contiguous()
                                              : torch::empty({d.classes()}, torch::dtype(torch::kFloat32).device(device_));
        s_.mesh->pp().broadcast(logits, static_cast<int>(d.pp - 1));
        return logits;
      };
    }
    auto out = generate(model_, prompt, cfg_.sample.tokens, cfg_.sample.temperature, cfg_.sample.top_k,
                        cfg_.train.seed, last_logits);
    if (wants_sample) {
      result_.sample = decode_bytes(std::vector<int64_t>(out.begin() + 1, out.end()), st_.eot_token);
      log::info("sample:\n" + result_.sample);
    }
  }
  if (hooks_.keep_params) result_.params = par_.whole_params();  // the tests' final parameters, whole
  return std::move(result_);
}

}  // namespace

// ---- the run -----------------------------------------------------------------------------------

// The peak bytes of CPU tensors each rank held (at start-up: making the model and the optimizer,
// resuming; else during the steps, their evaluations and checkpoints included), gathered to rank
// 0: every rank's up to 16 ranks, else the extremes.
void Run::report_cpu_peaks(const char* what, int64_t mine) const {
  std::vector<int64_t> peaks(static_cast<size_t>(topo_.rank == 0 ? topo_.size : 1));
  mpi::gather(&mine, peaks.data(), sizeof mine, 0, mpi_comm_);
  if (topo_.rank != 0) return;
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  std::string list;
  if (peaks.size() <= 16) {
    for (size_t r = 0; r < peaks.size(); ++r) list += concat(r ? ", " : "", "rank ", r, " ", mib(peaks[r]));
  } else {
    const auto [lo, hi] = std::minmax_element(peaks.begin(), peaks.end());
    list = concat("rank 0 ", mib(peaks[0]), ", smallest ", mib(*lo), " (rank ", lo - peaks.begin(), "), largest ",
                  mib(*hi), " (rank ", hi - peaks.begin(), ")");
  }
  log::info(concat(what, " (allocated by libtorch, MiB): ", list));
}

TrainResult train(Config cfg, MpiComm mpi_comm, const TrainHooks& hooks) {
  Startup startup = start_up(cfg, mpi_comm, hooks.force_unlock);  // MPI, layout, device, data, mesh; exit 2 on bad input
  Run run(cfg, startup, mpi_comm, hooks);
  run.build_model();
  run.build_optimizer();
  run.describe();
  run.resume_or_start();
  run.open_outputs();
  while (!run.done()) {
    run.begin_step();
    run.micro_batches();
    run.sync_gradients();
    run.clip_and_update();
    run.log_step();
    run.evaluate_if_due();
    if (!run.checkpoint_if_due()) break;
  }
  return run.finish();
}

}  // namespace mpitrain
