// main() for every test binary: MPI start-up (singleton or under mpirun), then GoogleTest.
// Only rank 0 prints GoogleTest's progress; every rank's failures still fail the run, because
// the exit code is the maximum over ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include "mpitrain/mpi_env.h"

int main(int argc, char** argv) {
  mpitrain::MpiSession mpi(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  if (mpi.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rc != 0 && mpi.rank() != 0)
    fprintf(stderr, "rank %d: some tests failed on this rank\n", mpi.rank());
  return worst;
}
