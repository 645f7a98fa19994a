// The training loop: start-up from MPI alone, data-parallel steps with bucketed gradient
// all-reduce, evaluation, progress and JSONL metrics, checkpoints and exact resume.
#include "mpitrain/train.h"

#include <sched.h>
#include <sys/stat.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

#include "mpitrain/checkpoint.h"
#include "mpitrain/comm.h"
#include "mpitrain/consistency.h"
#include "mpitrain/ddp.h"
#include "mpitrain/error.h"
#include "mpitrain/h5.h"
#include "mpitrain/log.h"
#include "mpitrain/model.h"
#include "mpitrain/mpi_env.h"
#include "mpitrain/netcheck.h"
#include "mpitrain/optim.h"
#include "mpitrain/shards.h"
#include "mpitrain/signals.h"
#include "mpitrain/watchdog.h"

namespace mpitrain {
namespace {

using Clock = std::chrono::steady_clock;

bool every(int64_t step, int64_t n) { return n > 0 && step % n == 0; }

// ---- start-up helpers --------------------------------------------------------------------------

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

std::vector<uint8_t> rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  torch::Tensor s = gen.get_state();
  return std::vector<uint8_t>(s.data_ptr<uint8_t>(), s.data_ptr<uint8_t>() + s.numel());
}

void set_rng_state(const std::vector<uint8_t>& bytes) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  torch::Tensor s = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  std::memcpy(s.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  gen.set_state(s);
}

// Every rank's RNG state, gathered (all ranks call; rank 0 keeps them for the checkpoint).
std::vector<std::vector<uint8_t>> gather_rng_states(Communicator& comm) {
  auto mine = rng_state();
  torch::Tensor in = torch::from_blob(mine.data(), {static_cast<int64_t>(mine.size())}, torch::kUInt8);
  torch::Tensor out = torch::empty({comm.size() * in.numel()}, torch::kUInt8);
  comm.all_gather(in, out);
  std::vector<std::vector<uint8_t>> all(comm.size());
  for (int r = 0; r < comm.size(); ++r) {
    const uint8_t* p = out.data_ptr<uint8_t>() + r * in.numel();
    all[r].assign(p, p + in.numel());
  }
  return all;
}

// Loads the checkpoint on rank 0 and broadcasts it: ranks on other hosts need not see the file.
// A corrupt newest checkpoint (checksum, truncation) falls back to the previous one, with a
// warning; an explicitly named checkpoint must load.
void resume_from(const std::vector<std::string>& candidates, GPT& model, AdamW& opt, TrainState& st,
                 Communicator& comm, MPI_Comm mpi_comm, uint64_t seed) {
  std::string path;
  agree(mpi_comm, [&] {
    if (comm.rank() != 0) return;
    for (size_t i = 0; i < candidates.size(); ++i) {
      try {
        load_checkpoint(candidates[i], model, &opt, st);
        path = candidates[i];
        return;
      } catch (const UsageError& e) {
        if (i + 1 == candidates.size()) throw;
        log::warn(concat("cannot resume from ", candidates[i], ": ", e.what(), "; falling back to ",
                         candidates[i + 1]));
      }
    }
  });
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < opt.size(); ++i) {
    comm.broadcast(opt.param(i), 0);
    comm.broadcast(opt.exp_avg(i), 0);
    comm.broadcast(opt.exp_avg_sq(i), 0);
  }
  torch::Tensor scalars = torch::tensor({st.step, st.tokens_seen, static_cast<int64_t>(st.data_cursor),
                                         st.world_size, opt.steps_taken()}, torch::kInt64);
  comm.broadcast(scalars, 0);
  auto s = scalars.accessor<int64_t, 1>();
  st.step = s[0];
  st.tokens_seen = s[1];
  st.data_cursor = static_cast<uint64_t>(s[2]);
  st.world_size = s[3];
  opt.set_steps_taken(s[4]);

