// HDF5 checkpoints, format v2 (docs/formats.md): the full training state, unsharded fp32, so any
// world size can load it. Written atomically: <file>.tmp, fsync, rename, fsync of the directory;
// then `latest` is replaced the same way, so it only ever names a complete file.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mpitrain/config.h"
#include "mpitrain/error.h"
#include "mpitrain/model.h"
#include "mpitrain/optim.h"

namespace mpitrain {

constexpr const char* kCheckpointFormat = "mpitrain-checkpoint";
constexpr int64_t kCheckpointVersion = 2;  // 2 = 1 + the writer's layout (parallel_dp/tp, optim_zero); both load

struct TrainState {
  int64_t step = 0;            // optimizer steps completed
  int64_t tokens_seen = 0;     // training tokens consumed, all ranks together
  uint64_t data_cursor = 0;    // global training windows consumed (the sample-order cursor)
  double loss_scale = 0;       // fp16 dynamic loss scale (0 = not an fp16 run)
  int64_t loss_scale_good_steps = 0;  // finite steps since the scale last changed (fp16)
  int64_t world_size = 1;      // world size of the run that wrote it
  int64_t dp = 1, tp = 1;      // that run's layout (world = dp x tp; version 1 files: dp = world_size)
  int64_t zero = 0;            // that run's optim.zero (informative: any layout loads any checkpoint)
  // DiLoCo's islands of that run (1: none). With more, the file holds island 0's state and the
  // run's other state lies in <file stem>.diloco/ (diloco.h): only the same layout resumes it.
  int64_t islands = 1;
  std::string config_yaml;     // the resolved config of that run
  std::string tokenizer = "byte";
  std::string tokenizer_file, tokenizer_sha256;  // hf: the shards' tokenizer.json and its SHA-256
  int64_t eot_token = -1;
  std::vector<std::vector<uint8_t>> rng_states;  // per rank: torch's CPU generator state
  // train.moe_bias_update_rate: every sparse layer's routing bias [sparse layers, experts] (fp32,
  // host; undefined: none), train/routing_bias.
  torch::Tensor routing_bias;
};

// Creates `dir` if needed and checks it can be written; UsageError naming `key` otherwise. Run at
// start-up so a bad checkpoint.dir fails before training, not at the first save.
void ensure_writable_dir(const std::string& dir, const std::string& key);

// "ckpt-00000120.h5"
std::string checkpoint_name(int64_t step);

// AdamW's state in whole-parameter shapes, as a checkpoint stores it whatever the layout that
// trained it: one entry per parameter, in named_params() order. For an unsharded AdamW the
// tensors are its own (full_state_of); ZeRO-1 ranks assemble them (state_sync.h).
struct FullOptimState {
  struct Moments {
    std::string name;
    torch::Tensor exp_avg, exp_avg_sq;
  };
  std::vector<Moments> moments;
  int64_t steps_taken = 0;
};
// An unsharded AdamW's state, by reference (no copy): loading into it loads into the optimizer.
FullOptimState full_state_of(AdamW& opt);

// Everything a checkpoint holds, as host tensors (CPU, contiguous fp32), detached from the live
// model and optimizer: what a save writes.
struct CheckpointSnapshot {
  using Moments = FullOptimState::Moments;
  GPTDims dims;
  std::vector<std::pair<std::string, torch::Tensor>> params;
  std::vector<Moments> moments;  // one per AdamW parameter, in the optimizer's order
  int64_t steps_taken = 0;
  TrainState state;
};

// Copies the parameters, AdamW moments and step count, and `st` into host memory. With
// copy=false, tensors that already are CPU contiguous fp32 are referenced, not copied: for a write
// on the calling thread that finishes before they change (the synchronous save).
CheckpointSnapshot snapshot_checkpoint(GPT& model, const FullOptimState& opt, const TrainState& st, bool copy = true);
// The same copies into the tensors of `into`, a snapshot of this model and state taken before
// (same names and shapes): no allocation.
void snapshot_into(CheckpointSnapshot& into, GPT& model, const FullOptimState& opt, const TrainState& st);

// Writes dir/ckpt-<step:08>.h5 (tmp, fsync, rename, directory fsync) and updates dir/latest the
// same way, then deletes all but the newest `keep` complete checkpoints (never the one just
// written). Returns the path written. A failed write (disk full) removes its .tmp and is a
// UsageError; earlier checkpoints stay as they were. One rank calls it. (CheckpointFile below in
// one go; ranks that each hold part of the state write it together: state_sync.h.)
std::string write_checkpoint(const std::string& dir, const CheckpointSnapshot& snap, int64_t keep);

// ---- a checkpoint file written in steps, its tensors' bytes by whoever holds them ----

// A tensor of a checkpoint: its dataset ("model/wte.weight", "optim/wte.weight/exp_avg") and shape.
struct CheckpointTensor {
  std::string path;
  std::vector<int64_t> shape;
  uint64_t bytes() const;  // fp32
};
// The tensors of a checkpoint in file order: model/<name> for every parameter, then
// optim/<name>/exp_avg and exp_avg_sq for each AdamW moment (named and shaped as `moments`).
std::vector<CheckpointTensor> checkpoint_tensors(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                                                 const std::vector<std::pair<std::string, torch::Tensor>>& moments);

struct CheckpointFileHandles;

// Rank 0's side of a checkpoint written by several ranks (and of write_checkpoint):
//  - the constructor creates <dir>/ckpt-<step>.h5.tmp with every attribute of `st` and `dims`, the
//    optimizer's step count, and every tensor's dataset allocated in the file but not written;
//  - the tensors' bytes then go to offset(i) (tensor_io.h's write_tensors), from any process that
//    opens the .tmp (each one fsyncs what it wrote);
//  - finish() sets each tensor's CRC32, writes train/ (data cursor, loss scale, RNG states), flushes
//    and fsyncs the file, renames it into place, updates `latest` and keeps the newest `keep`.
// A failure to create, write or finish the file (disk full, not writable) removes the .tmp and is
// a UsageError naming it; earlier checkpoints stay as they were. Destroyed unfinished (an error
// elsewhere), it removes the .tmp.
class CheckpointFile {
 public:
  CheckpointFile(const std::string& dir, const GPTDims& dims, int64_t steps_taken, const TrainState& st,
                 const std::vector<CheckpointTensor>& tensors);
  ~CheckpointFile();
  CheckpointFile(const CheckpointFile&) = delete;
  CheckpointFile& operator=(const CheckpointFile&) = delete;

