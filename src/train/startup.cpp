// Start-up of a training run (see startup.h).
#include "mpitrain/startup.h"

#include <sched.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <unistd.h>

#include <climits>
#include <filesystem>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>

#include "mpitrain/checkpoint.h"
#include "mpitrain/device.h"
#include "mpitrain/fused_ops.h"
#include "mpitrain/log.h"
#include "mpitrain/netcheck.h"
#include "mpitrain/preflight.h"
#include "mpitrain/signals.h"
#include "mpitrain/watchdog.h"

namespace mpitrain {
namespace {

// Torch threads per rank: the cores this process may use, shared by the ranks on its host.
int configure_threads(int64_t requested, int local_size) {
  int threads = static_cast<int>(requested);
  if (threads <= 0) {
    cpu_set_t set;
    int cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
    threads = std::max(1, cores / std::max(1, local_size));
  }
  torch::set_num_threads(threads);
  at::globalContext().setFlushDenormal(true);  // denormals make fp32 CPU kernels crawl
  return threads;
}

// Every step allocates and frees the same activation tensors. With glibc's defaults each of them
// above its mmap threshold (128 KiB until a free raises it) is a fresh mmap: the kernel zeroes its
// pages on first touch and unmaps them again at the free, and trimming returns the heap's top
// likewise. That was 10% of a CPU step (4-layer model: 1.0M page faults in 26 steps, 2.1 s of
// system time; bench/cpu_vs_pytorch.sh). Allocations up to glibc's largest threshold (32 MiB) come
// from the heap, and freed memory stays in the process for the next step, as caching allocators
// do. Settings the user made through MALLOC_*_ or GLIBC_TUNABLES are left alone.
void keep_freed_memory() {
#if defined(__GLIBC__)
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("MALLOC_TRIM_THRESHOLD_") ||
      (tunables && std::string(tunables).find("glibc.malloc.") != std::string::npos))
    return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, INT_MAX);
#endif
}

// The text of a file, or nullopt when it cannot be read.
std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Does every rank see rank 0's checkpoint.dir (a shared filesystem, or all ranks on one host)?
// Each rank reads the lock file there and compares it with what rank 0 wrote into it (host, pid,
// start time: no other job's file reads the same). The lowest rank that does not, or -1 when all
// do; rank 0 (as if nobody else saw it) when it holds no lock to compare with.
int first_rank_not_seeing_lock(const std::string& dir, const DirLock* lock, MpiComm comm) {
  const int rank = mpi::rank(comm);
  std::string expected;
  if (rank == 0 && lock && lock->held()) expected = read_text(lock->path()).value_or("");
  mpi::broadcast(expected, 0, comm);
  if (expected.empty()) return 0;
  const bool sees = rank == 0 || (read_text(dir + "/" + DirLock::kFileName) == expected &&
                                  ::access(dir.c_str(), W_OK) == 0);
  const int first = mpi::all_reduced(sees ? INT_MAX : rank, ReduceOp::min, comm);
  return first == INT_MAX ? -1 : first;
}

// Tensor parallel splits whole heads, the MLP's hidden units and the vocabulary over the tp ranks.
void check_tensor_parallel_dims(const GPTDims& d, int tp) {
  auto must_divide = [&](const char* key, int64_t value, const std::string& what) {
    if (value % tp != 0)
      throw UsageError(concat("parallel.tp: ", tp, " must divide ", key, " (", value, "): ", what));
  };
  must_divide("model.n_head", d.n_head, "each tp rank computes whole attention heads");
  if (d.llama()) {
    must_divide("model.n_kv_head", d.n_kv_head, "each tp rank holds whole key/value heads");
    must_divide("model.intermediate_size", d.intermediate_size, "the MLP's hidden units are split over the tp ranks");
  } else {
    must_divide("4 x model.n_embd", 4 * d.n_embd, "the MLP's hidden units are split over the tp ranks");
  }
  if (d.vocab_size % tp != 0)
    throw UsageError(concat("model.vocab_size: ", d.vocab_size, " must be a multiple of parallel.tp (", tp,
                            "): the vocabulary is split over the tp ranks; set a padded size such as ",
                            (d.vocab_size + tp - 1) / tp * tp, ", or leave model.vocab_size unset (automatic padding)"));
}

