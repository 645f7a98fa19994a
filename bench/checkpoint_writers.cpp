// bench/checkpoint_writers: a ZeRO-1 checkpoint written by rank 0 alone (the moments gathered to
// it first: checkpoint.writers: rank0) against every rank writing its own share of the same file
// (checkpoint.writers: auto), in one run under mpirun -np N, the two alternating, median of --runs
// after --warmup untimed rounds. Prints per writer layout the synchronous save (from the first
// rank entering to the last leaving), the loop's stall with checkpoint.async (the slowest rank's),
// and the host memory each rank holds for async snapshots, with the ratios of the shares against
// rank 0 alone. bench/checkpoint_writers.sh runs it for 2 and 4 ranks.
//
//   mpirun -np N bench_checkpoint_writers [--dir D] [--runs 5] [--warmup 2] [--layers 12] [--embd 768] [--vocab 50304]
#include "mpitrain/mpi_native.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "mpitrain/checkpoint.h"
#include "mpitrain/comm.h"
#include "mpitrain/grad_sync.h"
#include "mpitrain/log.h"
#include "mpitrain/state_sync.h"

#include "args.h"

using namespace mpitrain;
using bench::arg;
using bench::arg_str;
using bench::Clock;
using bench::median;
using bench::seconds_since;

namespace {

// The slowest rank's value.
double slowest(double s) {
  MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return s;
}

// Seconds from every rank starting `fn` together to the last one finishing it.
template <class Fn>
double timed(Fn&& fn) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = Clock::now();
  fn();
  MPI_Barrier(MPI_COMM_WORLD);
  return seconds_since(t0);
}

