// The training loop. train() at the bottom reads top to bottom as the run's steps; each step is a
// member of Run, in the order it runs:
//   start-up (startup.cpp: MPI, layout, device, data)  -> build_model -> build_optimizer
//   -> describe -> resume_or_start (state_sync.cpp) -> open_outputs
//   -> per step: micro_batches -> sync_gradients -> clip_and_update -> log_step -> evaluate_if_due
//                -> checkpoint_if_due (signals, --stop-after)
//   -> finish (last async write, sample, parameters for tests)
#include "mpitrain/train.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "mpitrain/amp.h"
#include "mpitrain/checkpoint.h"
#include "mpitrain/comm.h"
#include "mpitrain/consistency.h"
#include "mpitrain/device.h"
#include "mpitrain/durable.h"
#include "mpitrain/error.h"
#include "mpitrain/grad_sync.h"
#include "mpitrain/h5.h"
#include "mpitrain/hf_format.h"
#include "mpitrain/host_memory.h"
#include "mpitrain/libtorch_version.h"
#include "mpitrain/log.h"
#include "mpitrain/memory_plan.h"
#include "mpitrain/mesh.h"
#include "mpitrain/mfu.h"
#include "mpitrain/model.h"
#include "mpitrain/mpi_env.h"
#include "mpitrain/optim.h"
#include "mpitrain/powersgd.h"
#include "mpitrain/profiler.h"
#include "mpitrain/progress.h"
#include "mpitrain/shards.h"
#include "mpitrain/signals.h"
#include "mpitrain/startup.h"
#include "mpitrain/state_sync.h"
#include "mpitrain/tensor_parallel.h"
#include "mpitrain/watchdog.h"
#include "mpitrain/zero3.h"

