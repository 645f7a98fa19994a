// `mpitrain plan` (see plan.h).
#include "mpitrain/plan.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "mpitrain/amp.h"
#include "mpitrain/comm.h"
#include "mpitrain/device.h"
#include "mpitrain/error.h"
#include "mpitrain/grad_sync.h"
#include "mpitrain/log.h"
#include "mpitrain/memory_plan.h"
#include "mpitrain/mesh.h"
#include "mpitrain/model.h"
#include "mpitrain/mpi_env.h"
#include "mpitrain/optim.h"
#include "mpitrain/pipeline.h"
#include "mpitrain/powersgd.h"
#include "mpitrain/startup.h"
#include "mpitrain/tensor_parallel.h"

namespace mpitrain {
namespace {

// The median over `iters` runs (after 2 warm-ups) of the slowest rank's time of fn.
template <class Fn>
double timed(MpiComm comm, int64_t iters, const torch::Device& device, Fn&& fn) {
  std::vector<double> t;
  for (int64_t i = 0; i < iters + 2; ++i) {
    mpi::barrier(comm);
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double slowest = mpi::all_reduced(s, ReduceOp::max, comm);
    if (i >= 2) t.push_back(slowest);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct CommTimes {
  double fp32 = 0, bf16 = 0;          // the whole all-reduce, seconds
  double last_fp32 = 0, last_bf16 = 0;  // the part the last bucket takes (by its bytes)
  double powersgd = 0;  // comm.compress: powersgd at comm.powersgd_rank: after backward, never hidden
};

// GradSync over `comm` on the model's gradients, fp32 and bf16, without overlap.
CommTimes time_all_reduce(const std::vector<torch::Tensor>& params, Communicator& comm, MpiComm mpi,
                          const Config& cfg, int64_t iters, const torch::Device& device) {
  CommTimes t;
  if (comm.size() == 1) return t;
  for (auto wire : {torch::kFloat32, torch::kBFloat16}) {
    GradSync sync(params, comm, cfg.comm.bucket_mb, /*overlap=*/false, /*shard=*/false, wire);
    const double s = timed(mpi, iters, device, [&] {
      for (const auto& p : params) p.mutable_grad() = torch::ones_like(p);  // Tensor handles: const, shared
      sync.all_reduce_grads();
    });
    int64_t last = 0, total = 0;
    for (size_t b = 0; b < sync.num_buckets(); ++b)
      for (size_t k : sync.bucket_params(b)) {
        total += params[k].numel();
        if (b + 1 == sync.num_buckets()) last += params[k].numel();
      }
    const double last_share = static_cast<double>(last) / static_cast<double>(std::max<int64_t>(1, total));
    (wire == torch::kFloat32 ? t.fp32 : t.bf16) = s;
    (wire == torch::kFloat32 ? t.last_fp32 : t.last_bf16) = s * last_share;
  }
  PowerSgd psgd(params, comm, cfg.comm.powersgd_rank, cfg.train.seed);
  t.powersgd = timed(mpi, iters, device, [&] {
    for (const auto& p : params) p.mutable_grad() = torch::ones_like(p);
    psgd.reduce_grads();  // its factor products included: they are part of what it costs
  });
  return t;
}

double exposed(double comm, double last, double backward, bool overlap) {
  return overlap ? std::max(last, comm - backward) : comm;
}

// DiLoCo with an island per host (docs/diloco.md): a step is one host's data-parallel step (fp32
// gradients within the host, overlapped as measured there), and every H steps the outer step adds
// one exchange of the model between the hosts: the measured all-reduce over all ranks for fp32 and
// bf16 (an upper bound: it also crosses the hosts' own ranks), int8 by its bytes, an all-gather of
// (islands - 1) x 1.02 bytes per value against a ring all-reduce's 2 (islands - 1) / islands x 4.
// Streaming (F fragments, overlap tau: the config's diloco.fragments and diloco.overlap when it
// streams, else 4 fragments (at most the blocks) and overlap 5): each fragment's exchange, 1/F of
// the model, has tau steps to cross while training goes on, so a step waits
// max(0, outer - F tau step) / H on average.
std::string diloco_table(const CommTimes& all, const CommTimes& local, double t_micro, double t_backward,
                         double t_optimizer, int64_t tokens_per_rank, int ranks, int per_host, int islands,
                         int64_t n_layer, const DilocoConfig& diloco) {
  const double step = t_micro + t_optimizer + exposed(local.fp32, local.last_fp32, t_backward, true);
  const double tok_1 = static_cast<double>(tokens_per_rank * per_host) / step;
  const int64_t F = diloco.fragments > 1 ? diloco.fragments : std::min<int64_t>(4, n_layer);
  const int64_t tau = diloco.fragments > 1 ? diloco.overlap : 5;
  std::string out = concat("DiLoCo, parallel.islands: host (", islands, " islands; micro-batch as above, grad_accum 1, ",
                           "fp32 within each host; streaming: diloco.fragments ", F, ", diloco.overlap ", tau, "):\n",
                           "| diloco.inner_steps | diloco.dtype | outer step ms | step ms | outer share | tokens/s | vs one host "
                           "| streaming step ms | streaming vs one host |\n",
                           "|---:|---|---:|---:|---:|---:|---:|---:|---:|\n");
  char line[256];
  for (int64_t h : {10, 50, 100, 500})
    for (const char* wire : {"fp32", "bf16", "int8"}) {
      const std::string w = wire;
      const double outer = w == "bf16" ? all.bf16 : w == "int8" ? all.fp32 * 1.02 * islands / 8.0 : all.fp32;
      const double per_step = step + outer / static_cast<double>(h);
      const double tok_s = static_cast<double>(tokens_per_rank * ranks) / per_step;
      const int64_t t = std::min<int64_t>(tau, h - 1), f = std::min<int64_t>(F, h);
      const double streaming = step + std::max(0.0, outer - static_cast<double>(f * t) * step) / static_cast<double>(h);
      const double tok_streaming = static_cast<double>(tokens_per_rank * ranks) / streaming;
      std::snprintf(line, sizeof line, "| %lld | %s | %.1f | %.1f | %.1f%% | %.0f | %.2fx | %.1f | %.2fx |\n",
                    static_cast<long long>(h), wire, outer * 1e3, per_step * 1e3,
                    100 * outer / static_cast<double>(h) / per_step, tok_s, tok_s / tok_1, streaming * 1e3,
                    tok_streaming / tok_1);
      out += line;
    }
  return out;
}

// Bytes this process holds now: on a GPU what libtorch's caching allocator has handed out; on
// the CPU what malloc has (glibc's mallinfo2 over all arenas: in-use chunks and mmapped blocks;
// libtorch's CPU tensors come from malloc). -1 where neither can be asked.
double held_bytes(const torch::Device& device) {
  if (device.is_cuda()) return static_cast<double>(cuda_allocated_bytes(device.index()));
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 m = mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd);
#else
  return -1;
#endif
}

// A model of `d`, sharded over `tp`, run as `options`, on `device`, in training mode: what plan
// measures.
GPT probe_model(const GPTDims& d, const TpPlace& tp, const RunOptions& options, const torch::Device& device) {
  GPT model(d);
  model->parallelize(tp);
  model->apply(options);
  model->to(device);
  model->train();
  return model;
}

// One micro-batch of random tokens through `model` (its loss under `precision`'s autocast), every
// rank of `comm` at once: the forward's seconds and the forward + backward's (timed()).
std::pair<double, double> time_micro_batch(GPT& model, Precision precision, const torch::Device& device, int64_t micro,
                                           int64_t iters, MpiComm comm) {
  const GPTDims& d = model->dims();
  torch::Tensor x = torch::randint(d.classes(), {micro, d.seq_len}, torch::kInt32).to(device);
  torch::Tensor y = torch::randint(d.classes(), {micro, d.seq_len}, torch::kInt64).to(device);
  torch::Tensor loss;
  const auto forward = [&] {
    Autocast autocast(precision, device);
    loss = model->loss(x, y);
  };
  const double f = timed(comm, iters, device, forward);
  const double fb = timed(comm, iters, device, [&] {
    forward();
    loss.backward();
    for (auto& [name, p] : model->named_params()) p.mutable_grad() = torch::Tensor();
  });
  return {f, fb};
}

// What one micro-batch's forward keeps for backward (the loss's graph), measured on `device`
// with models of one and two blocks of these dimensions, without checkpointing and with selective
// and full checkpointing: per block, per checkpointed block of each kind and outside the blocks. Scaling by n_layer needs no model of
// the real depth, so it also plans a model this device cannot hold whole. false where the
// device's bytes cannot be read.
bool activation_probe(const GPTDims& dims, const TpPlace& tp, const RunOptions& options, Precision precision, const torch::Device& device, int64_t micro,
                      MemoryInputs& out) {
  if (held_bytes(device) < 0) return false;
  auto kept = [&](int64_t layers, RunOptions::Ac ac) {
    GPTDims d = dims;
    d.n_layer = layers;
    RunOptions o = options;
    o.ac = ac;
    o.ac_every = 1;
    GPT model = probe_model(d, tp, o, device);
    torch::Tensor x = torch::randint(d.classes(), {micro, d.seq_len}, torch::kInt32).to(device);
    torch::Tensor y = torch::randint(d.classes(), {micro, d.seq_len}, torch::kInt64).to(device);
    const double before = held_bytes(device);
    torch::Tensor loss;
    {
      Autocast autocast(precision, device);
      loss = model->loss(x, y);
    }
    const double after = held_bytes(device);
    loss = torch::Tensor();  // the graph and everything it kept go
    return after - before;
  };
  kept(1, RunOptions::Ac::full);  // once unmeasured: what the first checkpointed run sets up lazily stays
  const double none1 = kept(1, RunOptions::Ac::none), none2 = kept(2, RunOptions::Ac::none);
  out.block_none = std::max(0.0, none2 - none1);
  const double selective1 = kept(1, RunOptions::Ac::selective), selective2 = kept(2, RunOptions::Ac::selective);
  const double full1 = kept(1, RunOptions::Ac::full), full2 = kept(2, RunOptions::Ac::full);
  out.block_selective = std::max(0.0, selective2 - selective1);
  out.block_full = std::max(0.0, full2 - full1);
  out.outside = std::max(0.0, none1 - out.block_none);
  return true;
}

// Median of `iters` local runs of fn (after one warm-up), seconds: each rank its own stage's.
template <class Fn>
double timed_here(int64_t iters, const torch::Device& device, Fn&& fn) {
  std::vector<double> t;
  for (int64_t i = 0; i < iters + 1; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
    if (i >= 1) t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// parallel.pp: every rank builds its stage and measures, all at once as training runs them, each
// chunk's forward and backward of one micro-batch (inside a few steps of the schedule), the
// activations a forward keeps, and the time an activation takes to the next stage (a ping-pong
// over the pipeline's link); rank 0 simulates
// the schedule from the first pipeline's figures (simulate_pipeline) and prints each stage's
// memory, times and predicted idle share (the bubble, transfers included) beside the schedule's.
void plan_pipeline(const Config& cfg, Startup& run, const PlanOptions& options, MpiComm mpi_comm) {
  const GPTDims& d = run.dims;
  const torch::Device device = run.device;
  const int64_t micro = cfg.train.micro_batch, T = d.seq_len, m = cfg.train.grad_accum, v = d.pp_virtual, pp = d.pp;
  torch::manual_seed(cfg.train.seed);
  GPT model = probe_model(d, run.tp, run.options, device);
  int64_t params = 0;
  for (const auto& [name, p] : model->named_params()) params += p.numel();
  const torch::Tensor tokens = torch::randint(d.classes(), {micro, T}, torch::kInt64).to(device);
  const torch::Tensor hidden = torch::randn({micro, T, d.n_embd}, torch::TensorOptions().device(device));
  // Per chunk: forward, backward, and the bytes its forward keeps; then the link's time, the parameters.
  std::vector<double> mine(static_cast<size_t>(3 * v + 2), 0.0);
  const auto zero_grads = [&] {
    for (auto& [name, p] : model->named_params()) p.mutable_grad() = torch::Tensor();
  };
  for (int64_t c = 0; c < v; ++c) {  // the bytes, one chunk alone
    torch::Tensor in = d.first_stage() && c == 0 ? tokens : hidden.detach().requires_grad_(true), out;
    const double before = held_bytes(device);
    {
      Autocast autocast(run.precision, device);
      out = model->stage_forward(in, c);
      if (d.last_stage() && c + 1 == v) out = model->stage_loss(out, tokens);
    }
    mine[static_cast<size_t>(2 * v + c)] = std::max(0.0, held_bytes(device) - before);
    out.dim() == 0 ? out.backward() : out.backward(torch::ones_like(out));
    zero_grads();
  }
  // The times inside the schedule itself: 1 + iters steps of the run's m micro-batches through the
  // stages as training runs them (run_pipeline_steps, training's own walk of the schedule), each
  // forward's and backward's compute timed without the waits for its input (which the
  // simulation below predicts) and without its send. A chunk timed alone ran 2-3% faster than
  // inside training (bench/RESULTS-pp.md), which moved interleaved's small idle shares by as much
  // as they are.
  {
    const int64_t P = d.virtual_stages();
    const std::vector<int64_t> shape{micro, T, d.n_embd};
    const std::vector<PipeStep> steps = pipeline_schedule(cfg.parallel.pp_schedule, pp, d.pp_stage, m, v);
    std::vector<double> spent(static_cast<size_t>(2 * v), 0.0);
    std::vector<torch::Tensor> inputs(static_cast<size_t>(m * v)), outputs(inputs.size());
    bool warm = false;  // (the first step warms up)
    const auto count = [&](const PipeStep& s, std::chrono::steady_clock::time_point t0) {
      if (device.is_cuda()) torch::cuda::synchronize(device.index());
      if (warm) spent[static_cast<size_t>((s.forward ? 0 : v) + s.chunk)] +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    const auto forward = [&](const PipeStep& s, const torch::Tensor& got) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto at = static_cast<size_t>(s.chunk * m + s.micro);
      const int64_t vs = s.chunk * pp + d.pp_stage;
      inputs[at] = vs == 0 ? tokens : got.view(shape).requires_grad_(true);
      {
        Autocast autocast(run.precision, device);
        outputs[at] = model->stage_forward(inputs[at], s.chunk);
        if (vs + 1 == P) outputs[at] = model->stage_loss(outputs[at], tokens);
      }
      count(s, t0);
      return outputs[at];
    };
    const auto backward = [&](const PipeStep& s, const torch::Tensor& got) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto at = static_cast<size_t>(s.chunk * m + s.micro);
      const int64_t vs = s.chunk * pp + d.pp_stage;
      vs + 1 == P ? outputs[at].backward() : outputs[at].backward(got.view(shape).to(outputs[at].scalar_type()));
      const torch::Tensor back = vs > 0 ? inputs[at].grad() : torch::Tensor();
      inputs[at] = outputs[at] = torch::Tensor();
      count(s, t0);
      return back;
    };
    PipeChannels channels(run.mesh->pp_mpi(), v > 1, cfg.comm.backend, device);
    for (int64_t it = 0; it <= options.iters; ++it) {
      run_pipeline_steps(channels, steps, pp, d.pp_stage, v, micro * T * d.n_embd, forward, backward);
      zero_grads();
      warm = true;
    }
    for (size_t k = 0; k < spent.size(); ++k) mine[k] = spent[k] / static_cast<double>(options.iters * m);
  }
  // The link to the next stage (s + 1 mod pp): boundary b's two ends ping-pong one activation.
  {
    PipeLink link(run.mesh->pp_mpi());
    const int64_t s = d.pp_stage;
    for (int64_t b = 0; b < pp; ++b) {
      const int64_t to = (b + 1) % pp;
      if (s != b && s != to) continue;
      const double t = timed_here(options.iters, device, [&] {
        if (s == b) {
          link.send(hidden, to, 0);
          link.recv(hidden.sizes(), to, 1, device);
        } else {
          link.recv(hidden.sizes(), b, 0, device);
          link.send(hidden, b, 1);
        }
        link.finish();
      });
      if (s == b) mine[static_cast<size_t>(3 * v)] = t / 2;
    }
  }
  mine[static_cast<size_t>(3 * v + 1)] = static_cast<double>(params);
  std::vector<double> all(mine.size() * static_cast<size_t>(run.topo.size));
  mpi::gather(mine.data(), all.data(), mine.size() * sizeof(double), 0, mpi_comm);
  if (run.topo.rank != 0) return;

  const MeshLayout& l = run.layout;
  const auto P = static_cast<size_t>(pp);
  std::vector<std::vector<double>> fwd(P), bwd(P), kept(P);
  std::vector<double> latency(P), stage_params(P);
  for (size_t u = 0; u < P; ++u) {  // the first pipeline: stage u's first rank
    const double* r = &all[u * static_cast<size_t>(l.stage_size()) * mine.size()];
    fwd[u].assign(r, r + v), bwd[u].assign(r + v, r + 2 * v), kept[u].assign(r + 2 * v, r + 3 * v);
    latency[u] = r[3 * v], stage_params[u] = r[3 * v + 1];
  }
  const PipelineTimes t = simulate_pipeline(cfg.parallel.pp_schedule, m, fwd, bwd, latency);
  const double mib = 1024.0 * 1024.0;
  const auto tenths = [](double x) { return static_cast<double>(std::lround(x * 10)) / 10; };
  const int64_t dp = l.dp, zero = dp > 1 ? cfg.optim.zero : 0, moment = cfg.optim.state_dtype == "bf16" ? 2 : 4;
  std::string out = concat("plan: pipeline parallel: ", pp, " stages x dp ", dp, "; ", cfg.parallel.pp_schedule,
                           v > 1 ? concat(" (", v, " chunks per stage)") : std::string(), " over ", m, " micro-batches of ",
                           micro, " x ", T, " tokens; ", precision_name(run.precision),
                           "; every rank measured its stage at once, as training runs them\n");
  out += "| stage | blocks | parameters | weights + gradients + AdamW MiB | activations held, peak MiB "
         "| forward ms | backward ms | to the next stage ms | idle, predicted |\n"
         "|---:|---|---:|---:|---:|---:|---:|---:|---:|\n";
  double step = 0;
  for (int64_t s = 0; s < pp; ++s) {
    const auto u = static_cast<size_t>(s);
    GPTDims at = d;
    at.pp_stage = s;
    std::string blocks;
    for (int64_t c = 0; c < v; ++c) blocks += concat(c ? " + " : "", at.chunk_begin(c), "-", at.chunk_end(c) - 1);
    // The state: fp32 weights (ZeRO-3: a 1/dp shard; the units gathered around their use come on
    // top), gradients (ZeRO-2/3: a 1/dp slice) and two moments (ZeRO-1/2/3: 1/dp).
    const double n = stage_params[u];
    const double state = n * 4 / (zero >= 3 ? static_cast<double>(dp) : 1.0) + n * 4 / (zero >= 2 ? static_cast<double>(dp) : 1.0) +
                         n * 2.0 * static_cast<double>(moment) / (zero >= 1 ? static_cast<double>(dp) : 1.0);
    // The activations the schedule keeps at once: each forward's until its backward.
    double held = 0, peak = 0;
    for (const PipeStep& p : pipeline_schedule(cfg.parallel.pp_schedule, pp, s, m, v)) {
      held += (p.forward ? 1 : -1) * kept[u][static_cast<size_t>(p.chunk)];
      peak = std::max(peak, held);
    }
    double f = 0, b = 0;
    for (size_t c = 0; c < static_cast<size_t>(v); ++c) f += fwd[u][c], b += bwd[u][c];
    out += concat("| ", s, " | ", blocks, " | ", static_cast<int64_t>(n), " | ", tenths(state / mib), " | ", tenths(peak / mib),
                  " | ", tenths(f * 1e3), " | ", tenths(b * 1e3), " | ", static_cast<double>(std::lround(latency[u] * 1e5)) / 100,
                  " | ", tenths(100 * (1 - t.busy[u] / t.end[u])), "% |\n");
    step = std::max(step, t.end[u]);
  }
  const double p2p = 2.0 * static_cast<double>(m * v * micro * T * d.n_embd * 4);
  const double act_kib = static_cast<double>(micro * T * d.n_embd * 4) / 1024;
  out += concat("bubble: the schedule's (pp - 1) / ", v > 1 ? "(v m)" : "m", " = ", tenths(100 * pipeline_bubble(pp, m, v)),
                "% of the ideal step, ",
                tenths(100.0 * static_cast<double>(pp - 1) / static_cast<double>(v * m + pp - 1)),
                "% of the micro-batches' time; the predicted idle above is the schedule simulated from the measured "
                "times, transfers included (training measures it: 'pipeline: waiting for the neighbouring stages')\n");
  out += concat("point-to-point: ", act_kib, " KiB per activation (fp32 [", micro, ", ", T, ", ", d.n_embd,
                "]) each way per stage boundary and micro-batch", v > 1 ? concat(" x ", v, " chunks") : std::string(), ": ",
                static_cast<double>(std::lround(p2p / mib * 100)) / 100, " MiB per boundary per step, forward and back\n");
  out += concat("predicted: the micro-batches take ", tenths(step * 1e3), " ms per step (the optimizer and dp's all-reduce ",
                "besides) -> at most ", std::lround(static_cast<double>(m * micro * T * l.replicas()) / step), " tokens/s\n");
  std::printf("%s", out.c_str());
  std::fflush(stdout);
}

// The data-parallel plan of a run over several hosts weighs pipeline parallelism across them: one
// stage per host (parallel.pp = the hosts, each host's ranks its stage's replicas), only the
// activations at a stage boundary crossing the link instead of every gradient. Rank 0 and the
// first rank of the second host ping-pong one activation ([micro, T, n_embd] fp32) over the link;
// then every rank at once (as the stages run) times a model of one block and one of a stage's
// blocks (ceil(n_layer / hosts)), which split a stage's micro-batch into what a block takes and
// what the rest (embedding, final norm, head and loss) takes. (A model of a stage's blocks runs
// faster per block than the whole model where the two differ in what the caches hold.)
struct HostLink {
  double seconds = -1;                   // one activation one way over the link between hosts (rank 0)
  double block_f = 0, block_b = 0;       // one block's forward, backward, per micro-batch
  double outside_f = 0, outside_b = 0;   // the rest of the model's
};

HostLink measure_host_link(const Topology& topo, const GPTDims& dims, const TpPlace& tp, const RunOptions& options, Precision precision,
                           const torch::Device& device, int64_t micro, int64_t iters, double t_forward, double t_backward,
                           MpiComm comm) {
  HostLink out;
  const auto hosts = static_cast<int64_t>(topo.hosts.size());
  if (hosts < 2 || dims.n_layer < 2) return out;
  const auto peer = static_cast<int>(std::find(topo.host_of_rank.begin(), topo.host_of_rank.end(), 1) - topo.host_of_rank.begin());
  const torch::Tensor act = torch::randn({micro, dims.seq_len, dims.n_embd});
  if (topo.rank == 0 || topo.rank == peer) {
    PipeLink link(comm);
    const double t = timed_here(iters, torch::Device(torch::kCPU), [&] {
      if (topo.rank == 0) {
        link.send(act, peer, 0);
        link.recv(act.sizes(), peer, 1, torch::Device(torch::kCPU));
      } else {
        link.recv(act.sizes(), 0, 0, torch::Device(torch::kCPU));
        link.send(act, 0, 1);
      }
      link.finish();
    });
    if (topo.rank == 0) out.seconds = t / 2;
  }
  // Forward, and backward, of a model of `layers` blocks: every rank at once.
  const auto time_model = [&](int64_t layers) {
    GPTDims d = dims;
    d.n_layer = layers;
    GPT m = probe_model(d, tp, options, device);
    const auto [f, fb] = time_micro_batch(m, precision, device, micro, iters, comm);
    return std::pair<double, double>{f, std::max(0.0, fb - f)};
  };
  const int64_t k = (dims.n_layer + hosts - 1) / hosts;  // a stage's blocks (the largest stage's)
  const auto [f1, b1] = time_model(1);
  // (k = 1: the whole model measured before gives the block's share instead)
  const auto [fk, bk] = k > 1 ? time_model(k) : std::pair<double, double>{t_forward, t_backward};
  const auto span = static_cast<double>(k > 1 ? k - 1 : dims.n_layer - 1);
  out.block_f = std::max(0.0, (fk - f1) / span);
  out.block_b = std::max(0.0, (bk - b1) / span);
  out.outside_f = std::max(0.0, f1 - out.block_f);
  out.outside_b = std::max(0.0, b1 - out.block_b);
  return out;
}

// Per data-parallel accumulation: pp = hosts over accum x hosts micro-batches (1f1b), the same
// global batch as the data-parallel row. A stage's time: its blocks' share of the measured
// micro-batch, the last stage also the rest of the model (the embedding's lookup is left out);
// each boundary's transfer the measured one times the host's ranks (their pipelines share the
// link); after the micro-batches the stage's AdamW (1/hosts of the measured) and its gradients'
// all-reduce among the host's ranks (1/hosts of the measured host all-reduce, not overlapped).
struct HostPipelineRow {
  int64_t accum = 0, micro_batches = 0;
  double step = 0, idle = 0, tok_s = 0, vs_one_host = 0;
};

std::vector<HostPipelineRow> host_pipeline_rows(const HostLink& link, const GPTDims& dims, int64_t micro, int hosts,
                                                int per_host, double t_micro, double t_optimizer, double host_all_reduce) {
  std::vector<HostPipelineRow> rows;
  const auto H = static_cast<size_t>(hosts);
  std::vector<std::vector<double>> fwd(H), bwd(H);
  GPTDims g = dims;
  g.pp = hosts;
  for (size_t s = 0; s < H; ++s) {
    g.pp_stage = static_cast<int64_t>(s);
    const auto blocks = static_cast<double>(g.chunk_end(0) - g.chunk_begin(0));
    const bool last = s + 1 == H;
    fwd[s] = {blocks * link.block_f + (last ? link.outside_f : 0)};
    bwd[s] = {blocks * link.block_b + (last ? link.outside_b : 0)};
  }
  const std::vector<double> latency(H, link.seconds * per_host);
  const double tokens = static_cast<double>(micro * dims.seq_len * per_host);
  for (int64_t accum : {1, 2, 4, 8, 16}) {
    const int64_t m = accum * hosts;
    const PipelineTimes t = simulate_pipeline("1f1b", m, fwd, bwd, latency);
    double end = 0, idle = 0;
    for (size_t s = 0; s < H; ++s) end = std::max(end, t.end[s]), idle = std::max(idle, 1 - t.busy[s] / t.end[s]);
    const double after = (t_optimizer + (per_host > 1 ? host_all_reduce : 0)) / hosts;
    const double step = end + after;
    const double one_host = static_cast<double>(m) * t_micro + t_optimizer + (per_host > 1 ? host_all_reduce : 0);
    rows.push_back({accum, m, step, idle, static_cast<double>(m) * tokens / step, one_host / step});
  }
  return rows;
}

}  // namespace

void run_plan(Config cfg, MpiComm mpi_comm, const PlanOptions& options) {
  Startup run = start_up(cfg, mpi_comm, /*force_unlock=*/false, /*plan_only=*/true);
  const Topology& topo = run.topo;
  if (run.layout.pp > 1) {
    plan_pipeline(cfg, run, options, mpi_comm);
    return;
  }
  // Under parallel.tp every rank holds its tp shards (N below is rank 0's), and the activation
  // probe's models are tensor-parallel too: their forward is collective over each tp group, so
  // every rank measures (rank 0's figures are printed). The timing model is data parallelism's.
  const bool tensor_parallel = run.layout.tp > 1;
  // Expert parallelism likewise: each rank holds its ep group's share of the experts (N below is
  // rank 0's), the probes' forward exchanges tokens over the ep group, and no timing model.
  const bool expert_parallel = run.layout.ep > 1, spread = tensor_parallel || expert_parallel;
  const torch::Device device = run.device;
  const GPTDims& dims = run.dims;
  const int64_t micro = cfg.train.micro_batch, T = dims.seq_len;
  torch::manual_seed(cfg.train.seed);
  GPT model = probe_model(dims, run.tp, run.options, device);
  std::vector<torch::Tensor> params;
  for (auto& [name, p] : model->named_params()) params.push_back(p);

  // ---- memory: the model state counted, the activations measured (rank 0's device) ----
  int64_t n_params = 0, n_whole_params = 0;  // this rank's (under tp: its shards), the whole model's
  for (const auto& p : params) n_params += p.numel();
  for (const auto& [name, p] : model->named_params()) {
    int64_t whole = 1;
    for (int64_t e : tp_whole_shape(p.sizes(), model->tp_split(name), run.tp.size)) whole *= e;
    n_whole_params += whole;
  }
  n_whole_params += model->remote_expert_params() * run.tp.size;  // (every expert parameter is split over tp)
  auto memory_table = [&] {
    MemoryInputs mem;
    mem.params = n_params;
    if (expert_parallel)  // each rank's experts: whole on each of their replicas, whatever optim.zero
      for (const auto& [name, p] : model->named_params())
        if (expert_of(name) >= 0) mem.whole_params += p.numel();
    {
      std::map<std::string, int64_t> blocks;  // zero 3's units (zero3.h): each block, and the rest
      for (const auto& [name, p] : model->named_params()) {
        if (expert_parallel && expert_of(name) >= 0) continue;  // (whole_params: in no unit)
        if (name.rfind("h.", 0) == 0) blocks[name.substr(0, name.find('.', 2))] += p.numel();
        else mem.outside_params += p.numel();
      }
      for (const auto& [block, n] : blocks) mem.largest_block = std::max(mem.largest_block, n);
    }
    mem.n_layer = dims.n_layer;
    mem.dp = run.layout.dp;
    mem.bucket_mb = cfg.comm.bucket_mb;
    mem.ac_every = cfg.train.ac_every;
    mem.moment_bytes = cfg.optim.state_dtype == "bf16" ? 2 : 4;
    const bool measured = activation_probe(dims, run.tp, run.options, run.precision, device, micro, mem);
    double memory_gib = options.memory_gib;
    std::string memory_source = "--memory";
    if (memory_gib <= 0 && device.is_cuda()) {
      memory_gib = static_cast<double>(cuda_total_memory_bytes(device.index())) / (1024.0 * 1024 * 1024);
      memory_source = concat(cuda_device_name(device.index()), "'s memory");
    }
    return measured ? memory_report(mem, memory_gib, memory_source)
                    : std::string("memory: this device's allocated bytes cannot be read: no activation measurement");
  };
  if (options.memory_only || spread) {  // no timing: the model's memory per rank alone
    const std::string table = topo.rank == 0 || spread ? memory_table() : std::string();
    if (topo.rank == 0) {
      const int64_t sparse = dims.sparse_layers(), copies = dims.routed_copies(micro * T);
      const double exchange = expert_exchange_bytes(sparse, copies, dims.n_embd, 4, run.precision == Precision::fp32 ? 4 : 2,
                                                    run.layout.ep, cfg.train.grad_accum);
      const std::string layout = concat(tensor_parallel ? concat(" x tp ", run.layout.tp) : std::string(),
                                        expert_parallel ? concat(" (ep ", run.layout.ep, ")") : std::string());
      std::printf("plan: model %lld parameters%s; micro-batch %lld x %lld tokens; %s; dp %lld%s\n%s%s%s\n",
                  static_cast<long long>(n_params),
                  tensor_parallel ? concat(" per rank (its tp shards of ", n_whole_params, ")").c_str()
                  : expert_parallel ? concat(" per rank (its ep group's share of the experts; ", n_whole_params, " in all)").c_str()
                                    : "",
                  static_cast<long long>(micro), static_cast<long long>(T), precision_name(run.precision),
                  static_cast<long long>(run.layout.dp), layout.c_str(),
                  spread && !options.memory_only
                      ? concat("plan: the step-time model covers data parallelism only (",
                               tensor_parallel ? concat("parallel.tp: ", run.layout.tp) : concat("parallel.ep: ", run.layout.ep),
                               "): no timing table; the memory per rank of this layout follows\n").c_str()
                      : "",
                  expert_parallel
                      ? concat("plan: expert all-to-all: ", exchange / (1 << 20), " MiB sent per rank per step (",
                               sparse, " sparse layers x ", cfg.train.grad_accum, " micro-batches x ", copies,
                               " token copies of ", dims.n_embd, " values, to the experts in fp32 and back in ",
                               precision_name(run.precision), ", and their gradients; ", run.layout.ep - 1, "/", run.layout.ep,
                               " of them leave the rank when the routing is balanced); ",
                               tensor_parallel ? "with parallel.tp the table's optim.zero 3 rows do not run"
                                               : "optim.zero 1-3 shard the shared parameters only (each rank's experts "
                                                 "whole)",
                               "\n").c_str()
                      : "",
                  table.c_str());
      std::fflush(stdout);
    }
    return;
  }

  // ---- compute: one micro-batch forward and backward on every rank at once ----
  const auto [t_forward, t_micro] = time_micro_batch(model, run.precision, device, micro, options.iters, mpi_comm);
  const double t_backward = std::max(0.0, t_micro - t_forward);
  // The optimizer step (gradient clipping and AdamW), once per step whatever the accumulation.
  AdamW opt(model->named_params(), cfg.optim,
            cfg.optim.fused != "off" && cfg.optim.state_dtype == "fp32" && fused_adamw_available(device.type()));
  for (auto& p : params) p.mutable_grad() = torch::ones_like(p);
  const double t_optimizer = timed(mpi_comm, options.iters, device, [&] {  // as a step: clip, then update
    clip_grad_norm_(params, cfg.optim.grad_clip);
    opt.step(cfg.optim.lr);
  });

  // ---- communication: over all ranks, and within one host ----
  // (over every replica: with parallel.islands the dp group is one island's)
  const CommTimes all = time_all_reduce(params, run.mesh->replicas_comm(), mpi_comm, cfg, options.iters, device);
  MpiComm host_mpi = mpi::split_host(mpi_comm, topo.rank);
  CommTimes local;
  {
    auto host_comm = make_communicator(cfg.comm.backend, host_mpi, device);
    local = time_all_reduce(params, *host_comm, host_mpi, cfg, options.iters, device);
  }
  // The single-host baseline runs on every host at once; its figures are the slowest host's.
  for (double* v : {&local.fp32, &local.bf16, &local.last_fp32, &local.last_bf16, &local.powersgd})
    mpi::all_reduce(v, 1, ReduceOp::max, mpi_comm);
  mpi::free(host_mpi);
  // Pipeline parallelism across the hosts, one stage per host (the same number of ranks on each).
  const int hosts = static_cast<int>(topo.hosts.size());
  const bool host_pipeline = hosts > 1 && topo.size % hosts == 0 && topo.local_size == topo.size / hosts &&
                             dims.n_layer >= hosts && !dims.has_experts();
  const HostLink link = host_pipeline ? measure_host_link(topo, dims, run.tp, run.options, run.precision, device, micro, options.iters,
                                                          t_forward, t_backward, mpi_comm)
                                      : HostLink{};
  if (topo.rank != 0) return;
  const std::string memory = memory_table();

  // ---- prediction ----
  const double bytes = 4.0 * static_cast<double>(n_params);
  const int n = topo.size, per_host = topo.local_size;
  auto busbw = [&](double b, double s) { return s > 0 ? 2.0 * (n - 1) / n * b / s / 1e9 : 0.0; };
  std::string out = concat(
      "plan: ", n, n == 1 ? " rank" : " ranks", " on ", topo.hosts.size(), topo.hosts.size() == 1 ? " host (" : " hosts (", per_host, " on rank 0's host); model ", n_params,
      " parameters; micro-batch ", micro, " x ", T, " tokens; ", precision_name(run.precision), "\n",
      "measured: forward ", t_forward * 1e3, " ms, forward+backward ", t_micro * 1e3, " ms per micro-batch, clip + AdamW ",
      t_optimizer * 1e3, " ms per step; ",
      "gradient all-reduce of ", bytes / (1 << 20), " MiB over all ranks: fp32 ", all.fp32 * 1e3, " ms (busbw ",
      busbw(bytes, all.fp32), " GB/s), bf16 ", all.bf16 * 1e3, " ms (busbw ", busbw(bytes / 2, all.bf16),
      " GB/s), PowerSGD rank ", cfg.comm.powersgd_rank, " ", all.powersgd * 1e3, " ms; within one host: fp32 ",
      local.fp32 * 1e3, " ms, bf16 ", local.bf16 * 1e3, " ms, PowerSGD ", local.powersgd * 1e3, " ms\n");
  const std::string psgd_name = concat("powersgd r", cfg.comm.powersgd_rank);
  struct Row {
    int64_t accum;
    std::string dtype;  // fp32 | bf16 | powersgd rN
    bool overlap;
    double step, exposed, tok_s, speedup;
  };
  std::vector<Row> rows;  // per accum and dtype: overlap on, then off (PowerSGD: the same, it never overlaps)
  for (int64_t accum : {1, 2, 4, 8, 16})
    for (const std::string& dtype : {std::string("fp32"), std::string("bf16"), psgd_name})
      for (bool overlap : {true, false}) {
        const bool half = dtype == "bf16", psgd = dtype == psgd_name;
        const double e = psgd ? all.powersgd
                              : exposed(half ? all.bf16 : all.fp32, half ? all.last_bf16 : all.last_fp32, t_backward, overlap);
        const double e1 = psgd ? local.powersgd
                               : exposed(half ? local.bf16 : local.fp32, half ? local.last_bf16 : local.last_fp32,
                                         t_backward, overlap);
        const double step = static_cast<double>(accum) * t_micro + t_optimizer + e;
        const double tok_s = static_cast<double>(accum * micro * T * n) / step;
        const double tok_s_1 = static_cast<double>(accum * micro * T * per_host) / (static_cast<double>(accum) * t_micro + t_optimizer + e1);
        rows.push_back({accum, dtype, overlap, step, e, tok_s, tok_s / tok_s_1});
      }
  char line[320];
  out += "| grad_accum | gradients on the wire | step ms | exposed comm ms | comm share | tokens/s | vs one host "
         "| without overlap: step ms | comm share | vs one host |\n"
         "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (size_t i = 0; i + 1 < rows.size(); i += 2) {
    const Row &r = rows[i], &o = rows[i + 1];
    auto vs = [&](double x) {
      char b[32];
      std::snprintf(b, sizeof b, "%.2fx", x);
      return topo.hosts.size() > 1 ? std::string(b) : std::string("-");
    };
    std::snprintf(line, sizeof line, "| %lld | %s | %.1f | %.1f | %.0f%% | %.0f | %s | %.1f | %.0f%% | %s |\n",
                  static_cast<long long>(r.accum), r.dtype.c_str(), r.step * 1e3, r.exposed * 1e3, 100 * r.exposed / r.step,
                  r.tok_s, vs(r.speedup).c_str(), o.step * 1e3, 100 * o.exposed / o.step, vs(o.speedup).c_str());
    out += line;
  }
  // The recommendation: the fewest accumulation steps within 3% of the best throughput (a larger
  // global batch changes the optimisation, not just the speed), overlap where it ties, and the
  // least lossy gradients where they tie: fp32, then bf16, then PowerSGD (rows are in that order).
  const double best = std::max_element(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.tok_s < b.tok_s; })->tok_s;
  const Row* pick = nullptr;
  for (const Row& r : rows)
    if (r.tok_s >= 0.97 * best && r.overlap && (!pick || r.accum < pick->accum)) pick = &r;
  if (!pick) pick = &rows.front();
  for (const Row& r : rows)  // fp32 when it ties at the same accumulation
    if (r.accum == pick->accum && r.overlap && r.dtype == "fp32" && r.tok_s >= 0.97 * best) pick = &r;
  const std::string setting = pick->dtype == psgd_name
                                  ? concat("comm.compress: powersgd (comm.powersgd_rank: ", cfg.comm.powersgd_rank, ")")
                                  : concat("comm.grad_dtype: ", pick->dtype, ", comm.overlap: true");
  std::snprintf(line, sizeof line,
                "recommendation: train.grad_accum: %lld, %s -> predicted %.0f tokens/s, "
                "communication %.0f%% of the step%s",
                static_cast<long long>(pick->accum), setting.c_str(), pick->tok_s, 100 * pick->exposed / pick->step,
                topo.hosts.size() > 1 ? concat(", ", static_cast<int>(pick->speedup * 100 + 0.5) / 100.0, "x one host").c_str()
                                      : " (one host: nothing to compare)");
  out += line;
  if (link.seconds >= 0) {  // pipeline parallelism across the hosts, at each row's global batch
    const std::vector<HostPipelineRow> pp_rows =
        host_pipeline_rows(link, dims, micro, hosts, per_host, t_micro, t_optimizer, local.fp32);
    GPTDims g = dims;
    g.pp = hosts;
    std::vector<double> stage_params(static_cast<size_t>(hosts), 0.0);
    for (const auto& [name, p] : model->named_params()) {
      stage_params[static_cast<size_t>(stage_of(name, g))] += static_cast<double>(p.numel());
      if (name == "wte.weight" && (!dims.llama() || dims.tie_embeddings))  // the last stage's copy
        stage_params.back() += static_cast<double>(p.numel());
    }
    const double largest = *std::max_element(stage_params.begin(), stage_params.end());
    const double moment = cfg.optim.state_dtype == "bf16" ? 2 : 4, per_param = 4 + 4 + 2 * moment;
    out += concat("\npipeline parallel across the hosts (parallel.pp: ", hosts, ", one stage per host, its ", per_host,
                  per_host == 1 ? " rank" : " ranks", " the stage's replicas; 1f1b): an activation (", micro * T * dims.n_embd * 4 / 1024,
                  " KiB) crosses the link in ", link.seconds * 1e3, " ms measured", per_host > 1 ? concat(" (x ", per_host, ": the host's pipelines share it)") : std::string(),
                  "; a block's micro-batch ", (link.block_f + link.block_b) * 1e3, " ms, the rest of the model's ",
                  (link.outside_f + link.outside_b) * 1e3, " ms on the last stage; weights, gradients and AdamW ",
                  largest * per_param / (1 << 20), " MiB on the largest stage against ",
                  static_cast<double>(n_params) * per_param / (1 << 20), " MiB whole\n",
                  "| grad_accum (dp) | parallel.pp micro-batches | step ms | idle, largest stage | tokens/s | vs one host | vs dp fp32 |\n",
                  "|---:|---:|---:|---:|---:|---:|---:|\n");
    const HostPipelineRow* pp_pick = nullptr;
    for (const HostPipelineRow& r : pp_rows) {
      double dp_fp32 = 0;
      for (const Row& d : rows)
        if (d.accum == r.accum && d.dtype == "fp32" && d.overlap) dp_fp32 = d.tok_s;
      std::snprintf(line, sizeof line, "| %lld | %lld | %.1f | %.1f%% | %.0f | %.2fx | %.2fx |\n", static_cast<long long>(r.accum),
                    static_cast<long long>(r.micro_batches), r.step * 1e3, 100 * r.idle, r.tok_s, r.vs_one_host,
                    dp_fp32 > 0 ? r.tok_s / dp_fp32 : 0.0);
      out += line;
      if (r.accum == pick->accum) pp_pick = &r;
    }
    // At the recommendation's global batch, pipeline parallelism wins by more than the 3% that
    // counts as a tie, or ties a lossy recommendation (bf16 or PowerSGD gradients): it is the
    // recommendation (its gradients are exact, as fp32 data parallelism's).
    const bool lossy = pick->dtype != "fp32";
    if (pp_pick && (pp_pick->tok_s > 1.03 * pick->tok_s || (lossy && pp_pick->tok_s >= 0.97 * pick->tok_s)))
      out += concat("recommendation, instead: parallel.pp: ", hosts, ", parallel.pp_schedule: 1f1b, train.grad_accum: ",
                    pp_pick->micro_batches, " (the same global batch) -> predicted ", std::lround(pp_pick->tok_s),
                    " tokens/s, ", static_cast<int>(pp_pick->tok_s / pick->tok_s * 100 + 0.5) / 100.0,
                    "x the data-parallel recommendation; the hosts' link carries activations only");
    else if (pp_pick)
      out += concat("pipeline parallelism across the hosts is not faster at this global batch (",
                    static_cast<int>(pp_pick->tok_s / pick->tok_s * 100 + 0.5) / 100.0,
                    "x the recommendation); it still divides the model's memory by ", hosts);
  }
  if (topo.hosts.size() > 1 && pick->speedup < 1.1)
    out += concat("\nwarning: the other hosts add little (", pick->speedup,
                  "x): the network is the bottleneck at these sizes; more accumulation or a faster link is needed");
  if (topo.hosts.size() > 1) out += "\n" + diloco_table(all, local, t_micro, t_backward, t_optimizer, micro * T, n, per_host,
                                                        static_cast<int>(topo.hosts.size()), dims.n_layer, cfg.diloco);
  out += "\n" + memory;
  std::printf("%s\n", out.c_str());
  std::fflush(stdout);
}

}  // namespace mpitrain
