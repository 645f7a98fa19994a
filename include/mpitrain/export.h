// `mpitrain export CHECKPOINT --format hf DIR`: a checkpoint as a Hugging Face GPT-2 model
// directory (hf_format.h). Torch-free so the CLI includes it without the heavy headers.
#pragma once

#include <string>

namespace mpitrain {

struct ExportArgs {
  std::string checkpoint;
  std::string dir;
  std::string format = "hf";
  std::string dtype = "fp32";  // fp32 | bf16 | fp16
  std::string bpe_dir;         // GPT-2 BPE checkpoints: where vocab.json + merges.txt are (copied along)
};

// Writes model.safetensors + config.json (+ the tokenizer files) and returns what it wrote, one
// line per file. UsageError for a bad checkpoint, format, dtype, or tokenizer directory.
std::string run_export(const ExportArgs& args);

}  // namespace mpitrain