// Automatic vocabulary padding depends on the device and the tp degree; a resumed run keeps the
// rows its checkpoint has (rank 0 reads the newest candidate's dimensions). A checkpoint that
// cannot be read here is left to the loader, which tries the older ones and says why.
void keep_checkpoint_vocab(Startup& run, const Config& cfg, MpiComm comm) {
  int64_t stored = 0;
  if (run.topo.rank == 0) {
    try {
      stored = checkpoint_dims(run.resume.front()).vocab_size;
    } catch (const std::exception&) {
      stored = 0;
    }
  }
  mpi::broadcast_value(stored, 0, comm);
  GPTDims& d = run.dims;
  if (stored == 0 || stored == d.vocab_size) return;
  // The classes: the initial weights' (model.init_from: hf:, whose config.json gives them), else the data's.
  const int64_t tokens = cfg.model.init_vocab > 0 ? cfg.model.init_vocab : run.train_data->vocab_size();
  const int64_t tp = run.layout.tp;
  agree(comm, [&] { naming_config_file(cfg, [&] {
    if (stored < tokens || stored % tp != 0)
      throw UsageError(concat("model.vocab_size: the checkpoint to resume has ", stored, " vocabulary rows, which ",
                              stored < tokens ? concat("are fewer than the data's ", tokens, " tokens")
                                              : concat("parallel.tp ", tp, " does not divide"),
                              "; resume with another parallel.tp, or start a new run"));
  }); });
  if (run.topo.rank == 0)
    log::info(concat("model: vocabulary rows ", stored, " as the checkpoint has them (automatic padding would give ",
                     d.vocab_size, " here)"));
  d.vocab_size = stored;
  d.vocab_live = stored > tokens ? tokens : 0;
}

}  // namespace

std::string libtorch_release() { return TORCH_VERSION; }