namespace mpitrain {
namespace {

bool every(int64_t step, int64_t n) { return n > 0 && step % n == 0; }

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

// Mean validation loss over eval.batches micro-batches per rank: the same windows every time.
double evaluate(GPT& model, const TokenDataset& val, Communicator& comm, const Config& cfg,
                const torch::Device& device, Precision precision) {
  torch::NoGradGuard no_grad;
  model->eval();
  std::vector<int32_t> buf;
  const int64_t rows = cfg.train.micro_batch;
  torch::Tensor sum = torch::zeros({1}, torch::dtype(torch::kFloat64).device(device));
  for (int64_t b = 0; b < cfg.eval.batches; ++b) {
    auto [x, y] = get_batch(val, static_cast<uint64_t>(b * comm.size() * rows), comm.rank(), rows, buf);
    Autocast autocast(precision, device);
    sum += model->loss(to_device(x, device), to_device(y, device)).to(torch::kFloat64);
  }
  comm.all_reduce(sum, ReduceOp::avg);
  model->train();
  return sum.item<double>() / static_cast<double>(cfg.eval.batches);
}

// Who writes checkpoints: the ranks that hold the state each its share, when all ranks see
// checkpoint.dir (checkpoint.writers: auto): under ZeRO-1 every rank, under tensor parallelism
// rank 0's tp group (with ZeRO-1 every rank); else rank 0 the whole state, gathered to it. Async
// writes of shares need MPI collectives on the writer's thread.
struct Writers {
  bool shares = false;  // each holder writes its share
  int count = 1;        // ranks that write each checkpoint
};
// Whether MPI runs with MPI_THREAD_MULTIPLE (collectives from more than one thread).
bool mpi_thread_multiple() {
  int mpi_threads = MPI_THREAD_SINGLE;
  MPI_CHECK(MPI_Query_thread(&mpi_threads));
  return mpi_threads >= MPI_THREAD_MULTIPLE;
}

Writers choose_checkpoint_writers(const Config& cfg, const Startup& run, bool zero, bool tensor_parallel) {
  const bool async_collectives = !cfg.checkpoint.async || mpi_thread_multiple();
  const bool spread = zero || tensor_parallel;  // state held in parts
  Writers w;
  w.shares = spread && cfg.checkpoint.writers == "auto" && run.checkpoint_dir_blind_rank < 0 && async_collectives;
  w.count = !w.shares ? 1 : zero ? run.topo.size : static_cast<int>(run.layout.tp);
  if (!spread || run.topo.rank != 0) return w;
  const char* share = zero && tensor_parallel ? "every rank writes its ZeRO-1 slices of its tensor-parallel shards"
                      : zero                  ? "every rank writes its ZeRO-1 share"
                                              : "the ranks of rank 0's tp group write their tensor-parallel shards";
  const char* state = zero && tensor_parallel ? "tensor-parallel shards and ZeRO-1 state"
                      : zero                  ? "ZeRO-1 state"
                                              : "tensor-parallel shards";
  const Topology& topo = run.topo;
  log::info(w.shares ? concat("checkpoint: ", share, " (", w.count, " writers; checkpoint.dir '", cfg.checkpoint.dir,
                              "' is seen by every rank)")
                     : concat("checkpoint: rank 0 writes whole checkpoints (", state, " gathered to it): ",
                              cfg.checkpoint.writers == "rank0" ? std::string("checkpoint.writers: rank0")
                              : !async_collectives ? std::string("MPI without MPI_THREAD_MULTIPLE for async writes")
                              : run.checkpoint_dir_blind_rank > 0
                                  ? concat("rank ", run.checkpoint_dir_blind_rank, " (host ",
                                           topo.hosts[topo.host_of_rank[run.checkpoint_dir_blind_rank]],
                                           ") does not see checkpoint.dir '", cfg.checkpoint.dir,
                                           "' (not a shared filesystem?)")
                                  : std::string("checkpoint.dir is not locked, so no rank can check it sees it")));
  return w;
}

// optim.fused: PyTorch's fused AdamW kernel where this libtorch has one for the device.
bool choose_fused_adamw(const Config& cfg, MPI_Comm mpi_comm, const torch::Device& device, int rank) {
  bool fused = false;
  agree(mpi_comm, [&] { naming_config_file(cfg, [&] {
    const bool available = fused_adamw_available(device.type());
    if (cfg.optim.fused == "on" && !available)
      throw UsageError(concat("optim.fused: on, but ", libtorch_version(), " has no fused AdamW kernel for ",
                              device.is_cuda() ? "CUDA" : "the CPU",
                              " (it has one for the CPU from libtorch 2.4, for CUDA from 2.0); use auto or off"));
    fused = cfg.optim.fused != "off" && available;
  }); });
  if (rank == 0)
    log::info(concat("optimizer: AdamW with ", fused ? "the fused kernel" : "multi-tensor (foreach) kernels", " (",
                     libtorch_version(), cfg.optim.fused == "off" ? ", optim.fused: off" : "",
                     !fused && cfg.optim.fused != "off" ? ": no fused AdamW kernel for this device" : "", ")"));
  return fused;
}

std::string describe_model(const GPTDims& dims, int64_t whole_params) {
  return concat("model: ", dims.arch, ", ", whole_params, " parameters (", dims.n_layer, " layers, ", dims.n_head,
                " heads", dims.llama() ? concat(" / ", dims.n_kv_head, " kv heads") : std::string(), ", width ",
                dims.n_embd,
                dims.attn_width() != dims.n_embd ? concat(", head_dim ", dims.head_dim()) : std::string(),
                dims.llama() ? concat(", SwiGLU ", dims.intermediate_size, ", rope theta ", dims.rope_theta,
                                      dims.rope_scaling == "llama3" ? " (llama3 scaling)" : "",
                                      dims.tie_embeddings ? ", tied output" : ", untied output",
                                      dims.qkv_bias ? ", qkv bias" : "", dims.qk_norm ? ", q/k norms" : "",
                                      dims.sliding_window > 0
                                          ? concat(", attention window ", dims.sliding_window, " (>= seq_len: causal)")
                                          : std::string())
                             : std::string(),
                ", seq_len ", dims.seq_len, ", vocab ", dims.vocab_size,
                dims.vocab_live > 0 ? concat(" = ", dims.vocab_live, " tokens + ", dims.vocab_size - dims.vocab_live,
                                             " padding rows outside the loss")
                                    : std::string(),
                ")");
}

// One training run: the state that lives from start-up to the end, and the steps as members.
class Run {
 public:
  Run(Config& cfg, Startup& startup, MPI_Comm mpi_comm, const TrainHooks& hooks)
      : cfg_(cfg), s_(startup), mpi_comm_(mpi_comm), hooks_(hooks), topo_(startup.topo), dims_(startup.dims),
        device_(startup.device), precision_(startup.precision), tensor_parallel_(startup.layout.tp > 1),
        zero_(cfg.optim.zero >= 1 && startup.layout.dp > 1), zero2_(zero_ && cfg.optim.zero >= 2),
        zero3_(zero_ && cfg.optim.zero == 3),
        T_(startup.dims.seq_len),
        micro_(cfg.train.micro_batch), accum_(cfg.train.grad_accum),
        tokens_per_step_(cfg.train.global_batch * startup.dims.seq_len) {}

  // ---- start-up, in order ----------------------------------------------------------------------
  void build_model();
  void build_optimizer();
  void describe();
  void warn_if_state_does_not_fit() const;
  void initial_shards();
  void log_initial_weights(int64_t tensors) const;
  void resume_or_start();
  void open_outputs();

  // ---- one optimizer step, in order ------------------------------------------------------------
  bool done() const { return st_.step >= cfg_.train.steps; }
  void begin_step();
  void micro_batches();
  void sync_gradients();
  void clip_and_update();
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
  void save();
  void diverged(int64_t at_step, const std::string& what);  // exit 2 on every rank (agree)

  Config& cfg_;
  Startup& s_;
  MPI_Comm mpi_comm_;
  const TrainHooks& hooks_;
  const Topology& topo_;
  const GPTDims& dims_;
  const torch::Device device_;
  const Precision precision_;
  // zero_: optim.zero >= 1 over dp > 1; zero2_: optim.zero >= 2 (gradients reduce-scattered every
  // micro-step); zero3_: optim.zero 3 (the parameters sharded too)
  const bool tensor_parallel_, zero_, zero2_, zero3_;
  const int64_t T_, micro_, accum_, tokens_per_step_;

