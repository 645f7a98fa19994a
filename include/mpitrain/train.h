// The training run: data-parallel GPT training over the ranks of an MPI communicator.
// Torch-free header so the CLI and tests can call it without the heavy includes.
#pragma once

#include "mpitrain/mpi_ops.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mpitrain/config.h"

namespace mpitrain {

struct TrainHooks {
  int64_t stop_after = -1;   // end after this many completed steps with a checkpoint (-1 = never)
  bool keep_params = false;  // copy the final parameters into TrainResult::params (tests)
  bool force_unlock = false; // --force-unlock: override checkpoint.dir's lock of a job that is gone
};

struct TrainResult {
  int exit_code = 0;  // 0, or kExitPreempted / kExitInterrupted after a stop signal (signals.h)
  int64_t final_step = 0;
  int64_t num_params = 0;
  std::vector<std::pair<int64_t, double>> losses;      // (step, train loss) at every logged step
  std::vector<std::pair<int64_t, double>> val_losses;  // (step, val loss) at every evaluation
  struct TaskAccuracy {
    int64_t step;
    std::string task;
    double acc, acc_norm;
  };
  std::vector<TaskAccuracy> task_accuracies;  // eval.tasks: every scoring
  std::string last_checkpoint;                         // path of the newest checkpoint written
  int checkpoint_writers = 1;                          // ranks that write each checkpoint (ZeRO-1 shares: all)
  std::string sample;                                  // generated text (rank 0, sample.tokens > 0)
  // ZeRO-3: the most units this rank held whole at once from start-up to the last step
  // (initial weights, resume, evaluations and checkpoints included; the final sample not); 0
  // under the other stages.
  size_t max_units_whole = 0;
  // DiLoCo (parallel.islands > 1): outer steps taken, bytes this rank handed to them
  int64_t outer_steps = 0;
  uint64_t island_bytes = 0;
  std::vector<std::pair<std::string, std::vector<float>>> params;  // when hooks.keep_params
};

// Trains per `cfg` on the ranks of `comm` (every rank calls it). Bad input throws UsageError
// (already agreed across ranks: see agree() in mpi_env.h); anything else throws Error.
TrainResult train(Config cfg, MpiComm comm, const TrainHooks& hooks = {});

// GPUs this process can use (0 in CPU builds or without devices).
int local_gpu_count();
// The libtorch this binary was built against ("2.6.0"), for the pre-flight record.
std::string libtorch_release();
// The vectorised CPU kernels ATen dispatches to in this process ("AVX2", "AVX512", "NO AVX"):
// its default on this CPU, or ATEN_CPU_CAPABILITY's (tests/kernel_paths_test.sh reads it).
std::string cpu_kernels();

}  // namespace mpitrain
