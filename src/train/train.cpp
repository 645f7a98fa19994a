// The training loop, top to bottom: start-up (startup.cpp), the model and its initial weights,
// the optimizer and gradient sync (plain data parallel or ZeRO-1), resume (state_sync.cpp), then
// the steps: micro-batches, gradient sync, clip, update, logging (progress.cpp), evaluation,
// stop signals and checkpoints.
#include "mpitrain/train.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>

#include "mpitrain/amp.h"
#include "mpitrain/checkpoint.h"
#include "mpitrain/comm.h"
#include "mpitrain/consistency.h"
#include "mpitrain/device.h"
#include "mpitrain/error.h"
#include "mpitrain/grad_sync.h"
#include "mpitrain/h5.h"
#include "mpitrain/hf_format.h"
#include "mpitrain/log.h"
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

namespace mpitrain {
namespace {

using Clock = std::chrono::steady_clock;

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

}  // namespace

// ---- the run -----------------------------------------------------------------------------------

TrainResult train(Config cfg, MPI_Comm mpi_comm, const TrainHooks& hooks) {
  Startup run = start_up(cfg, mpi_comm, hooks.force_unlock);  // MPI, layout, device, data, mesh; exit 2 on bad input
  const Topology& topo = run.topo;
  const MeshLayout& layout = run.layout;
  const torch::Device device = run.device;
  const Precision precision = run.precision;
  const GPTDims& dims = run.dims;
  std::unique_ptr<TokenDataset>& train_data = run.train_data;
  std::unique_ptr<TokenDataset>& val_data = run.val_data;
  std::unique_ptr<Mesh>& mesh = run.mesh;
  const std::vector<std::string>& resume = run.resume;
  const bool has_resume = run.has_resume;
  const int threads = run.threads;

  torch::manual_seed(cfg.train.seed);
  GPT model(dims);  // tensor parallel: this rank's shards of the model drawn from the same seed
  model->to(device);
  // Tensor parallel: when rank 0 writes checkpoints alone, it keeps a whole copy of the model in
  // host memory, into which the shards are gathered (and model.init_from is read into one).
  const bool tensor_parallel = layout.tp > 1;
  // Who writes checkpoints: the ranks that hold the state each its share, when all ranks see
  // checkpoint.dir (checkpoint.writers: auto): under ZeRO-1 every rank, under tensor parallelism
  // rank 0's tp group (with ZeRO-1 every rank); else rank 0 the whole state, gathered to it. Async
  // writes of shares need MPI collectives on the writer's thread.
  int mpi_threads = MPI_THREAD_SINGLE;
  MPI_CHECK(MPI_Query_thread(&mpi_threads));
  const bool async_collectives = !cfg.checkpoint.async || mpi_threads >= MPI_THREAD_MULTIPLE;
  const bool zero_layout = cfg.optim.zero == 1 && layout.dp > 1;
  const bool spread = zero_layout || tensor_parallel;  // state held in parts
  const bool shares = spread && cfg.checkpoint.writers == "auto" && run.checkpoint_dir_blind_rank < 0 && async_collectives;
  const int writers = !shares ? 1 : zero_layout ? topo.size : layout.tp;
  const char* share = zero_layout && tensor_parallel ? "every rank writes its ZeRO-1 slices of its tensor-parallel shards"
                      : zero_layout                  ? "every rank writes its ZeRO-1 share"
                                                     : "the ranks of rank 0's tp group write their tensor-parallel shards";
  const char* state = zero_layout && tensor_parallel ? "tensor-parallel shards and ZeRO-1 state"
                      : zero_layout                  ? "ZeRO-1 state"
                                                     : "tensor-parallel shards";
  if (spread && topo.rank == 0)
    log::info(shares ? concat("checkpoint: ", share, " (", writers, " writers; checkpoint.dir '", cfg.checkpoint.dir,
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
  std::optional<GPT> whole_model;
  if (tensor_parallel && ((topo.rank == 0 && !shares) || (!cfg.model.init_from.empty() && !has_resume))) {
    GPTDims d = dims;
    d.tp = 1, d.tp_rank = 0, d.tp_comm = nullptr;
    whole_model.emplace(d);
  }
  if (!cfg.model.init_from.empty() && has_resume) {
    log::info(concat("model: resuming from a checkpoint; model.init_from (", cfg.model.init_from, ") is not read"));
  } else if (!cfg.model.init_from.empty()) {  // rank 0 reads; the broadcast below does the rest
    int64_t n = 0;
    agree(mpi_comm, [&] { naming_config_file(cfg, [&] {
      if (topo.rank == 0) n = load_initial_weights(cfg.model.init_from, whole_model ? *whole_model : model);
    }); });
    log::info(concat("model: initial weights from ", cfg.model.init_from, " (", n, " tensors)"));
    if (whole_model) {  // every rank keeps its shards of rank 0's whole weights
      torch::NoGradGuard no_grad;
      const auto whole = (*whole_model)->named_params(), mine = model->named_params();
      for (size_t k = 0; k < mine.size(); ++k) {
        torch::Tensor w = whole[k].second.detach();
        mesh->world().broadcast(w, 0);
        mine[k].second.copy_(tp_shard(w, tp_split(mine[k].first), dims.tp_rank, dims.tp));
      }
    }
  }
  {  // identical initial parameters on every rank of a dp group, whatever each rank's RNG did
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : model->named_params()) mesh->dp().broadcast(p, 0);
  }
  if (whole_model && (topo.rank != 0 || shares)) whole_model.reset();
  // Dropout streams differ per data-parallel rank (as in DDP); the ranks of a tp group share
  // theirs, so the dropout of the activations they all hold (embeddings, residual stream) is the
  // same on each. The model above was drawn before this.
  torch::manual_seed(cfg.train.seed + 7919 * static_cast<uint64_t>(mesh->dp_rank() + 1));

  // optim.fused: PyTorch's fused AdamW kernel where this libtorch has one for the device.
  bool fused_adamw = false;
  agree(mpi_comm, [&] { naming_config_file(cfg, [&] {
    const bool available = fused_adamw_available(device.type());
    if (cfg.optim.fused == "on" && !available)
      throw UsageError(concat("optim.fused: on, but ", libtorch_version(), " has no fused AdamW kernel for ",
                              device.is_cuda() ? "CUDA" : "the CPU",
                              " (it has one for the CPU from libtorch 2.4, for CUDA from 2.0); use auto or off"));
    fused_adamw = cfg.optim.fused != "off" && available;
  }); });
  if (topo.rank == 0)
    log::info(concat("optimizer: AdamW with ", fused_adamw ? "the fused kernel" : "multi-tensor (foreach) kernels", " (",
                     libtorch_version(), cfg.optim.fused == "off" ? ", optim.fused: off" : "",
                     !fused_adamw && cfg.optim.fused != "off" ? ": no fused AdamW kernel for this device" : "", ")"));
  std::vector<torch::Tensor> params;
  for (auto& [name, p] : model->named_params()) params.push_back(p);
  // On CUDA the backward hooks run on autograd's device threads; MPI collectives (and their
  // watchdog scopes) stay on the main thread, so there the MPI backend reduces after backward.
  Communicator& dp = mesh->dp();
  const bool overlap = cfg.comm.overlap && !(device.is_cuda() && dp.name() == "mpi");
  // ZeRO-1: gradients reduce-scattered over the dp group, AdamW state for this rank's slices.
  const bool zero = cfg.optim.zero == 1 && layout.dp > 1;
  const torch::ScalarType wire = cfg.comm.grad_dtype == "bf16"   ? torch::kBFloat16
                                 : cfg.comm.grad_dtype == "fp16" ? torch::kHalf
                                                                 : torch::kFloat32;
  GradSync grad_sync(params, dp, cfg.comm.bucket_mb, overlap, zero, wire);
  // comm.compress: powersgd replaces the bucket all-reduce from step powersgd_start + 1 on.
  std::optional<PowerSgd> powersgd;
  if (cfg.comm.compress == "powersgd" && layout.dp > 1)
    powersgd.emplace(params, dp, cfg.comm.powersgd_rank, cfg.train.seed);
  AdamW opt = zero ? AdamW(model->named_params(), grad_sync, cfg.optim, fused_adamw)
                   : AdamW(model->named_params(), cfg.optim, fused_adamw);
  const GradSync* shards = zero ? &grad_sync : nullptr;
  if (topo.rank == 0) {
    const double mib = static_cast<double>(opt.state_bytes()) / (1 << 20);
    log::info(zero ? concat("optimizer state: ", mib, " MiB per rank (ZeRO-1: sharded over ", layout.dp,
                            " data-parallel ranks; gradients reduce-scattered, parameters all-gathered)")
                   : concat("optimizer state: ", mib, " MiB per rank (replicated",
                            cfg.optim.zero == 1 ? "; optim.zero: 1 has nothing to shard with one data-parallel rank"
                                                : "",
                            ")"));
  }
  LossScaler scaler(precision == Precision::fp16);

  const int64_t T = dims.seq_len, micro = cfg.train.micro_batch, accum = cfg.train.grad_accum;
  const int64_t global_batch = cfg.train.global_batch;
  const int64_t tokens_per_step = global_batch * T;
  int64_t whole_params = 0;  // the whole model's (tensor parallel: not this rank's shards)
  for (const auto& [name, p] : model->named_params()) {
    int64_t n = 1;
    for (int64_t e : tp_whole_shape(p.sizes(), tp_split(name), dims.tp)) n *= e;
    whole_params += n;
  }
  log::info(concat("model: ", dims.arch, ", ", whole_params, " parameters (", dims.n_layer, " layers, ", dims.n_head,
                   " heads", dims.llama() ? concat(" / ", dims.n_kv_head, " kv heads") : std::string(), ", width ",
                   dims.n_embd,
                   dims.llama() ? concat(", SwiGLU ", dims.intermediate_size, ", rope theta ", dims.rope_theta,
                                         dims.rope_scaling == "llama3" ? " (llama3 scaling)" : "",
                                         dims.tie_embeddings ? ", tied output" : ", untied output",
                                         dims.qkv_bias ? ", qkv bias" : "")
                                : std::string(),
                   ", seq_len ", T, ", vocab ", dims.vocab_size,
                   dims.vocab_live > 0 ? concat(" = ", dims.vocab_live, " tokens + ", dims.vocab_size - dims.vocab_live,
                                                " padding rows outside the loss")
                                       : std::string(),
                   ")"));
  log::info(concat("batch: ", micro, " micro x ", layout.dp, " ranks x ", accum, " accum = ", global_batch,
                " sequences = ", tokens_per_step, " tokens per step; ", grad_sync.num_buckets(),
                zero ? " reduce-scatter buckets" : " all-reduce buckets",
                grad_sync.overlapping() ? " (overlapped with backward)" : "", "; ", threads,
                " threads per rank; backend ", dp.name()));
  if (layout.dp > 1)
    log::info(concat("gradient communication: ", static_cast<double>(grad_sync.bytes_per_step()) / (1 << 20),
                     " MiB per rank per step in ", cfg.comm.grad_dtype,
                     cfg.comm.grad_dtype == "fp32" ? std::string()
                                                   : " (comm.grad_dtype: half of fp32; summed in 16 bits, pre-divided by the group size)",
                     powersgd ? concat("; PowerSGD rank ", cfg.comm.powersgd_rank, " from step ", cfg.comm.powersgd_start + 1,
                                       ": ", static_cast<double>(powersgd->bytes_per_step()) / (1 << 20), " MiB (",
                                       static_cast<double>(powersgd->uncompressed_bytes()) /
                                           static_cast<double>(powersgd->bytes_per_step()),
                                       "x less; ", powersgd->compressed_matrices(),
                                       " weight matrices compressed, two all-reduces after backward, error feedback)")
                              : std::string()));
  else if (cfg.comm.compress == "powersgd" && topo.rank == 0)
    log::info("comm.compress: powersgd has nothing to compress with one data-parallel rank");
  log::info(concat("data: ", train_data->num_tokens(), " train tokens in ", train_data->paths().size(),
                " shards (", train_data->num_windows(), " windows/epoch)",
                val_data ? concat(", ", val_data->num_tokens(), " val tokens") : std::string()));

  TrainState st;
  st.world_size = topo.size;
  st.tokenizer = train_data->tokenizer();
  st.tokenizer_file = train_data->tokenizer_file();
  st.tokenizer_sha256 = train_data->tokenizer_sha256();
  st.eot_token = train_data->eot_token();
  if (has_resume) {
    resume_from(resume, model, opt, shards, st, mesh->world(), mpi_comm, cfg.train.seed, device);
    scaler.restore(st.loss_scale, st.loss_scale_good_steps);  // fp16: the scale continues
    if (topo.rank == 0) log_batch_change(st, cfg, layout.dp);
  }
  st.world_size = topo.size;
  st.dp = layout.dp;
  st.tp = layout.tp;
  st.zero = zero ? 1 : 0;
  st.config_yaml = to_yaml(cfg);
  // --stop-after N names an absolute step; a run resumed at or past it has nothing to do.
  if (hooks.stop_after >= 0 && st.step >= hooks.stop_after)
    agree(mpi_comm, [&] {
      throw UsageError(concat("command line: --stop-after ", hooks.stop_after, ": the run resumes at step ", st.step,
                              ", already there (it counts absolute steps; use a larger N)"));
    });

  // Same binary, config and data everywhere? ("code not synced on node 2")
  agree(mpi_comm, [&] {
    check_consistency(mpi_comm, topo,
                      {binary_fingerprint(), h5::crc32(st.config_yaml.data(), st.config_yaml.size()),
                       shard_list_fingerprint(train_data->paths())});
  });

  TrainResult result;
  result.num_params = model->num_params();
  // A run whose loss or parameters became NaN/inf stops here, printed once (every rank sees the
  // same all-reduced values), without saving that state; exit 2.
  auto diverged = [&](int64_t at_step, const std::string& what) {
    agree(mpi_comm, [&] {
      throw UsageError(concat("step ", at_step, ": ", what, " (", precision_name(precision),
                              "): training diverged; this state is not saved, the newest checkpoint stays ",
                              result.last_checkpoint.empty() ? std::string("as it was") : result.last_checkpoint,
                              ". Try a lower optim.lr, a longer optim.warmup_steps or optim.grad_clip > 0"));
    });
  };
  // The metrics file opens (or fails, naming log.metrics) before anything is written to out_dir.
  RunFacts facts;
  facts.tokens_per_step = tokens_per_step;
  facts.first_step = st.step;
  // Parameters that cost no matrix FLOPs: GPT-2's position table, and an untied Llama's input
  // embedding (a lookup; tied, it is also the output layer and counts). SwiGLU's three matrices
  // and GQA's smaller k/v projections count through the parameter total.
  const int64_t lookup_only = dims.llama() ? (dims.tie_embeddings ? 0 : dims.vocab_size * dims.n_embd) : dims.seq_len * dims.n_embd;
  facts.flops_per_token = model_flops_per_token(whole_params, lookup_only, dims.n_layer, dims.n_embd, T);
  facts.communicates = layout.dp > 1;
  facts.loss_scaling = scaler.enabled();
  facts.host = topo.host;
  {  // MFU against log.peak_tflops, else the known peak of this GPU (rank 0's; one kind per job)
    const std::string gpu = device.is_cuda() ? cuda_device_name(device.index()) : "";
    const double peak = cfg.log.peak_tflops > 0 ? cfg.log.peak_tflops : known_peak_tflops(gpu, precision_name(precision));
    facts.peak_flops = peak * 1e12 * topo.size;
    if (topo.rank == 0)
      log::info(concat("MFU: ", facts.flops_per_token / 1e6, " MFLOPs per token (6N + 12 L d T; docs/operations.md) vs ",
                       peak > 0 ? concat(peak, " TFLOPS per ", device.is_cuda() ? "GPU" : "rank",
                                         cfg.log.peak_tflops > 0 ? " (log.peak_tflops)"
                                                                 : concat(" (", gpu, ", ", precision_name(precision), ")"))
                       : device.is_cuda() ? concat("an unknown peak (", gpu, "): set log.peak_tflops for MFU")
                                          : std::string("no peak on the CPU: set log.peak_tflops for MFU")));
  }
  std::optional<Progress> progress_holder;
  agree(mpi_comm, [&] { naming_config_file(cfg, [&] {
    progress_holder.emplace(cfg, topo.rank == 0, facts);
  }); });
  Progress& progress = *progress_holder;
  if (topo.rank == 0) std::ofstream(cfg.train.out_dir + "/config.yaml") << st.config_yaml;
  BatchPrefetcher prefetch(*train_data, mesh->dp_rank(), micro);
  const uint64_t micro_stride = static_cast<uint64_t>(layout.dp * micro);
  result.checkpoint_writers = writers;
  std::optional<CommDup> checkpoint_comm;  // the writer thread's collectives (shares)
  if (shares) checkpoint_comm.emplace(mpi_comm);
  CheckpointShare share_buffers;  // shares + async: this rank's host copies, reused by every save
  // With checkpoint.async the loop stalls only for the host snapshot.
  AsyncCheckpointWriter checkpoints(cfg.checkpoint.dir, cfg.checkpoint.keep, cfg.checkpoint.async);
  // Async saves stall the loop only for copies into host buffers allocated here, once (ZeRO-1
  // through rank 0: also the whole moments rank 0 assembles, kept between saves); synchronous
  // saves allocate nothing between them.
  FullOptimState gathered;
  if (whole_model) gathered = host_optim_state_like(*whole_model);  // tensor parallel: rank 0's whole state
  if (checkpoints.async() && shares) {
    share_checkpoint(share_buffers, model, opt, shards, mesh->dp_rank() == 0, st, /*copy=*/true);
  } else if (whole_model && checkpoints.async()) {
    checkpoints.prepare(*whole_model, gathered);
  } else if (topo.rank == 0 && checkpoints.async()) {
    if (opt.sharded()) gathered = host_optim_state_like(model);
    checkpoints.prepare(model, opt.sharded() ? gathered : full_state_of(opt));
  }
  auto save = [&] {
    auto rng = gather_rng_states(mesh->world(), device);
    if (topo.rank == 0) {
      st.rng_states = std::move(rng);
      st.loss_scale = scaler.enabled() ? scaler.scale() : 0.0;
      st.loss_scale_good_steps = scaler.good_steps();
    }
    if (shares) {
      const std::string path =
          save_shares(checkpoints, share_buffers, model, opt, shards, mesh->dp_rank() == 0, st, checkpoint_comm->get());
      if (topo.rank == 0) result.last_checkpoint = path;
      return;  // collective: nobody runs ahead of a synchronous save that may yet fail
    }
    if (tensor_parallel) {  // the shards assembled on rank 0
      gather_tp_state(model, opt, shards, mesh->tp(), mesh->dp_rank() == 0, whole_model ? &*whole_model : nullptr,
                      &gathered);
      if (topo.rank == 0) result.last_checkpoint = checkpoints.save(*whole_model, gathered, st);
      if (!checkpoints.async()) mesh->world().barrier();
      return;
    }
    // ZeRO-1: assembled on rank 0
    FullOptimState optim_state = gather_optim_state(opt, shards, model, checkpoints.async() ? &gathered : nullptr);
    if (topo.rank == 0) result.last_checkpoint = checkpoints.save(model, optim_state, st);
    if (!checkpoints.async()) mesh->world().barrier();  // nobody runs ahead of a checkpoint that may yet fail
  };

  auto run_eval = [&](int64_t at_step) {
    const double v = progress.untimed([&] { return evaluate(model, *val_data, dp, cfg, device, precision); });
    result.val_losses.emplace_back(at_step, v);
    if (topo.rank == 0) progress.report_val(at_step, v);
  };

  SpanTimer comm_wait(device.is_cuda(), device.is_cuda() ? device.index() : -1);
  StepProfiler profiler(topo.rank == 0 ? cfg.log.profile_start : 0, cfg.log.profile_steps,
                        cfg.train.out_dir + "/profile/rank-0.json", device.is_cuda() ? device.index() : -1);
  model->train();
  if (val_data && cfg.eval.every > 0 && st.step == 0) run_eval(0);  // the untrained baseline
  for (int64_t step = st.step; step < cfg.train.steps; ++step) {
    const bool last = step + 1 == cfg.train.steps;
    progress.start_step();
    profiler.begin_step(step + 1);
    const bool compressed = powersgd && step >= cfg.comm.powersgd_start;
    Watchdog::set_step(step + 1);
    maybe_hang_for_test(topo.rank, step + 1);

    // ---- one optimizer step: accumulate micro-batches; grads averaged across ranks once ----
    // The loss stays on the device until a log step reads it: no host synchronisation per step.
    torch::Tensor loss_sum = torch::zeros({1}, torch::dtype(torch::kFloat64).device(device));
    for (int64_t m = 0; m < accum; ++m) {
      const uint64_t start = st.data_cursor + static_cast<uint64_t>(m) * micro_stride;
      // The next micro-batch follows in the global order, also across the step boundary.
      auto [x, y] = to_tensors(prefetch.take(start, start + micro_stride), micro, T);
      if (log::enabled(log::Level::debug)) {  // which samples this rank trains on (tests/cli_test.sh)
        const uint64_t first = start + static_cast<uint64_t>(mesh->dp_rank() * micro);
        log::debug(concat("data: step ", step + 1, " micro ", m, " windows ", first, "-", first + micro - 1));
      }
      torch::Tensor loss;
      {
        Autocast autocast(precision, device);
        loss = model->loss(to_device(x, device), to_device(y, device));
      }
      if (m + 1 == accum && !compressed) grad_sync.arm();  // this backward completes the step's gradients
      scaler.scale_loss(loss / static_cast<double>(accum)).backward();
      loss_sum += loss.detach().to(torch::kFloat64);
    }
    comm_wait.begin();  // what backward did not hide of the gradient communication
    if (compressed)
      powersgd->reduce_grads();
    else
      grad_sync.all_reduce_grads();  // ZeRO-1: reduce-scattered, each rank holds its slices
    comm_wait.end();
    bool finite = true;  // fp16 only; the same verdict on every rank
    torch::Tensor norm;
    if (zero || tensor_parallel) {
      // Each rank holds a part of the gradients: the verdict and the norm are agreed over the ranks
      // that hold the others (ZeRO-1: the dp group; tensor parallel: the world).
      std::vector<torch::Tensor> grads;
      for (size_t i = 0; i < opt.size(); ++i) grads.push_back(opt.grad(i));
      finite = scaler.unscale_and_check(grads, tensor_parallel ? mesh->world() : dp, device);
      norm = tensor_parallel ? clip_tp_grad_norm_(opt, cfg.optim.grad_clip, mesh->tp(), dp)
                             : clip_sharded_grad_norm_(opt, cfg.optim.grad_clip, dp);
    } else {
      finite = scaler.unscale_and_check(params);
      norm = clip_grad_norm_(params, cfg.optim.grad_clip);
    }
    const double lr = lr_at(cfg.optim, cfg.train.steps, step);
    if (finite) {
      opt.step(lr);
      if (zero) {  // every rank's updated slices to every rank
        comm_wait.begin();
        grad_sync.all_gather_params();
        comm_wait.end();
      }
    } else if (topo.rank == 0) {  // the same verdict on every rank
      log::warn(concat("step ", step + 1, ": fp16 gradients overflowed at loss scale ", scaler.scale(),
                       "; step skipped"));
    }
    scaler.update(finite);
    opt.zero_grad();
    st.step = step + 1;
    st.data_cursor += static_cast<uint64_t>(global_batch);
    st.tokens_seen += tokens_per_step;
    profiler.end_step(step + 1);

    if (every(step + 1, cfg.log.every) || last) {
      dp.all_reduce(loss_sum, ReduceOp::avg);
      double loss = 0, grad_norm = 0;
      {
        Watchdog::Scope watch("device synchronize (loss)");  // a stuck GPU collective shows here
        loss = loss_sum.item<double>() / static_cast<double>(accum);
        grad_norm = norm.item<double>();
      }
      result.losses.emplace_back(step + 1, loss);
      if (!std::isfinite(loss) || !std::isfinite(grad_norm))  // the same values on every rank
        diverged(step + 1, concat("the loss is ", loss, " and the gradient norm ", grad_norm));
      StepReport report{step, loss, lr, grad_norm, comm_wait.take_seconds(), scaler.enabled() ? scaler.scale() : 0.0};
      if (topo.rank == 0) progress.report(report);
    }

    if (val_data && (every(step + 1, cfg.eval.every) || (last && cfg.eval.every > 0))) run_eval(step + 1);
    // A stop signal on any rank stops every rank after this step, with a checkpoint.
    int signal = pending_stop_signal(), any_signal = 0;
    {
      Watchdog::Scope watch("all_reduce(stop signal)");
      MPI_CHECK(MPI_Allreduce(&signal, &any_signal, 1, MPI_INT, MPI_MAX, mpi_comm));
    }
    const bool stop_here = (hooks.stop_after >= 0 && step + 1 == hooks.stop_after) || any_signal != 0;
    if (every(step + 1, cfg.checkpoint.every) || last || stop_here) {
      // Never save a diverged state as the newest checkpoint: one check of every parameter (the
      // same on every rank after the all-reduce) per save.
      torch::Tensor all_finite;
      {
        torch::NoGradGuard no_grad;
        std::vector<torch::Tensor> ok;
        for (const auto& p : params) ok.push_back(torch::isfinite(p).all());
        all_finite = torch::stack(ok).all();
      }
      int finite_params = 1;
      {
        Watchdog::Scope watch("device synchronize (parameter check)");
        finite_params = all_finite.item<bool>() ? 1 : 0;
      }
      if (tensor_parallel) {  // each rank checked its shards: agree
        Watchdog::Scope watch("all_reduce(parameter check)");
        MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &finite_params, 1, MPI_INT, MPI_MIN, mpi_comm));
      }
      if (!finite_params) diverged(step + 1, "a parameter is NaN or infinite");
      progress.untimed(save);
    }
    if (any_signal != 0 && !last) {
      result.exit_code = exit_code_for_signal(any_signal);
      if (topo.rank == 0)
        log::warn(concat("stopped by signal ", any_signal, " after step ", step + 1,
                         ": checkpoint written, exit code ", result.exit_code));
      break;
    }
    if (stop_here) break;
  }
  // The last asynchronous write completes (or its failure ends the job, exit 2) before any rank
  // finishes, also when stopping on a signal.
  if (checkpoints.async()) {
    checkpoints.wait();  // ranks without a write in flight return at once
    mesh->world().barrier();
  }
  result.final_step = st.step;
  if (device.is_cuda() && topo.rank == 0)
    log::info(concat("peak GPU memory (allocated by libtorch, rank 0): ",
                     static_cast<double>(cuda_peak_allocated_bytes(device.index())) / (1 << 30), " GiB"));

  if (tensor_parallel && topo.rank == 0 && cfg.sample.tokens > 0)
    log::info(concat("sample: not generated by a tensor-parallel run; `mpitrain sample ", result.last_checkpoint,
                     "` samples its checkpoint"));
  if (!tensor_parallel && topo.rank == 0 && cfg.sample.tokens > 0 && st.tokenizer == "byte") {
    std::vector<int64_t> prompt{st.eot_token};
    for (unsigned char c : cfg.sample.prompt) prompt.push_back(c);
    auto out = generate(model, prompt, cfg.sample.tokens, cfg.sample.temperature, cfg.sample.top_k,
                        cfg.train.seed);
    result.sample = decode_bytes(std::vector<int64_t>(out.begin() + 1, out.end()), st.eot_token);
    log::info("sample:\n" + result.sample);
  }
  if (hooks.keep_params)
    for (auto& [name, p] : model->named_params()) {  // whole parameters (tensor parallel: gathered)
      torch::Tensor c = tp_unshard(p.detach(), tp_split(name), mesh->tp()).to(torch::kCPU, torch::kFloat32).contiguous();
      result.params.emplace_back(name, std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel()));
    }
  return result;
}

}  // namespace mpitrain