  GPT model_{nullptr};
  std::optional<GPT> whole_model_;  // tensor parallel: rank 0's whole copy, into which checkpoints gather
  Writers writers_;
  std::vector<torch::Tensor> params_;
  std::optional<GradSync> grad_sync_;
  std::optional<ParamShards> units_;  // ZeRO-3: the parameters' shards, gathered per unit
  ParamShards* units() { return units_ ? &*units_ : nullptr; }  // WholeParams' argument
  std::optional<PowerSgd> powersgd_;  // comm.compress: powersgd, from step powersgd_start + 1 on
  std::optional<AdamW> opt_;
  const GradSync* shards_ = nullptr;  // ZeRO-1: who owns which slices
  LossScaler scaler_{false};
  int64_t whole_params_ = 0;  // the whole model's (tensor parallel: not this rank's shards)

  TrainState st_;
  TrainResult result_;
  bool config_recorded_ = false;  // out_dir/config.yaml written (rank 0, at the first save)
  std::optional<Progress> progress_;
  std::optional<BatchPrefetcher> prefetch_;
  std::optional<CommDup> checkpoint_comm_;  // the writer thread's collectives (shares)
  CheckpointShare share_buffers_;           // shares + async: this rank's host copies, reused by every save
  std::optional<AsyncCheckpointWriter> checkpoints_;
  FullOptimState gathered_;
  std::optional<SpanTimer> comm_wait_;  // what backward did not hide of the gradient communication
  std::optional<StepProfiler> profiler_;