  // RNG states follow their rank when the world size is unchanged; otherwise reseed per rank.
  int64_t n_states = comm.rank() == 0 ? static_cast<int64_t>(st.rng_states.size()) : 0;
  int64_t state_bytes = n_states > 0 ? static_cast<int64_t>(st.rng_states[0].size()) : 0;
  torch::Tensor dims = torch::tensor({n_states, state_bytes}, torch::kInt64);
  comm.broadcast(dims, 0);
  n_states = dims[0].item<int64_t>();
  state_bytes = dims[1].item<int64_t>();
  if (n_states == comm.size() && state_bytes > 0) {
    torch::Tensor all = torch::empty({n_states, state_bytes}, torch::kUInt8);
    if (comm.rank() == 0)
      for (int64_t r = 0; r < n_states; ++r)
        std::memcpy(all[r].data_ptr<uint8_t>(), st.rng_states[r].data(), state_bytes);
    comm.broadcast(all, 0);
    torch::Tensor mine = all[comm.rank()].contiguous();
    set_rng_state(std::vector<uint8_t>(mine.data_ptr<uint8_t>(), mine.data_ptr<uint8_t>() + state_bytes));
  } else {
    if (n_states > 0)
      log::warn(concat("checkpoint was written by ", n_states, " ranks, this run has ", comm.size(),
                    ": RNG streams are reseeded (the data order continues exactly)"));
    torch::manual_seed(seed + 7919 * static_cast<uint64_t>(comm.rank() + 1) + st.step);
  }
  log::info(concat("resumed from ", path, " at step ", st.step, " (", st.tokens_seen, " tokens seen)"));
}

// Inputs and targets [rows, T] from rows x (T+1) window tokens.
std::pair<torch::Tensor, torch::Tensor> to_tensors(const std::vector<int64_t>& buf, int64_t rows, int64_t T) {
  torch::Tensor all = torch::from_blob(const_cast<int64_t*>(buf.data()), {rows, T + 1}, torch::kInt64);
  return {all.slice(1, 0, T).clone(), all.slice(1, 1, T + 1).clone()};
}

// One rank's slice of one micro-step, read synchronously (evaluation).
std::pair<torch::Tensor, torch::Tensor> get_batch(const TokenDataset& data, uint64_t start, int rank,
                                                  int64_t rows, std::vector<int64_t>& buf) {
  buf.resize(static_cast<size_t>(rows * (data.seq_len() + 1)));
  data.batch(start, rank, rows, buf.data());
  return to_tensors(buf, rows, data.seq_len());
}

// Mean validation loss over eval.batches micro-batches per rank: the same windows every time.
double evaluate(GPT& model, const TokenDataset& val, Communicator& comm, const Config& cfg) {
  torch::NoGradGuard no_grad;
  model->eval();
  std::vector<int64_t> buf;
  const int64_t rows = cfg.train.micro_batch;
  torch::Tensor sum = torch::zeros({1}, torch::kFloat64);
  for (int64_t b = 0; b < cfg.eval.batches; ++b) {
    auto [x, y] = get_batch(val, static_cast<uint64_t>(b * comm.size() * rows), comm.rank(), rows, buf);
    sum += model->loss(x, y).to(torch::kFloat64);
  }
  comm.all_reduce(sum, ReduceOp::avg);
  model->train();
  return sum.item<double>() / static_cast<double>(cfg.eval.batches);
}

std::string human_duration(double seconds) {
  const auto s = static_cast<long long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, (s / 60) % 60);
  else std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  return buf;
}

// ---- progress: console line and JSONL metrics (rank 0) ----------------------------------------

class Progress {
 public:
  Progress(const Config& cfg, bool writer, int64_t tokens_per_step, int64_t first_step)
      : cfg_(cfg), tokens_per_step_(tokens_per_step), first_step_(first_step) {
    if (!writer) return;
    const std::string path =
        cfg.log.metrics.empty() ? cfg.train.out_dir + "/metrics.jsonl" : cfg.log.metrics;
    std::error_code ec;  // a failure shows as the open below failing
    if (auto slash = path.rfind('/'); slash != std::string::npos) std::filesystem::create_directories(path.substr(0, slash), ec);
    metrics_.open(path, std::ios::app);
    if (!metrics_) throw UsageError(concat("log.metrics: cannot write '", path, "'"));
  }

