// bench/tensor_parallel: what tensor parallelism costs and saves, per rank, for one tp degree at a
// fixed global batch: parameters and AdamW state held, the step's peak extra memory (activations,
// gradients and buffers: the process's peak resident memory during the timed steps over its
// resident memory before them), the median step time, and the share of the step spent in the tp
// all-reduces (tp_collective_seconds), as a line "row tp dp MB MB ms share". bench/tensor_parallel.sh
// runs it under one mpirun -np 4 per degree (1, 2, 4) and prints one table, with ratios against tp 1.
//
//   mpirun -np N bench_tensor_parallel --tp T [--layers 4] [--embd 256] [--heads 8] [--vocab 8192]
//                                      [--seq 128] [--batch 16] [--steps 8] [--warmup 2]
#include "mpitrain/mpi_native.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "mpitrain/comm.h"
#include "mpitrain/grad_sync.h"
#include "mpitrain/log.h"
#include "mpitrain/model.h"
#include "mpitrain/optim.h"
#include "mpitrain/tensor_parallel.h"

#include "args.h"

using namespace mpitrain;
using bench::arg;
using bench::Clock;
using bench::median;
using bench::seconds_since;

namespace {

// A line of /proc/self/status in bytes ("VmRSS", "VmHWM").
double status_bytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key + ":", 0) == 0) return std::stod(line.substr(key.size() + 1)) * 1024.0;
  return 0;
}

// Resets the peak resident memory (VmHWM) to the current one (Linux 4.0+).
void reset_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }

double largest(double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return v;
}

void run(int argc, char** argv) {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const int tp = static_cast<int>(arg(argc, argv, "--tp", 1));
  const int dp = world / tp;
  const int64_t batch = static_cast<int64_t>(arg(argc, argv, "--batch", 16));
  const int steps = static_cast<int>(arg(argc, argv, "--steps", 8)), warmup = static_cast<int>(arg(argc, argv, "--warmup", 2));
  GPTDims d;
  d.n_layer = static_cast<int64_t>(arg(argc, argv, "--layers", 4));
  d.n_embd = static_cast<int64_t>(arg(argc, argv, "--embd", 256));
  d.n_head = static_cast<int64_t>(arg(argc, argv, "--heads", 8));
  d.vocab_size = static_cast<int64_t>(arg(argc, argv, "--vocab", 8192));
  d.seq_len = static_cast<int64_t>(arg(argc, argv, "--seq", 128));
  log::init(rank, world, "bench");
  log::set_level(log::Level::warn);
  torch::set_num_threads(1);
  at::globalContext().setFlushDenormal(true);

  // The mesh's groups: tp consecutive ranks, dp = the ranks with the same tp coordinate.
  MPI_Comm tp_mpi, dp_mpi;
  MPI_Comm_split(MPI_COMM_WORLD, rank / tp, rank, &tp_mpi);
  MPI_Comm_split(MPI_COMM_WORLD, rank % tp, rank, &dp_mpi);
  {
    auto tp_comm = make_mpi_communicator(from_mpi(tp_mpi)), dp_comm = make_mpi_communicator(from_mpi(dp_mpi));
    torch::manual_seed(1);
    GPT model(d);
    model->parallelize(TpPlace{tp, tp_comm->rank(), tp_comm.get()});
    std::vector<torch::Tensor> params;
    for (auto& [name, p] : model->named_params()) params.push_back(p);
    GradSync grads(params, *dp_comm, 25.0, /*overlap=*/true);
    OptimConfig ocfg;
    AdamW opt(model->named_params(), ocfg);
    int64_t param_bytes = 0;
    for (const auto& p : params) param_bytes += p.nbytes();

    const int64_t micro = batch / dp;  // fixed global batch: each data-parallel rank its part
    torch::manual_seed(2);
    torch::Tensor x = torch::randint(d.vocab_size, {batch, d.seq_len}, torch::kLong);
    torch::Tensor y = torch::randint(d.vocab_size, {batch, d.seq_len}, torch::kLong);
    const int dp_rank = rank / tp;
    x = x.narrow(0, dp_rank * micro, micro).contiguous();
    y = y.narrow(0, dp_rank * micro, micro).contiguous();

    std::vector<double> step_s, comm_share;
    double before = 0;
    for (int s = -warmup; s < steps; ++s) {
      if (s == 0) {
        before = status_bytes("VmRSS");
        reset_peak();
      }
      MPI_Barrier(MPI_COMM_WORLD);
      const double c0 = tp_collective_seconds();
      const auto t0 = Clock::now();
      grads.arm();
      model->loss(x, y).backward();
      grads.all_reduce_grads();
      clip_tp_grad_norm_(opt, model, 1.0, *tp_comm, *dp_comm);
      opt.step(1e-4);
      opt.zero_grad();
      const double t = seconds_since(t0);
      if (s >= 0) {
        step_s.push_back(t);
        comm_share.push_back((tp_collective_seconds() - c0) / t);
      }
    }
    const double step = largest(median(step_s)), share = largest(median(comm_share));
    const double peak = largest(status_bytes("VmHWM") - before);
    const double held = largest(static_cast<double>(param_bytes + opt.state_bytes()));
    if (rank == 0) {
      std::printf("model: GPT %lld layers x %lld wide, %lld heads, vocab %lld, seq %lld; global batch %lld; %d CPU "
                  "ranks, 1 thread each; median of %d steps, the largest rank's value\n",
                  static_cast<long long>(d.n_layer), static_cast<long long>(d.n_embd), static_cast<long long>(d.n_head),
                  static_cast<long long>(d.vocab_size), static_cast<long long>(d.seq_len),
                  static_cast<long long>(batch), world, steps);
      std::printf("row %d %d %.2f %.2f %.2f %.4f\n", tp, dp, held / 1e6, peak / 1e6, step * 1e3, share);
    }
  }
  MPI_Comm_free(&tp_mpi);
  MPI_Comm_free(&dp_mpi);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  run(argc, argv);
  MPI_Finalize();
  return 0;
}