  // The step under way.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches_;  // its micro-batches (inputs, targets)
  bool compressed_ = false;
  torch::Tensor loss_sum_, norm_;
  double lr_ = 0;
};

// The model on the device, its initial weights (model.init_from, else drawn from train.seed) the
// same on every rank of a dp group, then the dropout streams.
void Run::build_model() {
  // On the CPU, libtorch's allocations are counted from here: the run's peak is reported at the
  // end (finish), as a GPU run reports its caching allocator's.
  if (!device_.is_cuda()) count_cpu_allocations();
  torch::manual_seed(cfg_.train.seed);
  // Tensor parallel: this rank's shards of the model drawn from the same seed. ZeRO-3: the model
  // is made without its values (deferred; one block at a time exists while it is made), which
  // initial_shards() gives each rank's shards of once ParamShards exists (build_optimizer): no
  // rank, host or device, ever holds the whole model.
  model_ = GPT(dims_, /*deferred=*/zero3_);
  if (!zero3_) model_->to(device_);
  writers_ = choose_checkpoint_writers(cfg_, s_, zero_, tensor_parallel_);
  // Tensor parallel: when rank 0 writes checkpoints alone, it keeps a whole copy of the model in
  // host memory, into which the shards are gathered.
  if (tensor_parallel_ && topo_.rank == 0 && !writers_.shares) {
    GPTDims d = dims_;
    d.tp = 1, d.tp_rank = 0, d.tp_comm = nullptr;
    whole_model_.emplace(d);
  }
  if (!cfg_.model.init_from.empty() && s_.has_resume) {
    log::info(concat("model: resuming from a checkpoint; model.init_from (", cfg_.model.init_from, ") is not read"));
  } else if (!cfg_.model.init_from.empty() && !zero3_) {
    // The ranks of the first data-parallel replica (rank 0's tp group, on rank 0's host) read
    // their shards of the files, each only what it holds; the dp broadcast below does the rest.
    int64_t n = 0;
    agree(mpi_comm_, [&] { naming_config_file(cfg_, [&] {
      if (s_.mesh->dp_rank() == 0) n = load_initial_weights(cfg_.model.init_from, model_);
    }); });
    log_initial_weights(n);
  }
  if (!zero3_) {  // identical initial parameters on every rank of a dp group, whatever each rank's RNG did
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : model_->named_params()) s_.mesh->dp().broadcast(p, 0);
  }
  // Dropout streams differ per data-parallel rank (as in DDP); the ranks of a tp group share
  // theirs, so the dropout of the activations they all hold (embeddings, residual stream) is the
  // same on each. The model above was drawn before this.
  torch::manual_seed(cfg_.train.seed + 7919 * static_cast<uint64_t>(s_.mesh->dp_rank() + 1));
  for (auto& [name, p] : model_->named_params()) params_.push_back(p);
  for (const auto& [name, p] : model_->named_params()) {
    int64_t n = 1;
    for (int64_t e : tp_whole_shape(p.sizes(), model_->tp_split(name), dims_.tp)) n *= e;
    whole_params_ += n;
  }
}

// Gradient sync (buckets; ZeRO-1: reduce-scatter), PowerSGD, AdamW and the fp16 loss scaler.
void Run::build_optimizer() {
  const bool fused_adamw = choose_fused_adamw(cfg_, mpi_comm_, device_, topo_.rank);
  // On CUDA the backward hooks run on autograd's device threads; MPI collectives (and their
  // watchdog scopes) stay on the main thread, so there the MPI backend reduces after backward.
  Communicator& dp = s_.mesh->dp();
  const bool overlap = cfg_.comm.overlap && !(device_.is_cuda() && dp.name() == "mpi");
  // (comm.grad_dtype and comm.param_dtype are named as train.precision is, and validated)
  auto dtype_of = [](const std::string& name) { return precision_dtype(parse_precision(name)); };
  const torch::ScalarType wire = dtype_of(cfg_.comm.grad_dtype);
  // ZeRO-3 gathers a block's parameters from its backward, which on a GPU runs on autograd's device
  // thread: the MPI backend may call MPI there only under MPI_THREAD_MULTIPLE (the main thread
  // waits in backward meanwhile).
  if (zero3_ && device_.is_cuda() && dp.name() == "mpi" && !mpi_thread_multiple())
    agree(mpi_comm_, [&] {
      throw UsageError(concat("optim.zero: 3 on a GPU with comm.backend: mpi gathers parameters from autograd's "
                              "device thread, which needs MPI_THREAD_MULTIPLE, and this MPI does not provide it: set "
                              "comm.backend: nccl (or optim.zero: 2)"));
    });
  Units units;
  if (zero3_) {
    std::vector<std::string> names;
    for (const auto& [name, p] : model_->named_params()) names.push_back(name);
    units = model_units(names, dims_.n_layer);
  }
  grad_sync_.emplace(params_, dp, cfg_.comm.bucket_mb, overlap, zero_, wire, zero2_, units.groups,
                     zero3_ ? c10::optional<torch::Device>(device_) : c10::nullopt);
  if (cfg_.comm.compress == "powersgd" && s_.layout.dp > 1)
    powersgd_.emplace(params_, dp, cfg_.comm.powersgd_rank, cfg_.train.seed);
  if (zero3_) {
    units_.emplace(params_, *grad_sync_, std::move(units), cfg_.optim.reshard_after_forward,
                   dtype_of(cfg_.comm.param_dtype));
    model_->set_unit_hooks(&*units_);
    if (!s_.has_resume) initial_shards();  // (a resumed run's shards come from its checkpoint)
  }
  if (zero_) {
    opt_.emplace(model_->named_params(), *grad_sync_, cfg_.optim, fused_adamw,
                 units_ ? &units_->param_shards() : nullptr);
    shards_ = &*grad_sync_;
  } else {
    opt_.emplace(model_->named_params(), cfg_.optim, fused_adamw);
  }
  if (topo_.rank == 0) {
    const double mib = static_cast<double>(opt_->state_bytes()) / (1 << 20);
    log::info(zero_ ? concat("optimizer state: ", mib, " MiB per rank (ZeRO-", cfg_.optim.zero, ": sharded over ",
                             s_.layout.dp, " data-parallel ranks; gradients reduce-scattered",
                             zero2_ ? " every micro-step, each rank keeping its shard only" : "",
                             zero3_ ? concat("; parameters sharded too, gathered per unit around its forward and "
                                             "backward: ", units_->num_units(), " units)")
                                    : std::string(", parameters all-gathered)"))
                    : concat("optimizer state: ", mib, " MiB per rank (replicated",
                             cfg_.optim.zero >= 1 ? concat("; optim.zero: ", cfg_.optim.zero,
                                                           " has nothing to shard with one data-parallel rank")
                                                  : std::string(),
                             ")"));
  }
  scaler_ = LossScaler(precision_ == Precision::fp16);
  if (topo_.rank == 0 && device_.is_cuda()) warn_if_state_does_not_fit();
}

// ZeRO-3: each rank's shards of the initial weights, one parameter whole at a time. Drawn: every
// rank draws each parameter as a model made whole would (GPT::initialize) and keeps its part, with
// no communication. model.init_from: the first data-parallel replica's ranks (rank 0's tp group,
// on rank 0's host, as without ZeRO-3) read one tensor at a time, each its tp shard, and broadcast
// it over their dp group, each rank keeping its part; a read error found on the way ends every
// rank, naming the file.
void Run::initial_shards() {
  if (cfg_.model.init_from.empty()) {
    model_->initialize([&](size_t k, const torch::Tensor& v) { units_->set_param(k, v); });
    return;
  }
  std::unique_ptr<InitialWeights> files;
  agree(mpi_comm_, [&] { naming_config_file(cfg_, [&] {
    if (s_.mesh->dp_rank() == 0) files = open_initial_weights(cfg_.model.init_from, model_);
  }); });
  const auto params = model_->named_params();
  for (size_t k = 0; k < params.size(); ++k) {
    torch::Tensor v;
    agree(mpi_comm_, [&] { naming_config_file(cfg_, [&] {
      if (files) v = files->read(k).to(device_);
    }); });
    if (!v.defined()) v = torch::empty(params[k].second.sizes(), torch::dtype(torch::kFloat32).device(device_));
    s_.mesh->dp().broadcast(v, 0);
    units_->set_param(k, v);
  }
  log_initial_weights(static_cast<int64_t>(params.size()));
}

void Run::log_initial_weights(int64_t tensors) const {
  log::info(concat("model: initial weights from ", cfg_.model.init_from, " (", tensors, " tensors",
                   tensor_parallel_ ? concat("; each of the ", dims_.tp, " ranks of rank 0's tp group read its shards")
                                    : std::string(),
                   zero3_ ? "; one tensor at a time, broadcast over the dp group, each rank keeping its shard" : "",
                   ")"));
}

// On a GPU: the model state this layout keeps per rank (memory_plan.h's count, activations not
// included) against the device's memory; more than it is a warning naming `mpitrain plan`.
void Run::warn_if_state_does_not_fit() const {
  MemoryInputs in;
  for (const auto& p : params_) in.params += p.numel();
  in.dp = s_.layout.dp;
  in.bucket_mb = cfg_.comm.bucket_mb;
  const int zero = zero_ ? static_cast<int>(cfg_.optim.zero) : 0;
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
  log::info(concat("batch: ", micro_, " micro x ", layout.dp, " ranks x ", accum_, " accum = ", cfg_.train.global_batch,
                   " sequences = ", tokens_per_step_, " tokens per step; ", grad_sync_->num_buckets(),
                   zero_ ? " reduce-scatter buckets" : " all-reduce buckets",
                   grad_sync_->overlapping() ? " (overlapped with backward)" : "", "; ", s_.threads,
                   " threads per rank; backend ", s_.mesh->dp().name()));
  if (layout.dp > 1)
    log::info(concat("gradient communication: ",
                     static_cast<double>(grad_sync_->bytes_per_step() * static_cast<uint64_t>(zero2_ ? accum_ : 1)) /
                         (1 << 20),
                     " MiB per rank per step in ", cfg_.comm.grad_dtype, zero2_ && accum_ > 1 ? concat(" (ZeRO-", cfg_.optim.zero, ": ", accum_, " reduce-scatters, one per micro-step)") : std::string(),
                     cfg_.comm.grad_dtype == "fp32"
                         ? std::string()
                         : " (comm.grad_dtype: half of fp32; summed in 16 bits, pre-divided by the group size)",
                     powersgd_ ? concat("; PowerSGD rank ", cfg_.comm.powersgd_rank, " from step ",
                                        cfg_.comm.powersgd_start + 1, ": ",
                                        static_cast<double>(powersgd_->bytes_per_step()) / (1 << 20), " MiB (",
                                        static_cast<double>(powersgd_->uncompressed_bytes()) /
                                            static_cast<double>(powersgd_->bytes_per_step()),
                                        "x less; ", powersgd_->compressed_matrices(),
                                        " weight matrices compressed, two all-reduces after backward, error feedback)")
                               : std::string()));
  else if (cfg_.comm.compress == "powersgd" && topo_.rank == 0)
    log::info("comm.compress: powersgd has nothing to compress with one data-parallel rank");
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
    if (units_ && !tensor_parallel_) {  // ZeRO-3: each rank receives its shards, one unit at a time
      resume_from(s_.resume, model_, *opt_, shards_, st_, s_.mesh->world(), mpi_comm_, cfg_.train.seed, device_,
                  &units_->param_shards());
    } else {  // (ZeRO-3 under tp: into whole parameters, then each rank's shards of them)
      WholeParams whole(units());
      resume_from(s_.resume, model_, *opt_, shards_, st_, s_.mesh->world(), mpi_comm_, cfg_.train.seed, device_);
      if (units_) units_->keep_shards_of_whole();
    }
    scaler_.restore(st_.loss_scale, st_.loss_scale_good_steps);  // fp16: the scale continues
    if (topo_.rank == 0) log_batch_change(st_, cfg_, s_.layout.dp);
  }
  st_.world_size = topo_.size;
  st_.dp = s_.layout.dp;
  st_.tp = s_.layout.tp;
  st_.zero = zero_ ? cfg_.optim.zero : 0;
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
  facts.flops_per_token = model_flops_per_token(whole_params_, lookup_only, dims_.n_layer, dims_.attn_width(), T_);
  facts.communicates = s_.layout.dp > 1;
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
  prefetch_.emplace(*s_.train_data, s_.mesh->dp_rank(), micro_);
  result_.checkpoint_writers = writers_.count;
  if (writers_.shares) checkpoint_comm_.emplace(mpi_comm_);
  // With checkpoint.async the loop stalls only for copies into host buffers allocated here, once
  // (ZeRO-1 through rank 0: also the whole moments rank 0 assembles, kept between saves);
  // synchronous saves allocate nothing between them.
  checkpoints_.emplace(cfg_.checkpoint.dir, cfg_.checkpoint.keep, cfg_.checkpoint.async);
  if (whole_model_) gathered_ = host_optim_state_like(*whole_model_);  // tensor parallel: rank 0's whole state
  // ZeRO-3: rank 0's host buffers are made like the whole parameters (the ranks' shares read the
  // shards: AdamW's slots).
  WholeParams whole(checkpoints_->async() && !writers_.shares ? units() : nullptr);
  if (checkpoints_->async() && writers_.shares) {
    share_checkpoint(share_buffers_, model_, *opt_, shards_, s_.mesh->dp_rank() == 0, st_, /*copy=*/true);
  } else if (whole_model_ && checkpoints_->async()) {
    checkpoints_->prepare(*whole_model_, gathered_);
  } else if (topo_.rank == 0 && checkpoints_->async()) {
    if (opt_->sharded()) gathered_ = host_optim_state_like(model_);
    checkpoints_->prepare(model_, opt_->sharded() ? gathered_ : full_state_of(*opt_));
  }
  comm_wait_.emplace(device_.is_cuda(), device_.is_cuda() ? device_.index() : -1);
  profiler_.emplace(topo_.rank == 0 ? cfg_.log.profile_start : 0, cfg_.log.profile_steps,
                    cfg_.train.out_dir + "/profile/rank-0.json", device_.is_cuda() ? device_.index() : -1);
  model_->train();
  if (cpu_allocations_counted()) {  // the steps' peak apart from start-up's (model, optimizer, resume)
    startup_cpu_peak_ = cpu_peak_allocated_bytes();
    reset_cpu_peak();
  }
  if (s_.val_data && cfg_.eval.every > 0 && st_.step == 0) run_eval(0);  // the untrained baseline
}