void run(int argc, char** argv) {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const std::string dir = arg_str(argc, argv, "--dir", "/tmp/mpitrain-bench-writers");
  const int runs = static_cast<int>(arg(argc, argv, "--runs", 5));
  const int warmup = static_cast<int>(arg(argc, argv, "--warmup", 2));
  GPTDims d;
  d.n_layer = static_cast<int64_t>(arg(argc, argv, "--layers", 12));
  d.n_embd = static_cast<int64_t>(arg(argc, argv, "--embd", 768));
  d.n_head = 12;
  d.seq_len = 1024;
  d.vocab_size = static_cast<int64_t>(arg(argc, argv, "--vocab", 50304));
  log::init(rank, world, "bench");
  log::set_level(log::Level::warn);  // the per-save info lines would interleave with the table
  torch::set_num_threads(1);

  // Every rank: the whole model and, as ZeRO-1 trains, AdamW state for its slices (random
  // moments, as after some training).
  torch::manual_seed(1);
  GPT model(d);
  std::vector<torch::Tensor> params;
  for (auto& [name, p] : model->named_params()) params.push_back(p);
  auto comm = make_mpi_communicator(mpi::world());
  GradSync shards(params, *comm, 25.0, /*overlap=*/false, /*shard=*/true);
  OptimConfig ocfg;
  AdamW opt(model->named_params(), shards.grad_shards(), ocfg);
  {
    torch::NoGradGuard no_grad;
    for (size_t b = 0; b < shards.num_buckets(); ++b) {
      opt.bucket_exp_avg(b).normal_(0, 1e-3);
      opt.bucket_exp_avg_sq(b).uniform_(0, 1e-6);
    }
  }
  opt.set_steps_taken(100);
  TrainState st;
  st.world_size = world;
  st.dp = world;
  st.zero = 1;
  if (rank == 0) std::system(("rm -rf '" + dir + "' && mkdir -p '" + dir + "'").c_str());
  MPI_Barrier(MPI_COMM_WORLD);
  CommDup writer_comm(mpi::world());

  // One save of each kind, as train.cpp does it.
  FullOptimState gathered;  // rank 0 alone: the whole moments, kept between saves
  auto save_rank0 = [&](AsyncCheckpointWriter& w) {
    FullOptimState full = gather_optim_state(opt, &shards, model, &gathered);
    if (rank == 0) w.save(model, full, st);
    if (!w.async()) MPI_Barrier(MPI_COMM_WORLD);
  };
  CheckpointShare buffers;
  auto save_shares_now = [&](AsyncCheckpointWriter& w) {
    save_shares(w, buffers, model, opt, &shards, false, st, writer_comm.get());
  };

  std::vector<double> rank0_s, shares_s;
  int64_t step = 1;
  {
    AsyncCheckpointWriter sync0(dir + "/rank0", 1, /*async=*/false), sync_all(dir + "/shares", 1, /*async=*/false);
    for (int r = -warmup; r < runs; ++r) {
      if (r == 0) rank0_s.clear(), shares_s.clear();
      st.step = step++;
      rank0_s.push_back(timed([&] { save_rank0(sync0); }));
      st.step = step++;
      shares_s.push_back(timed([&] { save_shares_now(sync_all); }));
    }
  }
  // checkpoint.async: the loop's stall (the slowest rank's), the write itself waited for after.
  std::vector<double> rank0_stall, shares_stall;
  {
    AsyncCheckpointWriter async0(dir + "/rank0", 1, /*async=*/true), async_all(dir + "/shares", 1, /*async=*/true);
    if (rank == 0) {
      gathered = host_optim_state_like(model);
      async0.prepare(model, gathered);
    }
    share_checkpoint(buffers, model, opt, &shards, false, st, /*copy=*/true);  // as train.cpp at start-up
    for (int r = -1; r < std::max(runs, 3); ++r) {
      st.step = step++;
      MPI_Barrier(MPI_COMM_WORLD);
      auto t0 = Clock::now();
      save_rank0(async0);
      const double a = slowest(seconds_since(t0));
      async0.wait();
      st.step = step++;
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = Clock::now();
      save_shares_now(async_all);
      const double b = slowest(seconds_since(t0));
      async_all.wait();
      if (r >= 0) rank0_stall.push_back(a), shares_stall.push_back(b);
    }
  }

  // Host memory each rank holds for async snapshots: rank 0 alone holds the whole state.
  int64_t share_bytes = 0;
  for (const auto& p : buffers.pieces) share_bytes += p.data.nbytes();
  int64_t largest_share = share_bytes;
  MPI_Allreduce(MPI_IN_PLACE, &largest_share, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  const int64_t whole = 3 * model->num_params() * static_cast<int64_t>(sizeof(float));
  if (rank == 0) {
    const double mb = static_cast<double>(whole) / 1e6;
    std::printf("ZeRO-1 checkpoint of GPT-2 %lldL/%lld/vocab %lld: %.0f M parameters + AdamW moments = %.0f MB of "
                "tensors; %d ranks; median of %d runs\n",
                static_cast<long long>(d.n_layer), static_cast<long long>(d.n_embd),
                static_cast<long long>(d.vocab_size), static_cast<double>(model->num_params()) / 1e6, mb, world, runs);
    std::printf("\n| checkpoint.writers | writing ranks | sync save s | MB/s | ratio | async stall ms | ratio | "
                "async host MB on the largest rank | ratio |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    const double s0 = median(rank0_s), s1 = median(shares_s), t0 = median(rank0_stall), t1 = median(shares_stall);
    std::printf("| rank0 (moments gathered) | 1 | %.2f | %.0f | 1.00 | %.0f | 1.00 | %.0f | 1.00 |\n", s0, mb / s0, t0 * 1e3,
                mb);
    std::printf("| auto (each rank its share) | %d | %.2f | %.0f | %.2f | %.0f | %.2f | %.0f | %.2f |\n", world, s1,
                mb / s1, s0 / s1, t1 * 1e3, t0 / t1, static_cast<double>(largest_share) / 1e6,
                static_cast<double>(whole) / static_cast<double>(largest_share));
    std::printf("\n(ratios: rank0's time or memory / auto's; > 1 = the shares are faster or smaller)\n");
    std::system(("rm -rf '" + dir + "'").c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  if (provided < MPI_THREAD_MULTIPLE) {  // async shares write from a background thread
    std::fprintf(stderr, "bench_checkpoint_writers: MPI without MPI_THREAD_MULTIPLE\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  run(argc, argv);  // its communicators are freed before MPI ends
  MPI_Finalize();
  return 0;
}
