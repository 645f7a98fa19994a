// The distributed half of checkpointing: what the ranks exchange so that rank 0 writes one
// checkpoint of the whole training state, and so that any layout resumes from it.
//
// A checkpoint holds whole-parameter tensors whatever the layout (checkpoint.h). Under ZeRO-1
// (optim.zero: 1) each rank holds AdamW's moments for its slices only:
//  - save: gather_optim_state all-gathers one bucket's moments at a time (a transient buffer of
//    one padded bucket per rank) and rank 0 copies them into whole-parameter host tensors, so
//    rank 0 alone holds the full AdamW state, in host memory, while it writes;
//  - resume: rank 0 reads the file (ranks on other hosts need not see it) into whole-parameter
//    host tensors, then one bucket at a time is broadcast and every rank keeps its own slices.
// Parameters are whole on every rank in every layout and are broadcast from rank 0.
#pragma once

#include <mpi.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mpitrain/checkpoint.h"
#include "mpitrain/comm.h"
#include "mpitrain/grad_sync.h"
#include "mpitrain/model.h"
#include "mpitrain/optim.h"

namespace mpitrain {

// AdamW's state in whole-parameter shapes for the writer (rank 0 of opt's group). Unsharded: the
// optimizer's own tensors (every rank). Sharded: collective over `shards`' communicator; rank 0
// gets host fp32 tensors, the other ranks an empty state. `reuse` (rank 0, sharded): host tensors
// of an earlier gather to fill again instead of allocating (the training loop keeps them between
// saves, so that no save pays for fresh memory); filled on first use.
FullOptimState gather_optim_state(AdamW& opt, const GradSync* shards, GPT& model, FullOptimState* reuse = nullptr);
// Whole-parameter host fp32 tensors (zeros) for AdamW's moments, named as the parameters.
FullOptimState host_optim_state_like(GPT& model);

// Every rank's RNG state, gathered (all ranks call; rank 0 keeps them for the checkpoint).
std::vector<std::vector<uint8_t>> gather_rng_states(Communicator& comm, const torch::Device& device);

// Loads the first loadable of `candidates` on rank 0 and gives every rank its part: parameters,
// AdamW state (whole or, with `shards`, this rank's slices), the training state, the fp16 loss
// scale and the RNG streams (restored per rank when the world size and kind of device are
// unchanged, else reseeded from `seed`). A corrupt newest checkpoint (checksum, truncation)
// falls back to the previous one, with a warning; an explicitly named checkpoint must load.
void resume_from(const std::vector<std::string>& candidates, GPT& model, AdamW& opt, const GradSync* shards,
                 TrainState& st, Communicator& comm, MPI_Comm mpi_comm, uint64_t seed, const torch::Device& device);

}  // namespace mpitrain