void Run::begin_step() {
  progress_->start_step();
  profiler_->begin_step(step_number());
  compressed_ = powersgd_ && st_.step >= cfg_.comm.powersgd_start;
  Watchdog::set_step(step_number());
  maybe_hang_for_test(topo_.rank, step_number());
}

// Forward and backward of train.grad_accum micro-batches; the last backward starts the gradient
// communication (overlapped with it where comm.overlap allows). The loss stays on the device
// until a log step reads it: no host synchronisation per step.
void Run::micro_batches() {
  // The step's micro-batches are read first. A bad window (a token outside the vocabulary) that
  // several ranks find at once is then one message, the lowest rank's, and every rank ends
  // (exit 2) before any collective of the step: one small all-reduce per step.
  const uint64_t micro_stride = static_cast<uint64_t>(s_.layout.dp * micro_);
  batches_.clear();
  std::string bad_data;
  try {
    for (int64_t m = 0; m < accum_; ++m) {
      const uint64_t start = st_.data_cursor + static_cast<uint64_t>(m) * micro_stride;
      // The next micro-batch follows in the global order, also across the step boundary.
      batches_.push_back(to_tensors(prefetch_->take(start, start + micro_stride), micro_, T_));
      if (log::enabled(log::Level::debug)) {  // which samples this rank trains on (tests/cli_test.sh)
        const uint64_t first = start + static_cast<uint64_t>(s_.mesh->dp_rank() * micro_);
        log::debug(concat("data: step ", step_number(), " micro ", m, " windows ", first, "-", first + micro_ - 1));
      }
    }
  } catch (const UsageError& e) {
    bad_data = e.what();
  }
  {
    Watchdog::Scope watch("all_reduce(data check)");
    agree(mpi_comm_, [&] {
      if (!bad_data.empty()) throw UsageError(bad_data);
    });
  }
  loss_sum_ = torch::zeros({1}, torch::dtype(torch::kFloat64).device(device_));
  for (int64_t m = 0; m < accum_; ++m) {
    const auto& [x, y] = batches_[static_cast<size_t>(m)];
    torch::Tensor loss;
    {
      Autocast autocast(precision_, device_);
      loss = model_->loss(to_device(x, device_), to_device(y, device_));
    }
    // This backward completes the step's gradients (ZeRO-2: every backward reduce-scatters its own).
    if ((m + 1 == accum_ || zero2_) && !compressed_) grad_sync_->arm();
    scaler_.scale_loss(loss / static_cast<double>(accum_)).backward();
    if (zero2_ && m + 1 < accum_) grad_sync_->reduce_micro_step();
    loss_sum_ += loss.detach().to(torch::kFloat64);
  }
}

