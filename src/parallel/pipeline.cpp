// Pipeline parallelism's schedules and point-to-point links (see pipeline.h).
#include "mpitrain/pipeline.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <utility>

#include "mpitrain/error.h"
#include "mpitrain/watchdog.h"

namespace mpitrain {

namespace {
std::atomic<int64_t> pipeline_wait_ns{0};

// Runs fn, its wall time counted in pipeline_wait_ns.
template <class Fn>
void waited(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  pipeline_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

double pipeline_wait_seconds() { return static_cast<double>(pipeline_wait_ns.load()) * 1e-9; }

std::vector<PipeStep> pipeline_schedule(const std::string& schedule, int64_t stages, int64_t stage, int64_t micro_batches,
                                        int64_t chunks) {
  MPITRAIN_CHECK(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1 && chunks >= 1,
                 "pipeline_schedule: a stage of the pipeline");
  std::vector<PipeStep> steps;
  if (schedule == "interleaved") {
    MPITRAIN_CHECK(micro_batches % stages == 0, "pipeline_schedule: interleaved takes micro-batches in groups of pp");
    // The k-th forward (backward) of this rank: micro-batch group k / (pp v), chunk (k / pp) mod v
    // (backward: counted from the last chunk), micro-batch k mod pp of the group.
    const int64_t total = micro_batches * chunks;
    const auto step = [&](int64_t k, bool forward) {
      const int64_t c = (k / stages) % chunks;
      return PipeStep{forward, k / (stages * chunks) * stages + k % stages, forward ? c : chunks - 1 - c};
    };
    const int64_t warmup = micro_batches == stages ? total : std::min(total, 2 * (stages - 1 - stage) + (chunks - 1) * stages);
    int64_t forward = 0, backward = 0;
    for (; forward < warmup; ++forward) steps.push_back(step(forward, true));
    while (forward < total) {
      steps.push_back(step(forward++, true));
      steps.push_back(step(backward++, false));
    }
    while (backward < total) steps.push_back(step(backward++, false));
    return steps;
  }
  if (schedule == "gpipe") {
    for (int64_t m = 0; m < micro_batches; ++m) steps.push_back({true, m});
    for (int64_t m = 0; m < micro_batches; ++m) steps.push_back({false, m});
    return steps;
  }
  MPITRAIN_CHECK(schedule == "1f1b" && chunks == 1, concat("pipeline_schedule: no schedule '", schedule, "' of ", chunks, " chunks"));
  const int64_t warmup = std::min(stages - 1 - stage, micro_batches);
  int64_t forward = 0, backward = 0;
  for (; forward < warmup; ++forward) steps.push_back({true, forward});
  while (forward < micro_batches) {  // one forward, one backward
    steps.push_back({true, forward++});
    steps.push_back({false, backward++});
  }
  while (backward < micro_batches) steps.push_back({false, backward++});
  return steps;
}

double pipeline_bubble(int64_t stages, int64_t micro_batches, int64_t chunks) {
  return static_cast<double>(stages - 1) / static_cast<double>(std::max<int64_t>(micro_batches * chunks, 1));
}

PipelineTimes simulate_pipeline(const std::string& schedule, int64_t micro_batches,
                                const std::vector<std::vector<double>>& forward,
                                const std::vector<std::vector<double>>& backward, const std::vector<double>& latency) {
  const auto pp = static_cast<int64_t>(forward.size());
  MPITRAIN_CHECK(pp >= 1 && backward.size() == forward.size() && latency.size() == forward.size() && !forward[0].empty(),
                 "simulate_pipeline: times per stage and chunk");
  const auto v = static_cast<int64_t>(forward[0].size()), P = pp * v;
  const auto U = static_cast<size_t>(P), M = static_cast<size_t>(micro_batches);
  std::vector<std::vector<PipeStep>> steps;
  for (int64_t s = 0; s < pp; ++s) steps.push_back(pipeline_schedule(schedule, pp, s, micro_batches, v));
  // When virtual stage u's forward (backward) of micro-batch k ended; < 0: not yet.
  std::vector<std::vector<double>> f_end(U, std::vector<double>(M, -1)), b_end = f_end;
  PipelineTimes out{std::vector<double>(static_cast<size_t>(pp), 0.0), std::vector<double>(static_cast<size_t>(pp), 0.0)};
  std::vector<size_t> at(static_cast<size_t>(pp), 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (int64_t s = 0; s < pp; ++s) {
      const auto r = static_cast<size_t>(s);
      while (at[r] < steps[r].size()) {
        const PipeStep& p = steps[r][at[r]];
        const auto u = static_cast<size_t>(p.chunk * pp + s), k = static_cast<size_t>(p.micro);
        double ready = 0;  // when its input is here
        if (p.forward && u > 0) {
          if (f_end[u - 1][k] < 0) break;
          ready = f_end[u - 1][k] + latency[(r + static_cast<size_t>(pp) - 1) % static_cast<size_t>(pp)];
        } else if (!p.forward && u + 1 < U) {
          if (b_end[u + 1][k] < 0) break;
          ready = b_end[u + 1][k] + latency[r];
        }
        const double t = (p.forward ? forward : backward)[r][static_cast<size_t>(p.chunk)];
        const double end = std::max(out.end[r], ready) + t;
        (p.forward ? f_end : b_end)[u][k] = end;
        out.end[r] = end;
        out.busy[r] += t;
        ++at[r];
        moved = true;
      }
    }
  }
  for (size_t r = 0; r < at.size(); ++r) MPITRAIN_CHECK(at[r] == steps[r].size(), "simulate_pipeline: the schedule deadlocks");
  return out;
}

int64_t stage_of(const std::string& name, const GPTDims& d) {
  if (name.rfind("h.", 0) == 0) {
    const int64_t block = std::stoll(name.substr(2, name.find('.', 2) - 2));
    for (int64_t s = 0; s < d.pp; ++s) {
      GPTDims at = d;
      at.pp_stage = s;
      if (at.holds_block(block)) return s;
    }
    MPITRAIN_CHECK(false, concat("stage_of: block ", block, " of ", d.n_layer));
  }
  return name.rfind("wte.", 0) == 0 || name.rfind("wpe.", 0) == 0 ? 0 : d.pp - 1;
}

PipeLink::~PipeLink() {
  try {
    finish();
  } catch (...) {  // (a destructor: the job is ending anyway)
  }
}

void PipeLink::send(const torch::Tensor& t, int64_t to, int tag) {
  torch::Tensor host = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  const MpiRequest request = mpi::isend(host.data_ptr<float>(), static_cast<size_t>(host.numel()) * sizeof(float),
                                        static_cast<int>(to), tag, comm_);
  sending_.emplace_back(std::move(host), request);
}

torch::Tensor PipeLink::recv(c10::IntArrayRef shape, int64_t from, int tag, const torch::Device& device) {
  torch::Tensor host = torch::empty(shape, torch::kFloat32);
  {
    Watchdog::Scope watch("pipeline: receive from the neighbouring stage");
    waited([&] {
      mpi::recv(host.data_ptr<float>(), static_cast<size_t>(host.numel()) * sizeof(float), static_cast<int>(from), tag, comm_);
    });
  }
  return host.to(device);
}

void PipeLink::finish() {
  for (auto& [buffer, request] : sending_) {
    Watchdog::Scope watch("pipeline: send to the neighbouring stage");
    waited([&] { mpi::wait(request); });
  }
  sending_.clear();
}

PipeChannels::PipeChannels(MpiComm pp, bool wrap, const std::string& backend, const torch::Device& device)
    : device_(device) {
  const int n = mpi::size(pp), me = mpi::rank(pp);
  MPITRAIN_CHECK(n >= 2, "PipeChannels: a pipeline of two stages or more");
  // Every directed pair in one order on every rank, each with a tag of its own: the activations'
  // k -> k + 1, then the gradients' k + 1 -> k, for k = 0 ... n - 2 (with wrap: up to n - 1, round
  // from the last stage to the first). A rank makes its own pairs in that order, so the pair
  // first in the order of those not yet made always has both its ranks there.
  int tag = 0;
  for (const Kind kind : {activations, gradients})
    for (int k = 0; k < (wrap ? n : n - 1); ++k, ++tag) {
      const int a = k, b = (k + 1) % n;
      const int from = kind == activations ? a : b, to = kind == activations ? b : a;
      if (me != from && me != to) continue;
      const int side = me == from ? 0 : 1;
      Watchdog::Scope watch("pipeline: the channels to the neighbouring stages");
      pair_[kind][side] = mpi::create_group(pp, {from, to}, tag);
      (side == 0 ? out_ : in_)[kind] = make_communicator(backend, pair_[kind][side], device);
      host_waits_ = (side == 0 ? out_ : in_)[kind]->name() != "nccl";
    }
}

PipeChannels::~PipeChannels() {
  try {
    finish();
  } catch (...) {  // (a destructor: the job is ending anyway)
  }
  for (int kind = 0; kind < 2; ++kind) {
    out_[kind].reset(), in_[kind].reset();  // communicators before the MPI communicators they use
    mpi::free(pair_[kind][0]);
    mpi::free(pair_[kind][1]);
  }
}

void PipeChannels::send(const torch::Tensor& t, Kind kind) {
  MPITRAIN_CHECK(out_[kind] != nullptr, "PipeChannels::send: no channel that way");
  sending_.push_back(out_[kind]->send_async(t.detach().to(torch::kFloat32).contiguous(), 1));
}

PipeChannels::Incoming PipeChannels::post(int64_t numel, Kind kind) {
  MPITRAIN_CHECK(in_[kind] != nullptr, "PipeChannels::post: no channel that way");
  Incoming in;
  in.buffer = torch::empty({numel}, torch::dtype(torch::kFloat32).device(device_));
  in.work = in_[kind]->recv_async(in.buffer, 0);
  return in;
}

torch::Tensor PipeChannels::take(Incoming& incoming) {
  waited([&] { incoming.work->wait(); });
  incoming.work.reset();
  return std::exchange(incoming.buffer, torch::Tensor());
}

void PipeChannels::finish() {
  waited([&] {
    for (auto& work : sending_) work->wait();
  });
  sending_.clear();
}

std::vector<ChannelOrder> pipeline_channel_orders(const std::string& schedule, int64_t stages, int64_t micro_batches,
                                                  int64_t chunks) {
  const int64_t P = stages * chunks;
  std::vector<ChannelOrder> out;
  for (const PipeChannels::Kind kind : {PipeChannels::activations, PipeChannels::gradients})
    for (int64_t s = 0; s < stages; ++s) out.push_back({kind, s, {}, {}});
  const auto channel = [&](PipeChannels::Kind kind, int64_t from) -> ChannelOrder& {
    return out[static_cast<size_t>(kind * stages + (from + stages) % stages)];
  };
  for (int64_t s = 0; s < stages; ++s)
    for (const PipeStep& p : pipeline_schedule(schedule, stages, s, micro_batches, chunks)) {
      const int64_t vs = p.chunk * stages + s;
      if (p.forward) {  // (run_pipeline_steps: the receive before the step, the send after it)
        if (vs > 0) channel(PipeChannels::activations, s - 1).received.emplace_back(p.micro, vs);
        if (vs + 1 < P) channel(PipeChannels::activations, s).sent.emplace_back(p.micro, vs + 1);
      } else {
        if (vs + 1 < P) channel(PipeChannels::gradients, s + 1).received.emplace_back(p.micro, vs);
        if (vs > 0) channel(PipeChannels::gradients, s).sent.emplace_back(p.micro, vs - 1);
      }
    }
  return out;
}

void run_pipeline_steps(PipeChannels& channels, const std::vector<PipeStep>& steps, int64_t stages, int64_t stage,
                        int64_t chunks, int64_t numel, const PipeStepFn& forward, const PipeStepFn& backward) {
  const int64_t P = stages * chunks;
  const auto virtual_stage = [&](const PipeStep& s) { return s.chunk * stages + stage; };
  // Step k's input posted (none at the ends).
  const auto post = [&](size_t k) {
    const PipeStep& s = steps[k];
    const int64_t vs = virtual_stage(s);
    if (s.forward ? vs > 0 : vs + 1 < P)
      return channels.post(numel, s.forward ? PipeChannels::activations : PipeChannels::gradients);
    return PipeChannels::Incoming{};
  };
  PipeChannels::Incoming ahead = steps.empty() ? PipeChannels::Incoming{} : post(0);
  for (size_t k = 0; k < steps.size(); ++k) {
    PipeChannels::Incoming mine = std::exchange(ahead, k + 1 < steps.size() ? post(k + 1) : PipeChannels::Incoming{});
    const PipeStep& s = steps[k];
    const int64_t vs = virtual_stage(s);
    const torch::Tensor received = mine.buffer.defined() ? channels.take(mine) : torch::Tensor();
    const torch::Tensor out = (s.forward ? forward : backward)(s, received);
    if (s.forward && vs + 1 < P) channels.send(out, PipeChannels::activations);
    if (!s.forward && vs > 0) channels.send(out, PipeChannels::gradients);
  }
  channels.finish();
}

}  // namespace mpitrain