std::string cpu_kernels() {
  // ATen's own account: "  - CPU capability usage: AVX2" in its build configuration text.
  const std::string config = at::show_config(), key = "CPU capability usage: ";
  const size_t at = config.find(key);
  if (at == std::string::npos) return "unknown";
  const size_t begin = at + key.size(), end = config.find('\n', begin);
  return config.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

int local_gpu_count() { return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0; }

Startup start_up(Config& cfg, MpiComm mpi_comm, bool force_unlock, bool plan_only) {
  install_stop_signals();
  follow_mpi_interface_for_nccl();  // before any NCCL communicator exists
  Startup run;
  run.topo = Topology::discover(mpi_comm);
  const Topology& topo = run.topo;
  // The layout: world = islands x pp x dp x tp. The batch arithmetic counts data replicas (all islands').
  MeshLayout& layout = run.layout;
  int64_t islands = islands_count(cfg.parallel.islands);
  std::vector<std::vector<double>> gbit;
  if (islands == -2 && topo.hosts.size() > 1) gbit = host_bandwidths(mpi_comm, topo, 4 << 20);  // collective
  agree(mpi_comm, [&] { naming_config_file(cfg, [&] {
    if (islands == -2) {  // auto: hosts joined by slow links in separate islands (layout.h)
      const std::vector<int> group = gbit.empty() ? std::vector<int>{0} : group_hosts(gbit, cfg.parallel.slow_link_gbit);
      if (topo.rank == 0 && !gbit.empty())
        log::info(concat("parallel.islands: auto: ", describe_groups(topo, gbit, group, cfg.parallel.slow_link_gbit),
                         " (slow: below parallel.slow_link_gbit ", cfg.parallel.slow_link_gbit,
                         " or a quarter of the fastest link)"));
      islands = islands_of_groups(topo, group);
    }
    layout = plan_layout(topo, cfg.parallel.tp, islands, cfg.parallel.ep, cfg.parallel.pp);
  }); });
  agree(mpi_comm, [&] { resolve_for_world(cfg, layout.replicas()); });
  log::set_level(log::parse_level(cfg.log.level));
  log::set_all_ranks(cfg.log.level == "debug");  // debug: every rank's lines, each with its rank
  if (cfg.log.rank_files && !plan_only) {  // every rank's lines in <out_dir>/logs/rank-<r>.log, also on hosts without rank 0
    agree(mpi_comm, [&] { naming_config_file(cfg, [&] {
      const std::string dir = cfg.train.out_dir + "/logs", path = concat(dir, "/rank-", topo.rank, ".log");
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      try {
        log::open_rank_file(path);
      } catch (const std::exception& e) {
        throw UsageError(concat("train.out_dir: rank ", topo.rank, " (host ", topo.host, ") cannot write its log '",
                                path, "': ", ec ? ec.message() : std::string(e.what()),
                                " (or set log.rank_files: false)"));
      }
    }); });
    log::file_only(concat("---- mpitrain ", MPITRAIN_VERSION, " rank ", topo.rank, " of ", topo.size,
                          " on ", topo.host, ", pid ", ::getpid()));
  }
  if (const char* r = std::getenv("MPITRAIN_TEST_WARN_RANK"); r && std::atoi(r) == topo.rank)  // tests/observe_test.sh
    log::warn(concat("test: a warning of rank ", topo.rank));
  Watchdog::start(cfg.fault.collective_timeout_s, cfg.fault.first_collective_timeout_s);
  keep_freed_memory();
  run.threads = configure_threads(cfg.train.threads, topo.local_size);
  log::info(topo.host_map());
  log::info(layout.describe(topo));

  // ---- device, data, model dimensions, communicators ----
  auto& train_data = run.train_data;
  auto& val_data = run.val_data;
  GPTDims& dims = run.dims;
  auto& mesh = run.mesh;
  torch::Device& device = run.device;
  run.precision = parse_precision(cfg.train.precision);
  const Precision precision = run.precision;
  agree(mpi_comm, [&] { naming_config_file(cfg, [&] {
    const DeviceChoice where = choose_device(cfg.train.device, cfg.comm.backend, local_gpu_count(),
                                             topo.local_rank, topo.local_size, topo.host);
    if (where.cuda) {
      device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(where.index));
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(device);
    }
    log::debug(concat("rank ", topo.rank, " (host ", topo.host, ", local rank ", topo.local_rank, ") trains on ",
                      where.describe));
    if (topo.rank == 0)
      log::info(concat("device: ", where.cuda ? "CUDA, one GPU per local rank" : "CPU", where.shared ? " (GPUs shared by ranks)" : "",
                       "; rank 0 on ", where.describe, "; precision ", precision_name(precision)));
    if (precision == Precision::fp16 && !where.cuda)
      throw UsageError("train.precision: fp16 needs CUDA (this run trains on the CPU); use bf16 or fp32");
    if (cfg.data.weights.empty()) {
      train_data = std::make_unique<TokenDataset>(expand_shard_paths(cfg.data.train, "data.train"),
                                                  cfg.model.seq_len, cfg.data.seed, cfg.data.shuffle);
    } else {  // a weighted mixture: each entry a source
      std::vector<std::vector<std::string>> sources;
      std::vector<double> weights;
      std::vector<std::string> names;
      for (size_t i = 0; i < cfg.data.train.size(); ++i) {
        names.push_back(concat("data.train[", i, "] (", cfg.data.train[i], ")"));
        sources.push_back(expand_shard_paths({cfg.data.train[i]}, names.back()));
        weights.push_back(std::stod(cfg.data.weights[i]));
      }
      std::vector<std::pair<uint64_t, std::vector<double>>> later;  // data.stages: from their first windows
      for (const std::string& spec : cfg.data.stages) {
        const auto [step, w] = parse_stage_spec(spec, sources.size(), "data.stages");
        later.emplace_back(static_cast<uint64_t>(step * cfg.train.global_batch), w);
      }
      train_data = std::make_unique<TokenDataset>(sources, weights, names, cfg.model.seq_len, cfg.data.seed,
                                                  cfg.data.shuffle, later);
      if (topo.rank == 0) {
        std::string list;
        for (size_t i = 0; i < names.size(); ++i)
          list += concat(i ? ", " : "", cfg.data.train[i], " ", train_data->source_slots()[i], "/", TokenDataset::kMixturePeriod);
        for (size_t k = 0; k < later.size(); ++k) {
          list += concat("; from step ", later[k].first / static_cast<uint64_t>(cfg.train.global_batch), ":");
          for (size_t i = 0; i < names.size(); ++i) list += concat(" ", train_data->source_slots(k + 1)[i]);
        }
        log::info(concat("data: a mixture of ", names.size(), " sources, windows per ", TokenDataset::kMixturePeriod, ": ", list,
                         " (every prefix of the run within one window of each share; tokens per source in metrics.jsonl)"));
      }
    }
    if (!cfg.data.val.empty()) {
      val_data = std::make_unique<TokenDataset>(expand_shard_paths(cfg.data.val, "data.val"),
                                                cfg.model.seq_len, cfg.data.seed, /*shuffle=*/false);
      if (val_data->vocab_size() != train_data->vocab_size())
        throw UsageError(concat("data.val: vocab_size ", val_data->vocab_size(), " differs from data.train's ",
                             train_data->vocab_size()));
      if (val_data->tokenizer_sha256() != train_data->tokenizer_sha256())
        throw UsageError(concat("data.val: packed with another tokenizer.json than data.train (SHA-256 ",
                                val_data->tokenizer_sha256().substr(0, 12), " vs ",
                                train_data->tokenizer_sha256().substr(0, 12), ")"));
    }
    dims = model_dims(cfg.model, train_data->vocab_size(), vocab_pad_multiple(cfg.model, device.is_cuda(), layout.tp));
    if (layout.tp > 1) check_tensor_parallel_dims(dims, layout.tp);
    // The fused loss saves GPU memory; on the CPU with small vocabularies the plain path is faster.
    // (Not with soft-capped logits, which it has no cap for: Gemma 2.)
    RunOptions& opts = run.options;
    opts.fused_loss = cfg.model.fused_loss == "on" || (cfg.model.fused_loss == "auto" && device.is_cuda() && dims.final_softcap == 0);
    // On the CPU, and in GPU builds made without nvcc, the fused ops run their ATen reference,
    // slower than libtorch's own kernels: auto takes them only where the CUDA kernels exist, and
    // for the norms they have (not Gemma's).
    opts.fused_kernels = cfg.model.fused_kernels == "on" ||
                        (cfg.model.fused_kernels == "auto" && device.is_cuda() && fused_kernels_built() &&
                         !dims.family_row().gemma_norms);
    const std::string& ac = cfg.train.activation_checkpointing;
    opts.ac = ac == "full" ? RunOptions::Ac::full : ac == "selective" ? RunOptions::Ac::selective : RunOptions::Ac::none;
    opts.ac_every = cfg.train.ac_every;
    opts.capacity_factor = capacity_factor_of(cfg.train.moe_capacity_factor);
    opts.z_loss_coef = cfg.train.moe_z_loss_coef;
    opts.routing_bias = cfg.train.moe_bias_update_rate > 0;
    if (topo.rank == 0 && (opts.fused_loss || opts.fused_kernels))
      log::info(concat("fused: classifier loss ", opts.fused_loss ? "on" : "off", ", block ops ",
                       opts.fused_kernels ? (device.is_cuda() && fused_kernels_built() ? "on (CUDA kernels)"
                                                                                       : "on (ATen reference)")
                                          : "off"));
  }); });

  // Pre-flight: every rank's versions, GPU and network compared before NCCL starts (preflight.h).
  agree(mpi_comm, [&] {
    const bool nccl = device.is_cuda() && cfg.comm.backend != "mpi";
    run_preflight(mpi_comm, topo, TORCH_VERSION, gpu_facts(device.is_cuda() ? device.index() : -1), nccl);
  });

  agree(mpi_comm, [&] { naming_config_file(cfg, [&] {
    mesh = std::make_unique<Mesh>(mpi_comm, layout, cfg.comm.backend, device);
    if (layout.tp > 1) run.tp = TpPlace{layout.tp, mesh->tp_rank(), &mesh->tp()};
    if (layout.ep > 1) {
      dims.ep = layout.ep;
      dims.ep_rank = mesh->ep_rank();
      dims.ep_comm = &mesh->ep();
    }
    if (layout.pp > 1) {
      dims.pp = layout.pp;
      dims.pp_stage = mesh->stage();
      dims.pp_virtual = cfg.parallel.pp_virtual;
      dims.pp_first_blocks = cfg.parallel.pp_first_stage_blocks, dims.pp_last_blocks = cfg.parallel.pp_last_stage_blocks;
      // Interleaved: the schedule's micro-batches go round the stages in groups of pp (Megatron's).
      if (cfg.parallel.pp_schedule == "interleaved" && cfg.train.grad_accum % layout.pp != 0)
        throw UsageError(concat("parallel.pp_schedule: interleaved needs a multiple of parallel.pp = ", layout.pp,
                                " micro-batches per step (", cfg.parallel.pp_microbatches > 0 ? "parallel.pp_microbatches" : "train.grad_accum",
                                "), got ", cfg.train.grad_accum));
    }
    const std::string attention = configure_attention(cfg.model.attention, dims, layout.tp, device, precision_dtype(precision));
    if (topo.rank == 0) log::info(concat("attention: ", attention));
  }); });

  // Is there a checkpoint to resume from? Decided before the model exists: a resumed run takes the
  // checkpoint's weights, and model.init_from only seeds a fresh start.
  auto& resume = run.resume;
  if (plan_only) return run;
  agree(mpi_comm, [&] { naming_config_file(cfg, [&] {
    if (topo.rank != 0) return;
    ensure_writable_dir(cfg.checkpoint.dir, "checkpoint.dir");
    // One job per checkpoint directory, before anything in it is read or written.
    run.checkpoint_lock =
        std::make_unique<DirLock>(cfg.checkpoint.dir, "checkpoint.dir", DirLock::self(topo.host), force_unlock);
    if (const auto& gone = run.checkpoint_lock->overridden())
      log::warn(concat("checkpoint.dir: --force-unlock overrode the lock of ", gone->describe(), " on '",
                       cfg.checkpoint.dir, "'"));
    else if (force_unlock)
      log::info(concat("checkpoint.dir: --force-unlock: '", cfg.checkpoint.dir, "' was not locked, nothing overridden"));
    ensure_writable_dir(cfg.train.out_dir, "train.out_dir");
    resume = resume_candidates(cfg.checkpoint);
  }); });
  int has_resume = resume.empty() ? 0 : 1;
  mpi::broadcast_value(has_resume, 0, mpi_comm);
  run.has_resume = has_resume != 0;
  if (run.has_resume && cfg.model.vocab_size == 0) keep_checkpoint_vocab(run, cfg, mpi_comm);
  run.checkpoint_dir_blind_rank = first_rank_not_seeing_lock(cfg.checkpoint.dir, run.checkpoint_lock.get(), mpi_comm);
  return run;
}