// The gradients averaged over the data-parallel ranks (ZeRO-1: reduce-scattered, each rank holds
// its slices; PowerSGD: its low-rank factors).
void Run::sync_gradients() {
  comm_wait_->begin();
  if (compressed_)
    powersgd_->reduce_grads();
  else
    grad_sync_->all_reduce_grads();
  comm_wait_->end();
}

// fp16's overflow check, gradient clipping and the AdamW update (ZeRO-1: then the all-gather of
// the updated slices); the step's counters advance either way.
void Run::clip_and_update() {
  AdamW& opt = *opt_;
  Communicator& dp = s_.mesh->dp();
  bool finite = true;  // fp16 only; the same verdict on every rank
  if (zero_ || tensor_parallel_) {
    // Each rank holds a part of the gradients: the verdict and the norm are agreed over the ranks
    // that hold the others (ZeRO-1: the dp group; tensor parallel: the world).
    std::vector<torch::Tensor> grads;
    for (size_t i = 0; i < opt.size(); ++i) grads.push_back(opt.grad(i));
    finite = scaler_.unscale_and_check(grads, tensor_parallel_ ? s_.mesh->world() : dp, device_);
    norm_ = tensor_parallel_ ? clip_tp_grad_norm_(opt, model_, cfg_.optim.grad_clip, s_.mesh->tp(), dp)
                             : clip_sharded_grad_norm_(opt, cfg_.optim.grad_clip, dp);
  } else {
    finite = scaler_.unscale_and_check(params_);
    norm_ = clip_grad_norm_(params_, cfg_.optim.grad_clip);
  }
  lr_ = lr_at(cfg_.optim, cfg_.train.steps, st_.step);
  if (finite) {
    opt.step(lr_);
    if (zero3_) {  // the shards are the parameters: a unit still whole (evaluation's) is stale now
      units_->release_all();
    } else if (zero_) {  // every rank's updated slices to every rank
      comm_wait_->begin();
      grad_sync_->all_gather_params();
      comm_wait_->end();
    }
  } else if (topo_.rank == 0) {  // the same verdict on every rank
    log::warn(concat("step ", step_number(), ": fp16 gradients overflowed at loss scale ", scaler_.scale(),
                     "; step skipped"));
  }
  scaler_.update(finite);
  opt.zero_grad();
  profiler_->end_step(step_number());
  st_.step += 1;
  st_.data_cursor += static_cast<uint64_t>(cfg_.train.global_batch);
  st_.tokens_seen += tokens_per_step_;
}

