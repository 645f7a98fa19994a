// `mpitrain export CHECKPOINT --format hf DIR`: a checkpoint as a Hugging Face GPT-2 or Llama
// model directory (hf_format.h). Torch-free so the CLI includes it without the heavy headers.
#pragma once

#include <string>

namespace mpitrain {

struct ExportArgs {
  std::string checkpoint;
  std::string dir;
  std::string format = "hf";
  std::string dtype = "fp32";  // fp32 | bf16 | fp16
  double max_shard_mb = 0;     // safetensors shards of at most this many MB (0: Hugging Face's 5 GB)
  std::string bpe_dir;         // GPT-2 BPE checkpoints: where vocab.json + merges.txt are (copied along)
  std::string tokenizer_file;  // hf checkpoints: the tokenizer.json ("" = the one the shards were packed with)
  bool overwrite = false;      // replace another model's files in `dir` (foreign_model_files)
};

// Writes the safetensors file(s) + config.json (+ the tokenizer files) and returns what it wrote, one
// line per file. UsageError for a bad checkpoint, format, dtype, or tokenizer directory.
std::string run_export(const ExportArgs& args);

}  // namespace mpitrain