  const std::string& tmp_path() const { return tmp_; }
  uint64_t offset(size_t tensor) const { return offsets_[tensor]; }
  std::string finish(const std::vector<uint32_t>& crcs, int64_t keep);
  // The bytes could not be written (`why`, from any rank): the .tmp is removed; the UsageError to throw.
  UsageError failed(const std::string& why);

 private:
  std::string dir_, path_, tmp_;
  TrainState state_;
  std::unique_ptr<CheckpointFileHandles> h5_;  // the open file and its datasets
  std::vector<uint64_t> offsets_;
  bool done_ = false;
};

// Test-only fault hook: SIGKILL when MPITRAIN_TEST_DIE_IN_SAVE names `step` (tests/fault_test.sh).
void maybe_die_in_save_for_test(int64_t step);

// snapshot_checkpoint(copy=false) + write_checkpoint, on the calling thread.
std::string save_checkpoint(const std::string& dir, GPT& model, AdamW& opt, const TrainState& st,
                            int64_t keep);

// Checkpoint saves for the training loop (checkpoint.async). save() is the loop's only stall:
//  - async: wait for the previous write (at most one in flight) and rethrow its error, copy the
//    state into the host snapshot buffers, start write_checkpoint on a background thread, return.
//    The buffers are allocated once, by prepare() at start-up (pinned for CUDA tensors, every page
//    touched), or else by the first save, and reused by every later save: no save pays for fresh
//    memory, so the first one stalls no longer than the others;
//  - sync:  snapshot without copies and write on the calling thread (= save_checkpoint).
// wait() waits for the write in flight and rethrows its error (UsageError for a full disk: exit 2
// as for a synchronous save); call it before the end of training and before exiting on a signal.
// Logs "checkpoint step N: snapshot X ms (async write started)" and "... written in Y ms".
class AsyncCheckpointWriter {
 public:
  AsyncCheckpointWriter(std::string dir, int64_t keep, bool async = true);
  ~AsyncCheckpointWriter();  // waits for a write in flight; an error then is logged, not thrown
  AsyncCheckpointWriter(const AsyncCheckpointWriter&) = delete;
  AsyncCheckpointWriter& operator=(const AsyncCheckpointWriter&) = delete;