// Every log.every steps and at the last: the loss averaged over the ranks, the report (console,
// metrics.jsonl, TensorBoard), and the divergence check.
void Run::log_step() {
  const int64_t step = st_.step;  // just completed
  if (!every(step, cfg_.log.every) && step != cfg_.train.steps) return;
  s_.mesh->dp().all_reduce(loss_sum_, ReduceOp::avg);
  double loss = 0, grad_norm = 0;
  {
    Watchdog::Scope watch("device synchronize (loss)");  // a stuck GPU collective shows here
    loss = loss_sum_.item<double>() / static_cast<double>(accum_);
    grad_norm = norm_.item<double>();
  }
  result_.losses.emplace_back(step, loss);
  if (!std::isfinite(loss) || !std::isfinite(grad_norm))  // the same values on every rank
    diverged(step, concat("the loss is ", loss, " and the gradient norm ", grad_norm));
  StepReport report{step - 1, loss, lr_, grad_norm, comm_wait_->take_seconds(),
                    scaler_.enabled() ? scaler_.scale() : 0.0};
  if (topo_.rank == 0) progress_->report(report);
}

void Run::evaluate_if_due() {
  const int64_t step = st_.step;
  if (s_.val_data && (every(step, cfg_.eval.every) || (step == cfg_.train.steps && cfg_.eval.every > 0)))
    run_eval(step);
}

void Run::run_eval(int64_t at_step) {
  const double v = progress_->untimed(
      [&] { return evaluate(model_, *s_.val_data, s_.mesh->dp(), cfg_, device_, precision_); });
  result_.val_losses.emplace_back(at_step, v);
  if (topo_.rank == 0) progress_->report_val(at_step, v);
}

