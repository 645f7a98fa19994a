// Start-up of a training run, before the model exists: signals, the topology and the mesh
// layout, the batch arithmetic, logging, the watchdog, threads and allocator settings, the device,
// the datasets and model dimensions, the communicators, and whether there is a checkpoint to
// resume from. Every phase whose input may be bad on some ranks only runs under agree(), so a
// bad value ends every rank with one message naming the file and key (exit 2).
#pragma once

#include "mpitrain/mpi_ops.h"
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "mpitrain/amp.h"
#include "mpitrain/checkpoint.h"
#include "mpitrain/config.h"
#include "mpitrain/dir_lock.h"
#include "mpitrain/error.h"
#include "mpitrain/layout.h"
#include "mpitrain/mesh.h"
#include "mpitrain/model.h"
#include "mpitrain/mpi_env.h"
#include "mpitrain/shards.h"

namespace mpitrain {

struct Startup {
  Topology topo;
  MeshLayout layout;
  std::unique_ptr<Mesh> mesh;
  torch::Device device{torch::kCPU};
  Precision precision = Precision::fp32;
  std::unique_ptr<TokenDataset> train_data, val_data;  // val_data null without data.val
  GPTDims dims;
  TpPlace tp;          // this rank's tp group (Parallelism::make_model applies it: GPT::parallelize)
  RunOptions options;  // how the built model runs (GPT::apply; Parallelism::make_model applies it)
  int threads = 1;                  // torch threads per rank
  std::vector<std::string> resume;  // rank 0: checkpoints to resume from, best first
  bool has_resume = false;          // every rank: resume is not empty on rank 0
  std::unique_ptr<DirLock> checkpoint_lock;  // rank 0: checkpoint.dir is this job's until the end
  // Every rank: the lowest rank that does not see rank 0's checkpoint.dir (its own disk, not a
  // shared filesystem), or -1 when all do and so may write their shares of a checkpoint there.
  int checkpoint_dir_blind_rank = 0;
};

// Everything above, in order; `cfg` is resolved for the world (train.grad_accum/global_batch).
// Rank 0 locks checkpoint.dir before it looks for a checkpoint to resume (dir_lock.h); a job
// holding it already is exit 2 on every rank. force_unlock: --force-unlock.
// plan_only (`mpitrain plan`): no rank log files, and checkpoint.dir is neither locked nor read.
Startup start_up(Config& cfg, MpiComm mpi_comm, bool force_unlock = false, bool plan_only = false);

// A resumed run may use another global batch (another world size, micro-batch or accumulation):
// allowed, and said, with what it changes. The checkpoint's own run is known from the resolved
// config it stores (rank 0 reads the checkpoint; older checkpoints without one say nothing).
void log_batch_change(const TrainState& st, const Config& cfg, int dp);

}  // namespace mpitrain
