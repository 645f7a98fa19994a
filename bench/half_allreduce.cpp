// How to sum 16-bit gradients with MPI, measured (comm.grad_dtype): MPI has no bf16/fp16 sum, so
// either (a) a user-defined MPI_Op (what mpitrain uses: MPI's own all-reduce algorithms, half the
// bytes, a conversion loop per pairwise step), or (b) an all-gather of every rank's 16-bit bucket
// and a local sum in fp32 (no user op, but each rank receives (n-1) whole buckets instead of ~2x
// one). Both against the fp32 MPI_Allreduce of the same bucket, in one run, per bucket size.
//
//     mpirun -np N build/bench_half_allreduce [--iters 20] [--max-mib 64]
//
// Prints, on rank 0, the median time per all-reduce over `iters` after 3 warm-ups, and each
// method's ratio to fp32 (below 1.0 is faster). On one machine the "network" is shared memory;
// over a real link the byte counts decide more (bench/RESULTS-comm.md).
#include "mpitrain/mpi_native.h"

#include <cstdio>
#include <string>
#include <vector>

#include "args.h"
#include "mpitrain/comm.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  {
    using namespace mpitrain;
    auto comm = make_mpi_communicator(mpi::world());
    const int n = comm->size(), rank = comm->rank();
    const int iters = static_cast<int>(bench::arg(argc, argv, "--iters", 20));
    const double max_mib = bench::arg(argc, argv, "--max-mib", 64);
    if (rank == 0)
      std::printf("%d ranks; median of %d all-reduces; MiB = the fp32 bucket's size\n\n"
                  "| MiB | fp32 MPI_Allreduce ms | bf16 user op ms | ratio | bf16 all-gather + fp32 sum ms | ratio |\n"
                  "|---:|---:|---:|---:|---:|---:|\n",
                  n, iters);
    for (double mib = 1; mib <= max_mib; mib *= 4) {
      const int64_t count = static_cast<int64_t>(mib * (1 << 20) / 4);
      torch::manual_seed(rank);
      const torch::Tensor grads = torch::randn({count});
      auto time = [&](auto&& once) {
        std::vector<double> t;
        for (int i = 0; i < iters + 3; ++i) {
          MPI_Barrier(MPI_COMM_WORLD);
          const auto t0 = bench::Clock::now();
          once();
          double s = bench::seconds_since(t0), slowest = 0;
          MPI_Allreduce(&s, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
          if (i >= 3) t.push_back(slowest);
        }
        return bench::median(t) * 1e3;
      };
      torch::Tensor f32 = grads.clone(), b16 = grads.to(torch::kBFloat16), gathered = torch::empty({n * count}, torch::kBFloat16);
      const double t32 = time([&] { comm->all_reduce(f32, ReduceOp::sum); });
      const double top = time([&] { comm->all_reduce(b16, ReduceOp::sum); });
      const double tgather = time([&] {
        comm->all_gather(b16, gathered);
        f32 = gathered.view({n, count}).to(torch::kFloat32).sum(0);
      });
      if (rank == 0)
        std::printf("| %.0f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", mib, t32, top, top / t32, tgather, tgather / t32);
    }
  }
  MPI_Finalize();
  return 0;
}