  void start_step() { step_start_ = Clock::now(); }

  void report(int64_t step, double loss, double lr, double norm) {
    const double dt = std::chrono::duration<double>(Clock::now() - step_start_).count();
    elapsed_ += dt;
    const int64_t done = step + 1 - first_step_;
    const double avg = elapsed_ / static_cast<double>(std::max<int64_t>(1, done));
    const double tok_s = static_cast<double>(tokens_per_step_) / dt;
    if (!every(step + 1, cfg_.log.every) && step + 1 != cfg_.train.steps) return;
    char line[256];
    std::snprintf(line, sizeof line,
                  "step %5lld/%lld | loss %.4f | lr %.2e | norm %.3f | %.0f tok/s | %.0f ms/step | ETA %s",
                  static_cast<long long>(step + 1), static_cast<long long>(cfg_.train.steps), loss, lr,
                  norm, tok_s, dt * 1e3,
                  human_duration(avg * static_cast<double>(cfg_.train.steps - step - 1)).c_str());
    log::info(line);
    if (metrics_.is_open()) {
      std::snprintf(line, sizeof line,
                    "{\"step\": %lld, \"loss\": %.6f, \"lr\": %.6e, \"grad_norm\": %.6f, "
                    "\"tokens_per_s\": %.1f, \"ms_per_step\": %.2f}",
                    static_cast<long long>(step + 1), loss, lr, norm, tok_s, dt * 1e3);
      metrics_ << line << "\n" << std::flush;
    }
  }

  void report_val(int64_t step, double val_loss) {
    log::info(concat("step ", step, " | val loss ", val_loss));
    if (metrics_.is_open()) {
      char line[128];
      std::snprintf(line, sizeof line, "{\"step\": %lld, \"val_loss\": %.6f}",
                    static_cast<long long>(step), val_loss);
      metrics_ << line << "\n" << std::flush;
    }
  }

 private:
  const Config& cfg_;
  int64_t tokens_per_step_;
  int64_t first_step_;
  double elapsed_ = 0;
  Clock::time_point step_start_;
  std::ofstream metrics_;
};

// Bytes as printable text for the sample: newlines kept, other control bytes escaped.
std::string decode_bytes(const std::vector<int64_t>& tokens, int64_t eot) {
  std::string out;
  for (int64_t t : tokens) {
    if (t == eot) out += "\n<|endoftext|>\n";
    else if (t == '\n' || t == '\t' || (t >= 32 && t < 256)) out += static_cast<char>(t);
    else out += concat("\\x", std::hex, t);
  }
  return out;
}

}  // namespace

// ---- the run -----------------------------------------------------------------------------------

int local_gpu_count() { return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0; }

