// `mpitrain plan CONFIG`: does a second host pay, and with which settings? Run under the same
// mpirun (hosts, ranks) as the training it plans. It measures, on the ranks actually allocated:
//   - one micro-batch's forward and backward (all ranks at once, as in training), and AdamW's step;
//   - the gradient all-reduce of this model's buckets over all ranks and within one host, in fp32
//     and bf16 (GradSync itself, without overlap), and from it the bus bandwidth
//     busbw = 2 (n-1)/n x bytes / time (nccl-tests' definition);
// then predicts, for grad_accum 1/2/4/8/16 x comm.grad_dtype fp32/bf16 x comm.overlap on/off:
//   step = accum x t_micro + t_adamw + exposed,   exposed = all-reduce time           (no overlap)
//                                       exposed = max(last bucket's time, all-reduce - backward)  (overlap)
// (the buckets start during the last micro-batch's backward; the last one, holding the token
// embedding, only after it), the communication share exposed / step, tokens/s, and the speed-up
// over one host's ranks training alone with the same settings (their all-reduce measured within
// the host). Prints one table and a recommendation on rank 0 (docs/operations.md, "Slow networks").
// Then the memory per rank of optim.zero 0-3 x activation checkpointing none/full (memory_plan.h:
// the model state counted, one micro-batch's activations measured with one and two blocks), and
// the fastest layout that fits --memory GiB (on a GPU by default its memory).
#pragma once

#include "mpitrain/mpi_ops.h"

#include <cstdint>

#include "mpitrain/config.h"

namespace mpitrain {

struct PlanOptions {
  int64_t iters = 5;  // timed repetitions of each measurement (after 2 warm-ups)
  double memory_gib = 0;  // --memory: the memory per rank to fit (0: the GPU's; none on the CPU)
  bool memory_only = false;  // --memory-only: the memory table alone, no timing (no collectives timed)
};

// Collective. UsageError (agreed, printed once) for a bad config or parallel.tp > 1.
void run_plan(Config cfg, MpiComm comm, const PlanOptions& opt);

}  // namespace mpitrain
