// Memory per rank for a layout (optim.zero x train.activation_checkpointing), the part of
// `mpitrain plan` that says what fits (issue 41, section 4). Torch-free: the model state is counted
// from the parameter numbers, the activations come from what plan measured (activation_probe in
// plan.cpp: the bytes one micro-batch's forward keeps for backward, with one block and with two,
// on the device that trains, tensor-parallel like the run), so every kernel path's own
// activations are what is scaled.
//
// Per rank, N = the parameters this rank's model holds (under parallel.tp its shards, the
// replicated parameters whole), d = dp:
//   weights     4N fp32 (zero 3: 4N/d + the units gathered at once: the parameters outside the
//               blocks, whole from the forward's start to the end of backward, the block running
//               and the next one, prefetched)
//   gradients   4N in .grad (zero 0, 1); zero 2 and 3: the 4N/d shard
//   buffers     GradSync's flat buckets with d > 1: 4N (zero 0, 1: every bucket kept for the next
//               step); zero 2: the buckets in flight, at most 2 x comm.bucket_mb; zero 3: the
//               outside unit's gradient (filled through the whole backward) and three blocks' (two
//               reduce-scatters in flight and the one filling)
//   optimizer   AdamW's two moments: 8N in fp32, 4N with optim.state_dtype: bf16; over d with
//               zero >= 1
//   activations n_layer x the per-block bytes + the rest (embeddings, final norm, loss), measured;
//               full checkpointing: each checkpointed block keeps its input only; selective: its
//               input, its linear layers' outputs and attention's (checkpointing.h), measured
//               likewise; either plus one block's activations while it runs again in backward
//   peak        the sum. Not a bound: the gradients grow in backward as the activations shrink
//               (the H100 measured 0.89x of it for zero 0 without checkpointing), and transients
//               it does not count (the tied embedding's gradient copies, autocast's weight copies
//               in recomputation) made zero 2 + full checkpointing 1.41x of it (bench/RESULTS.md)
// Megatron-LM's count for comparison: 18 bytes per parameter unsharded (its bf16 weights, fp32
// master and gradients, moments) against mpitrain's 16 (fp32 weights and gradients, no copy).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mpitrain {

struct MemoryInputs {
  int64_t params = 0;         // N: elements of this rank's parameters
  // Of them, the elements ZeRO does not shard (expert parallelism: this rank's experts, whole on each
  // of their replicas, their gradients in buckets of their own; largest_block and outside_params
  // then count the others only: zero 3's units hold no expert).
  int64_t whole_params = 0;
  int64_t largest_block = 0;  // elements of the largest block (a zero 3 unit)
  int64_t outside_params = 0; // elements outside the blocks: embeddings, final norm, head (zero 3's other unit)
  int64_t n_layer = 0;
  int64_t dp = 1;             // data-parallel ranks the zero stages shard over
  double bucket_mb = 25;      // comm.bucket_mb
  int64_t ac_every = 1;       // train.ac_every
  int64_t moment_bytes = 4;   // bytes per element of each AdamW moment: 4, or 2 (optim.state_dtype: bf16)
  // Measured by plan for one micro-batch (bytes): what the forward keeps for backward per block
  // without checkpointing, with selective and with full checkpointing, and everything outside the
  // blocks.
  double block_none = 0, block_selective = 0, block_full = 0, outside = 0;
};

struct MemoryRow {
  int zero = 0;
  std::string ac;  // none | selective | full
  double weights = 0, gradients = 0, buffers = 0, optimizer = 0, activations = 0;
  double peak() const { return weights + gradients + buffers + optimizer + activations; }
  // The largest term, for "does not fit because of ...".
  std::string largest_term() const;
};

// zero 0..3 x ac none/selective/full, in that order; with dp 1 the zero stages shard nothing
// (their rows equal zero 0's).
std::vector<MemoryRow> memory_rows(const MemoryInputs& in);
// The row of one layout (zero 0..3, ac none | selective | full); Error for another.
MemoryRow memory_row(const MemoryInputs& in, int zero, const std::string& ac);

// The table (MiB per rank) and, when memory_gib > 0, the recommendation: the first row that fits
// in memory_gib, in the order of expected speed (no checkpointing, selective, full; lower zero stages
// before higher: zero 2 and 3 communicate every micro-step under accumulation, zero 3 gathers
// every block's parameters twice per micro-step), naming why each faster one does not fit. memory_source says where the limit came from ("--memory",
// "the GPU's memory").
std::string memory_report(const MemoryInputs& in, double memory_gib, const std::string& memory_source);

// Expert parallelism's all-to-all bytes one rank sends per step: per sparse layer and micro-batch
// the micro-batch's `copies` routed token copies (tokens x top k) of n_embd elements go to their
// experts (`in_bytes` each: the block's activations, fp32) and come back (`out_bytes`: the experts'
// outputs, autocast's dtype), and their gradients the reverse ways in backward; (ep - 1) / ep of
// the copies leave the rank when the routing is balanced.
double expert_exchange_bytes(int64_t sparse_layers, int64_t copies, int64_t n_embd, int64_t in_bytes, int64_t out_bytes,
                             int64_t ep, int64_t accum);

}  // namespace mpitrain