TrainResult train(Config cfg, MPI_Comm mpi_comm, const TrainHooks& hooks) {
  install_stop_signals();
  follow_mpi_interface_for_nccl();  // before any NCCL communicator exists
  const Topology topo = Topology::discover(mpi_comm);
  agree(mpi_comm, [&] { resolve_for_world(cfg, topo.size); });
  log::set_level(log::parse_level(cfg.log.level));
  Watchdog::start(cfg.fault.collective_timeout_s, cfg.fault.first_collective_timeout_s);
  const int threads = configure_threads(cfg.train.threads, topo.local_size);
  log::info(topo.host_map());

  // ---- data, model, communicator ----
  std::unique_ptr<TokenDataset> train_data, val_data;
  GPTDims dims;
  std::unique_ptr<Communicator> comm;
  const torch::Device device(torch::kCPU);
  agree(mpi_comm, [&] {
    train_data = std::make_unique<TokenDataset>(expand_shard_paths(cfg.data.train, "data.train"),
                                                cfg.model.seq_len, cfg.data.seed, cfg.data.shuffle);
    if (!cfg.data.val.empty()) {
      val_data = std::make_unique<TokenDataset>(expand_shard_paths(cfg.data.val, "data.val"),
                                                cfg.model.seq_len, cfg.data.seed, /*shuffle=*/false);
      if (val_data->vocab_size() != train_data->vocab_size())
        throw UsageError(concat("data.val: vocab_size ", val_data->vocab_size(), " differs from data.train's ",
                             train_data->vocab_size()));
    }
    dims = model_dims(cfg.model, train_data->vocab_size());
    comm = make_communicator(cfg.comm.backend, mpi_comm, device);
  });

  torch::manual_seed(cfg.train.seed);
  GPT model(dims);
  model->to(device);
  {  // identical initial parameters on every rank, whatever each rank's RNG did
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : model->named_params()) comm->broadcast(p, 0);
  }
  // Dropout streams differ per rank (as in DDP); the model above was drawn before this.
  torch::manual_seed(cfg.train.seed + 7919 * static_cast<uint64_t>(topo.rank + 1));

  AdamW opt(model->named_params(), cfg.optim);
  std::vector<torch::Tensor> params;
  for (size_t i = 0; i < opt.size(); ++i) params.push_back(opt.param(i));
  GradSync grad_sync(params, *comm, cfg.comm.bucket_mb);

  const int64_t T = dims.seq_len, micro = cfg.train.micro_batch, accum = cfg.train.grad_accum;
  const int64_t global_batch = cfg.train.global_batch;
  const int64_t tokens_per_step = global_batch * T;
  log::info(concat("model: ", model->num_params(), " parameters (", dims.n_layer, " layers, ", dims.n_head,
                " heads, width ", dims.n_embd, ", seq_len ", T, ", vocab ", dims.vocab_size, ")"));
  log::info(concat("batch: ", micro, " micro x ", topo.size, " ranks x ", accum, " accum = ", global_batch,
                " sequences = ", tokens_per_step, " tokens per step; ", grad_sync.num_buckets(),
                " all-reduce buckets; ", threads, " threads per rank; backend ", comm->name()));
  log::info(concat("data: ", train_data->num_tokens(), " train tokens in ", train_data->paths().size(),
                " shards (", train_data->num_windows(), " windows/epoch)",
                val_data ? concat(", ", val_data->num_tokens(), " val tokens") : std::string()));

  TrainState st;
  st.world_size = topo.size;
  st.tokenizer = train_data->tokenizer();
  st.eot_token = train_data->eot_token();
  std::vector<std::string> resume;
  agree(mpi_comm, [&] {
    if (topo.rank != 0) return;
    ensure_writable_dir(cfg.checkpoint.dir, "checkpoint.dir");
    ensure_writable_dir(cfg.train.out_dir, "train.out_dir");
    resume = resume_candidates(cfg.checkpoint);
  });
  int has_resume = resume.empty() ? 0 : 1;
  MPI_CHECK(MPI_Bcast(&has_resume, 1, MPI_INT, 0, mpi_comm));
  if (has_resume) resume_from(resume, model, opt, st, *comm, mpi_comm, cfg.train.seed);
  st.world_size = topo.size;
  st.config_yaml = to_yaml(cfg);

  // Same binary, config and data everywhere? ("code not synced on node 2")
  agree(mpi_comm, [&] {
    check_consistency(mpi_comm, topo,
                      {binary_fingerprint(), h5::crc32(st.config_yaml.data(), st.config_yaml.size()),
                       shard_list_fingerprint(train_data->paths())});
  });

  if (topo.rank == 0) {
    std::ofstream(cfg.train.out_dir + "/config.yaml") << st.config_yaml;
  }

  TrainResult result;
  result.num_params = model->num_params();
  Progress progress(cfg, topo.rank == 0, tokens_per_step, st.step);
  BatchPrefetcher prefetch(*train_data, topo.rank, micro);
  const uint64_t micro_stride = static_cast<uint64_t>(topo.size * micro);
  auto save = [&] {
    auto rng = gather_rng_states(*comm);
    if (topo.rank == 0) {
      st.rng_states = std::move(rng);
      result.last_checkpoint = save_checkpoint(cfg.checkpoint.dir, model, opt, st, cfg.checkpoint.keep);
      log::info(concat("checkpoint ", result.last_checkpoint));
    }
    comm->barrier();  // nobody runs ahead of a checkpoint that may yet fail
  };

  auto run_eval = [&](int64_t at_step) {
    const double v = evaluate(model, *val_data, *comm, cfg);
    result.val_losses.emplace_back(at_step, v);
    if (topo.rank == 0) progress.report_val(at_step, v);
  };

  model->train();
  if (val_data && cfg.eval.every > 0 && st.step == 0) run_eval(0);  // the untrained baseline
  for (int64_t step = st.step; step < cfg.train.steps; ++step) {
    const bool last = step + 1 == cfg.train.steps;
    progress.start_step();
    Watchdog::set_step(step + 1);
    maybe_hang_for_test(topo.rank, step + 1);

    // ---- one optimizer step: accumulate micro-batches; grads averaged across ranks once ----
    torch::Tensor loss_sum = torch::zeros({1}, torch::kFloat64);
    for (int64_t m = 0; m < accum; ++m) {
      const uint64_t start = st.data_cursor + static_cast<uint64_t>(m) * micro_stride;
      // The next micro-batch follows in the global order, also across the step boundary.
      auto [x, y] = to_tensors(prefetch.take(start, start + micro_stride), micro, T);
      torch::Tensor loss = model->loss(x.to(device), y.to(device));
      (loss / static_cast<double>(accum)).backward();
      loss_sum += loss.detach().to(torch::kCPU, torch::kFloat64);
    }
    grad_sync.all_reduce_grads();
    const double norm = clip_grad_norm(params, cfg.optim.grad_clip);
    const double lr = lr_at(cfg.optim, cfg.train.steps, step);
    opt.step(lr);
    opt.zero_grad();
    st.step = step + 1;
    st.data_cursor += static_cast<uint64_t>(global_batch);
    st.tokens_seen += tokens_per_step;

    if (every(step + 1, cfg.log.every) || last) {
      comm->all_reduce(loss_sum, ReduceOp::avg);
      const double loss = loss_sum.item<double>() / static_cast<double>(accum);
      result.losses.emplace_back(step + 1, loss);
      if (!std::isfinite(loss)) throw Error(concat("loss is ", loss, " at step ", step + 1));
      if (topo.rank == 0) progress.report(step, loss, lr, norm);
    } else if (topo.rank == 0) {
      progress.report(step, 0, lr, norm);  // times the step; prints nothing
    }

    if (val_data && (every(step + 1, cfg.eval.every) || (last && cfg.eval.every > 0))) run_eval(step + 1);
    // A stop signal on any rank stops every rank after this step, with a checkpoint.
    int signal = pending_stop_signal(), any_signal = 0;
    {
      Watchdog::Scope watch("all_reduce(stop signal)");
      MPI_CHECK(MPI_Allreduce(&signal, &any_signal, 1, MPI_INT, MPI_MAX, mpi_comm));
    }
    const bool stop_here = (hooks.stop_after >= 0 && step + 1 == hooks.stop_after) || any_signal != 0;
    if (every(step + 1, cfg.checkpoint.every) || last || stop_here) save();
    if (any_signal != 0 && !last) {
      result.exit_code = exit_code_for_signal(any_signal);
      log::warn(concat("stopped by signal ", any_signal, " after step ", step + 1, ": checkpoint written, exit code ",
                       result.exit_code));
      break;
    }
    if (stop_here) break;
  }
  result.final_step = st.step;

  if (topo.rank == 0 && cfg.sample.tokens > 0 && st.tokenizer == "byte") {
    std::vector<int64_t> prompt{st.eot_token};
    for (unsigned char c : cfg.sample.prompt) prompt.push_back(c);
    auto out = generate(model, prompt, cfg.sample.tokens, cfg.sample.temperature, cfg.sample.top_k,
                        cfg.train.seed);
    result.sample = decode_bytes(std::vector<int64_t>(out.begin() + 1, out.end()), st.eot_token);
    log::info("sample:\n" + result.sample);
  }
  if (hooks.keep_params)
    for (auto& [name, p] : model->named_params()) {
      torch::Tensor c = p.detach().to(torch::kCPU, torch::kFloat32).contiguous();
      result.params.emplace_back(name, std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel()));
    }
  return result;
}

}  // namespace mpitrain
