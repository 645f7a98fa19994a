// HDF5 checkpoints, format v1 (docs/formats.md): the full training state, unsharded fp32, so any
// world size can load it. Written atomically: <file>.tmp, fsync, rename, fsync of the directory;
// then `latest` is replaced the same way, so it only ever names a complete file.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mpitrain/config.h"
#include "mpitrain/model.h"
#include "mpitrain/optim.h"

namespace mpitrain {

constexpr const char* kCheckpointFormat = "mpitrain-checkpoint";
constexpr int64_t kCheckpointVersion = 1;

struct TrainState {
  int64_t step = 0;            // optimizer steps completed
  int64_t tokens_seen = 0;     // training tokens consumed, all ranks together
  uint64_t data_cursor = 0;    // global training windows consumed (the sample-order cursor)
  int64_t world_size = 1;      // world size of the run that wrote it
  std::string config_yaml;     // the resolved config of that run
  std::string tokenizer = "byte";
  int64_t eot_token = -1;
  std::vector<std::vector<uint8_t>> rng_states;  // per rank: torch's CPU generator state
};

// Creates `dir` if needed and checks it can be written; UsageError naming `key` otherwise. Run at
// start-up so a bad checkpoint.dir fails before training, not at the first save.
void ensure_writable_dir(const std::string& dir, const std::string& key);

// "ckpt-00000120.h5"
std::string checkpoint_name(int64_t step);

// Writes dir/ckpt-<step:08>.h5 and updates dir/latest, then deletes all but the newest `keep`
// complete checkpoints (never the one just written). Returns the path written. One rank calls it.
std::string save_checkpoint(const std::string& dir, GPT& model, AdamW& opt, const TrainState& st,
                            int64_t keep);

// The checkpoint a run resumes from: checkpoint.resume "none" -> none; a path -> that file (it must
// exist); "auto" -> the one `latest` names in checkpoint.dir, else the newest ckpt-*.h5 there, else
// none.
std::optional<std::string> find_resume_checkpoint(const CheckpointConfig& cfg);

// Every checkpoint a run may resume from, best first: an explicit checkpoint.resume path alone;
// for "auto", the one `latest` names, then the other ckpt-*.h5 in checkpoint.dir, newest first
// (the fallbacks when the newest turns out to be corrupt).
std::vector<std::string> resume_candidates(const CheckpointConfig& cfg);

// The model dimensions a checkpoint was written with (for `mpitrain sample`).
GPTDims checkpoint_dims(const std::string& path);

// Loads parameters (and, when opt is given, AdamW moments and step count) and the training state.
// Every dataset's CRC32 is verified. Shape mismatches, missing datasets, wrong format or version,
// and checksum failures are UsageError naming the file and dataset.
void load_checkpoint(const std::string& path, GPT& model, AdamW* opt, TrainState& st);

}  // namespace mpitrain