// A resumed run may use another global batch (another world size, micro-batch or accumulation):
// allowed, and said, with what it changes. The checkpoint's own run is known from the resolved
// config it stores (rank 0 reads the checkpoint; older checkpoints without one say nothing).
void log_batch_change(const TrainState& st, const Config& cfg, int dp) {
  if (st.config_yaml.empty()) return;
  Config before;
  try {
    before = parse_config(st.config_yaml, "the checkpoint's stored config");
  } catch (const std::exception&) {
    return;  // a config this version no longer reads: nothing to compare
  }
  const TrainConfig &a = before.train, &b = cfg.train;
  if (a.global_batch == b.global_batch && a.micro_batch == b.micro_batch && a.grad_accum == b.grad_accum &&
      st.dp == dp)
    return;
  log::warn(concat("global batch on resume: the checkpoint's run used ", a.global_batch, " sequences per step (",
                   a.micro_batch, " micro x ", st.dp, " data-parallel ranks x ", a.grad_accum, " accum), this run uses ",
                   b.global_batch, " (", b.micro_batch, " micro x ", dp, " data-parallel ranks x ", b.grad_accum, " accum)",
                   a.global_batch == b.global_batch
                       ? ": the same samples per step, so the data order and the schedule continue as before"
                       : concat(": the data order continues at sample ", st.data_cursor,
                                " without repeating or skipping, and the learning-rate schedule goes on by step (",
                                b.steps, " steps), so each remaining step now sees ", b.global_batch,
                                " sequences instead of ", a.global_batch)));
}

}  // namespace mpitrain