  // Returns the path of the checkpoint (being) written.
  std::string save(GPT& model, const FullOptimState& opt, const TrainState& st);
  std::string save(GPT& model, AdamW& opt, const TrainState& st) { return save(model, full_state_of(opt), st); }
  // The general form, for state other than one rank's whole snapshot (state_sync.h's shares):
  // `snapshot` copies what is to be written into host memory (the loop's stall; nothing when
  // synchronous), `write` writes it and returns the path (on the background thread when async).
  std::string save_with(int64_t step, const std::function<void()>& snapshot, std::function<std::string()> write);
  void wait();
  const std::string& dir() const { return dir_; }
  int64_t keep() const { return keep_; }
  // Async: allocates the snapshot buffers for this model and optimizer state now (no-op when sync).
  void prepare(GPT& model, const FullOptimState& opt);

  bool async() const { return async_; }
  // Time the calling thread spent in save() (waiting for the previous write + snapshot, or the
  // whole write when synchronous), over all saves so far, and how many.
  double stalled_ms() const { return stalled_ms_; }
  int64_t saves() const { return saves_; }

 private:
  void join();  // joins the thread; its error (if any) stays in error_

  std::string dir_;
  int64_t keep_;
  bool async_;
  std::thread thread_;
  std::exception_ptr error_;  // written by the thread, read after join()
  std::shared_ptr<CheckpointSnapshot> buffers_;  // async: the host snapshot every save copies into
  double stalled_ms_ = 0;
  int64_t saves_ = 0;
};

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

// A checkpoint of another architecture than the model it is loaded into (n_layer, n_head, n_embd,
// seq_len, vocab_size): not damage, so resuming does not fall back to an older checkpoint.
struct ArchitectureMismatch : UsageError {
  using UsageError::UsageError;
};

// Loads parameters (and, when opt is given, AdamW moments and step count) and the training state.
// Every dataset's CRC32 is verified. An architecture other than the model's is
// ArchitectureMismatch naming the file and key; shape mismatches, missing datasets, wrong format
// or version, and checksum failures are UsageError naming the file and dataset. Non-finite
// values in the model or AdamW state are refused too.
void load_checkpoint(const std::string& path, GPT& model, AdamW* opt, TrainState& st);
// The same into `opt`'s tensors (allocated in whole-parameter shapes, named as the parameters).
void load_checkpoint(const std::string& path, GPT& model, FullOptimState* opt, TrainState& st);

// A checkpoint's tensors one at a time (`export`, `sample --stream`, a ZeRO-3 resume): what
// load_checkpoint reads and checks before any tensor (the architecture against `model`'s, which
// may be made deferred and hold no values; the training state into `st`; every parameter's
// dataset and shape, and with_optim AdamW's moments' too and the ranks' RNG states) is done by
// the constructor. read(k, part) reads named_params()[k]'s whole tensor (a tensor-parallel
// model's too: the whole parameter its shard is of) or one of its moments
// (fp32, host), its checksum and values verified: UsageError naming the file and dataset otherwise.
class CheckpointParams {
 public:
  enum class Part { param, exp_avg, exp_avg_sq };
  CheckpointParams(const std::string& path, GPT& model, TrainState& st, bool with_optim = false);
  torch::Tensor read(size_t k, Part part = Part::param);
  void verify_all();  // every tensor read once (and dropped): what a later read() can still fail on
  size_t size() const { return names_.size(); }
  const std::string& name(size_t k) const { return names_.at(k); }
  int64_t steps_taken() const { return steps_taken_; }  // with_optim: AdamW's step count

 private:
  std::string path_;
  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> shapes_;
  bool with_optim_ = false;
  int64_t steps_taken_ = 0;
};

}  // namespace mpitrain