// A stop signal on any rank stops every rank after this step, with a checkpoint; so does
// --stop-after. Checkpoints every checkpoint.every steps and at the last (unless checkpoint.at_end
// is false), never of a diverged state. Returns whether training goes on.
bool Run::checkpoint_if_due() {
  const int64_t step = st_.step;
  const bool last = step == cfg_.train.steps;
  int signal = pending_stop_signal(), any_signal = 0;
  {
    Watchdog::Scope watch("all_reduce(stop signal)");
    MPI_CHECK(MPI_Allreduce(&signal, &any_signal, 1, MPI_INT, MPI_MAX, mpi_comm_));
  }
  const bool stop_here = (hooks_.stop_after >= 0 && step == hooks_.stop_after) || any_signal != 0;
  if (every(step, cfg_.checkpoint.every) || (last && cfg_.checkpoint.at_end) || stop_here) {
    // Never save a diverged state as the newest checkpoint: one check of every parameter (the
    // same on every rank after the all-reduce) per save.
    torch::Tensor all_finite;
    {
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> ok;
      if (zero3_)  // the shards (whole parameters exist only around a unit's use)
        for (size_t i = 0; i < opt_->size(); ++i) ok.push_back(torch::isfinite(opt_->param(i)).all());
      else
        for (const auto& p : params_) ok.push_back(torch::isfinite(p).all());
      all_finite = ok.empty() ? torch::ones({}, torch::kBool) : torch::stack(ok).all();
    }
    int finite_params = 1;
    {
      Watchdog::Scope watch("device synchronize (parameter check)");
      finite_params = all_finite.item<bool>() ? 1 : 0;
    }
    if (tensor_parallel_ || zero3_) {  // each rank checked its shards: agree
      Watchdog::Scope watch("all_reduce(parameter check)");
      MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &finite_params, 1, MPI_INT, MPI_MIN, mpi_comm_));
    }
    if (!finite_params) diverged(step, "a parameter is NaN or infinite");
    progress_->untimed([&] {
      // ZeRO-3: each rank's share is read from its shards (AdamW's slots); rank 0 writing alone
      // reads whole parameters.
      WholeParams whole(!writers_.shares ? units() : nullptr);
      save();
    });
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
  auto rng = gather_rng_states(mesh.world(), device_);
  if (topo_.rank == 0) {
    st_.rng_states = std::move(rng);
    st_.loss_scale = scaler_.enabled() ? scaler_.scale() : 0.0;
    st_.loss_scale_good_steps = scaler_.good_steps();
  }
  if (writers_.shares) {
    const std::string path = save_shares(*checkpoints_, share_buffers_, model_, *opt_, shards_, mesh.dp_rank() == 0,
                                         st_, checkpoint_comm_->get());
    if (topo_.rank == 0) result_.last_checkpoint = path;
    return;  // collective: nobody runs ahead of a synchronous save that may yet fail
  }
  if (tensor_parallel_) {  // the shards assembled on rank 0
    gather_tp_state(model_, *opt_, shards_, mesh.tp(), mesh.dp_rank() == 0, whole_model_ ? &*whole_model_ : nullptr,
                    &gathered_);
    if (topo_.rank == 0) result_.last_checkpoint = checkpoints_->save(*whole_model_, gathered_, st_);
  } else {  // ZeRO-1: assembled on rank 0
    FullOptimState optim_state =
        gather_optim_state(*opt_, shards_, model_, checkpoints_->async() ? &gathered_ : nullptr);
    if (topo_.rank == 0) result_.last_checkpoint = checkpoints_->save(model_, optim_state, st_);
  }
  if (!checkpoints_->async()) mesh.world().barrier();  // nobody runs ahead of a checkpoint that may yet fail
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
  if (device_.is_cuda() && topo_.rank == 0)
    log::info(concat("peak GPU memory (allocated by libtorch, rank 0): ",
                     static_cast<double>(cuda_peak_allocated_bytes(device_.index())) / (1 << 30), " GiB"));
  if (!device_.is_cuda() && cpu_allocations_counted()) {
    report_cpu_peaks("peak CPU memory at start-up", startup_cpu_peak_);
    report_cpu_peaks("peak CPU memory", cpu_peak_allocated_bytes());
  }
  const bool wants_sample = topo_.rank == 0 && cfg_.sample.tokens > 0;
  if (tensor_parallel_ && wants_sample)
    log::info(concat("sample: not generated by a tensor-parallel run; `mpitrain sample ", result_.last_checkpoint,
                     "` samples its checkpoint"));
  // ZeRO-3: every rank runs rank 0's sampling forward passes with it (the same prompt, seed and
  // gathered weights give every rank the same tokens), so each block is gathered around its use
  // as in training and no rank holds the whole model.
  if (!tensor_parallel_ && cfg_.sample.tokens > 0 && st_.tokenizer == "byte" && (wants_sample || units_)) {
    std::vector<int64_t> prompt{st_.eot_token};
    for (unsigned char c : cfg_.sample.prompt) prompt.push_back(c);
    auto out = generate(model_, prompt, cfg_.sample.tokens, cfg_.sample.temperature, cfg_.sample.top_k,
                        cfg_.train.seed);
    if (wants_sample) {
      result_.sample = decode_bytes(std::vector<int64_t>(out.begin() + 1, out.end()), st_.eot_token);
      log::info("sample:\n" + result_.sample);
    }
  }
  WholeParams whole(hooks_.keep_params ? units() : nullptr);  // the tests' final parameters, whole
  if (hooks_.keep_params)
    for (auto& [name, p] : model_->named_params()) {  // whole parameters (tensor parallel: gathered)
      torch::Tensor c = tp_unshard(p.detach(), model_->tp_split(name), s_.mesh->tp())
                            .to(torch::kCPU, torch::kFloat32)
                            .contiguous();
      result_.params.emplace_back(name, std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel()));
    }
  return std::move(result_);
}

}  // namespace

// ---- the run -----------------------------------------------------------------------------------

// The peak bytes of CPU tensors each rank held (at start-up: making the model and the optimizer,
// resuming; else during the steps, their evaluations and checkpoints included), gathered to rank
// 0: every rank's up to 16 ranks, else the extremes.
void Run::report_cpu_peaks(const char* what, int64_t mine) const {
  std::vector<int64_t> peaks(static_cast<size_t>(topo_.rank == 0 ? topo_.size : 1));
  MPI_CHECK(MPI_Gather(&mine, 1, MPI_INT64_T, peaks.data(), 1, MPI_INT64_T, 0, mpi_comm_));
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

TrainResult train(Config cfg, MPI_Comm mpi_comm, const TrainHooks& hooks) {
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
