// DiLoCo between islands (arXiv 2311.08105; docs/diloco.md). The world is split into islands of
// consecutive ranks (layout.h); inside an island everything runs per step as without islands
// (data parallelism, ZeRO, tensor parallelism); between islands nothing runs per step. Every
// diloco.inner_steps (H) steps, and after the last, an outer step:
//   delta = theta_outer - theta_island                      (the pseudo-gradient, fp32)
//   delta = mean over the islands of delta                   (diloco.dtype on the wire: an fp32 or bf16
//                                                             all-reduce, or int8 blocks with error feedback)
//   m = mu m + delta;  theta_outer -= outer_lr (delta + mu m) (Nesterov SGD, PyTorch's, dampening 0)
// and every island continues from theta_outer; its inner optimizer's state stays its own.
//
// What an outer step covers is what this rank updates: its optimizer's slots (whole parameters,
// tp shards, ZeRO-1/2 slices, ZeRO-3 shards), each paired with the same slots of the rank at its
// place in every other island (Mesh::islands()). Where the ranks of an island's dp group hold the
// same slots (ZeRO off), each reduces a 1/dp part of them across the islands and the island
// all-gathers the parts, so the link between islands carries every value once per island. Each
// rank keeps theta_outer and m for its part only, in fp32 on the parameters' device.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mpitrain/config.h"
#include "mpitrain/mesh.h"
#include "mpitrain/optim.h"

namespace mpitrain {

// "4 ranks = 2 islands x dp 2 x tp 1, optim.zero 0": a DiLoCo run's layout, as its state files
// record it and as a resume in another layout is refused.
std::string diloco_layout(int64_t world, int64_t islands, int64_t dp, int64_t tp, int64_t zero);

class Diloco {
 public:
  // `opt`'s slots as they are now are theta_outer's start, made the same on every island (island
  // 0's, broadcast); the caller then runs Parallelism::after_update(). `zero`: the ZeRO stage that
  // runs (0: every rank of the island's dp group holds the same slots). Collective over the world.
  Diloco(const DilocoConfig& cfg, Mesh& mesh, AdamW& opt, int zero);

  // Whether an outer step follows optimizer step `step` (1-based, just completed) of `total`.
  bool due(int64_t step, int64_t total) const { return step % cfg_.inner_steps == 0 || step == total; }
  // The outer step: the slots then hold the new theta_outer; the caller runs after_update().
  void outer_step();

  int64_t outer_steps() const { return outer_steps_; }
  uint64_t bytes_sent() const { return bytes_; }  // this rank's bytes handed to the outer exchanges so far
  double seconds() const { return seconds_; }  // spent in outer steps so far (this rank)

  // ---- checkpoints (docs/diloco.md) ----
  // A checkpoint ckpt-N.h5 of a DiLoCo run holds island 0's state (any tool reads it as a plain
  // checkpoint); beside it, ckpt-N.diloco/ holds one file per rank, rank-R.h5: its part of
  // theta_outer and the momentum, and its island's slots with their AdamW moments (written by the
  // first rank of each dp group that holds the same slots, else by every rank).
  static std::string state_dir(const std::string& checkpoint_path);  // ckpt-N.h5 -> ckpt-N.diloco
  // This rank's file in `dir` (created if missing), written durably; then this rank's files of
  // all but the newest keep + 1 state directories beside it are removed (one spare: a checkpoint
  // whose main file was never completed). UsageError naming the file when it cannot be written.
  void save(const std::string& dir, int64_t step, int64_t keep) const;
  // This rank's state back from `dir`, written at `step` by a run of this very layout (UsageError
  // naming the file and what differs otherwise). The caller then runs after_update(). Collective
  // over the island's dp groups (ZeRO off: the first rank's slots and moments broadcast).
  void load(const std::string& dir, int64_t step);
  // "diloco: 2 islands of 1 ranks; an outer step every 100 steps and after the last (...); ..."
  std::string describe(int64_t total_params) const;

 private:
  torch::Tensor flat() const;                    // the slots, concatenated (fp32, on their device)
  void write_back(const torch::Tensor& part);   // this rank's part -> the whole (island all-gather) -> the slots

  std::string file_of(const std::string& dir, int rank) const;
  torch::Tensor int8_mean(const torch::Tensor& delta);  // diloco.dtype: int8 (error feedback in error_)
  static constexpr int64_t kInt8Block = 256;
  bool writes_inner() const { return !chunked_ || mesh_.dp_rank() == 0; }

  DilocoConfig cfg_;
  Mesh& mesh_;
  AdamW& opt_;
  int zero_ = 0;
  Communicator& islands_;
  std::vector<torch::Tensor> slots_;
  bool chunked_ = false;          // replicated over an island dp group of > 1 ranks
  int64_t total_ = 0, begin_ = 0, length_ = 0, chunk_ = 0;
  torch::Tensor outer_, momentum_;  // this rank's part, fp32
  torch::Tensor error_;             // int8: what rounding left out, sent at the next outer step
  uint64_t bytes_ = 0;
  int64_t outer_steps_ = 0;
  double seconds_ = 0;
};

}  // namespace mpitrain
