// `mpitrain sample CHECKPOINT`. Torch-free so the CLI includes it without the heavy headers
// (generation itself is model.h's generate, byte decoding its decode_bytes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mpitrain/mpi_ops.h"

namespace mpitrain {

// `mpitrain sample CHECKPOINT`: loads a checkpoint and returns generated text (any rank count;
// rank 0 generates).
struct SampleArgs {
  std::string checkpoint;
  std::string prompt;
  int64_t tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 40;
  uint64_t seed = 1;
  std::string tokenizer_file;  // hf checkpoints: the tokenizer.json ("" = the one the shards were packed with)
  // --stream: one block of the model in memory at a time, read from the checkpoint around its use
  // in every forward pass (a model larger than memory; slow: the file is read once per token).
  bool stream = false;
};
std::string run_sample(const SampleArgs& args);

// The tokenizer.json of a checkpoint trained on `--tokenizer hf` shards: `override_path`, else the
// file the shards were packed with; its SHA-256 must be the one recorded. UsageError naming the
// file otherwise.
class HfTokenizer;
struct TrainState;

// `mpitrain eval CHECKPOINT|hf:DIR --task NAME=FILE@LIMIT ...` under mpirun: multiple-choice tasks
// scored as in training (mc_eval.h), the examples split over the ranks (each holding the whole
// model, on the CPU); rank 0 prints each task's acc and acc_norm and, with --scores, writes every
// example's choices' scores as JSON ({task: {acc, acc_norm, examples, scores}}).
struct EvalArgs {
  std::string model;                // a checkpoint .h5, or hf:DIR
  std::vector<std::string> tasks;   // eval.tasks entries
  std::string tokenizer_file;       // tokenizer.json ("" = the checkpoint's shards' or DIR's; byte = bytes)
  int64_t rows = 8;                 // choices per forward
  std::string scores;               // rank 0 writes the scores here ("" = none)
};
std::string run_eval_command(const EvalArgs& args, MpiComm world);
HfTokenizer checkpoint_tokenizer(const TrainState& st, const std::string& override_path, const std::string& checkpoint);

}  // namespace mpitrain
