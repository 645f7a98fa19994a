// main() for every test binary: MPI start-up (singleton or under mpirun), then GoogleTest.
// Rank 0 prints GoogleTest's usual progress; other ranks print only their failures, prefixed with
// the rank. The exit code is the maximum over ranks, so a failure on any rank fails the test.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

#include "mpitrain/mpi_env.h"
#include "test_data.h"

// tests/test_data.h: the one translation unit with the checkout's absolute path.
const char* const kTestDataDir = MPITRAIN_TEST_DATA;

namespace {
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};
}  // namespace

int main(int argc, char** argv) {
  mpitrain::MpiSession mpi(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  if (mpi.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(mpi.rank()));
  }
  int rc = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}
