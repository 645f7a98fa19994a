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
// Streaming (arXiv 2501.18512; diloco.fragments F, diloco.overlap tau, diloco.mix alpha): the
// model's blocks are dealt into F fragments, strided as in the paper (block L in fragment L mod F;
// the parameters outside the blocks, embeddings, final norm and head, in fragment 0), the same
// in every layout, so every rank exchanges its values of one fragment at a time. Fragment p is
// synced after the steps t with t mod H = p H / F, so the link carries about 1/F of the part
// every H/F steps instead of all of it every H. With tau > 0 its exchange
// is a non-blocking collective started after step t and applied after step t + tau (training goes
// on meanwhile): the outer step as above, then the island goes on from
// alpha theta_island + (1 - alpha) theta_outer for that fragment. After the last step every
// exchange in flight is applied and every fragment synced once more at once (blocking), so the
// islands end equal. F = 1, tau = 0 is the DiLoCo above.
//
// What an outer step covers is what this rank updates: its optimizer's slots (whole parameters,
// tp shards, ZeRO-1/2 slices, ZeRO-3 shards), each paired with the same slots of the rank at its
// place in every other island (Mesh::islands()). Where the ranks of an island's dp group hold the
// same slots (ZeRO off), each reduces a 1/dp part of them across the islands and the island
// all-gathers the parts, so the link between islands carries every value once per island. Each
// rank keeps theta_outer and m for its part only, in fp32 on the parameters' device.
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "mpitrain/config.h"
#include "mpitrain/mesh.h"
#include "mpitrain/optim.h"

namespace mpitrain {

// "4 ranks = 2 islands x dp 2 x tp 1, optim.zero 0": a DiLoCo run's layout, as its state files
// record it and as a resume in another layout is refused.
std::string diloco_layout(int64_t world, int64_t islands, int64_t dp, int64_t tp, int64_t zero);

// The streaming fragment of the parameter `name` ("h.<L>.<...>": L mod fragments; else 0).
int64_t fragment_of(const std::string& name, int64_t fragments);

class Diloco {
 public:
  // `opt`'s slots as they are now are theta_outer's start, made the same on every island (island
  // 0's, broadcast); the caller then runs Parallelism::after_update(). `zero`: the ZeRO stage that
  // runs (0: every rank of the island's dp group holds the same slots). Collective over the world.
  // `n_layer`: the model's blocks (diloco.fragments <= n_layer, else UsageError naming it).
  Diloco(const DilocoConfig& cfg, Mesh& mesh, AdamW& opt, int zero, int64_t n_layer);
  ~Diloco();
  Diloco(const Diloco&) = delete;
  Diloco& operator=(const Diloco&) = delete;

  // After optimizer step `step` (1-based, just completed) of `total`: applies the exchanges due,
  // starts those of the fragments whose turn it is (tau = 0: applied at once), and after the last
  // step syncs everything. True when the slots changed: the caller then runs after_update().
  bool after_step(int64_t step, int64_t total);

  int64_t outer_steps() const { return outer_steps_; }  // exchanges applied (F per round of H steps)
  uint64_t bytes_sent() const { return bytes_; }  // this rank's bytes handed to the outer exchanges so far
  double seconds() const { return seconds_; }  // spent in outer steps so far (this rank): the steps' wait
  int64_t in_flight() const { return static_cast<int64_t>(pending_.size()); }

  // ---- checkpoints (docs/diloco.md) ----
  // A checkpoint ckpt-N.h5 of a DiLoCo run holds island 0's state (any tool reads it as a plain
  // checkpoint); beside it, ckpt-N.diloco/ holds one file per rank, rank-R.h5: its part of
  // theta_outer and the momentum, and its island's slots with their AdamW moments (written by the
  // first rank of each dp group that holds the same slots, else by every rank), and each exchange
  // still in flight (completed first: the islands' mean it brought, the step it is applied after).
  static std::string state_dir(const std::string& checkpoint_path);  // ckpt-N.h5 -> ckpt-N.diloco
  // This rank's file in `dir` (created if missing), written durably; then this rank's files of
  // all but the newest keep + 1 state directories beside it are removed (one spare: a checkpoint
  // whose main file was never completed). UsageError naming the file when it cannot be written.
  void save(const std::string& dir, int64_t step, int64_t keep);
  // A state of this rank's island that is not a parameter (the routing bias: each island moves
  // its own between outer steps): set before save() to be written beside the rest; set to a tensor
  // of its shape before load() and read after it, holding the file's values (unchanged when the file
  // has none).
  void set_island_state(const torch::Tensor& t) { island_state_ = t; }
  const torch::Tensor& island_state() const { return island_state_; }
  // This rank's state back from `dir`, written at `step` by a run of this very layout (UsageError
  // naming the file and what differs otherwise). The caller then runs after_update(). Collective
  // over the island's dp groups (ZeRO off: the first rank's slots and moments broadcast).
  void load(const std::string& dir, int64_t step);
  // "diloco: 2 islands of 1 ranks; an outer step every 100 steps and after the last (...); ..."
  std::string describe(int64_t total_params) const;

 private:
  // One fragment's exchange: started after one step, applied after `due`.
  struct Exchange {
    int64_t fragment = 0, due = 0;
    torch::Tensor wire, scale, all_q, all_scale;  // in flight (fp32/bf16: wire; int8: the four)
    std::vector<std::unique_ptr<Work>> works;
    torch::Tensor mean;                            // once complete: the islands' mean pseudo-gradient, fp32
  };

  using Ranges = std::vector<std::pair<int64_t, int64_t>>;  // [begin, end) in the slots' flat order
  torch::Tensor flat() const;                    // the slots, concatenated (fp32, on their device)
  torch::Tensor slots_range(int64_t at, int64_t n) const;         // flat()[at, at + n) without the rest
  void slots_write(int64_t at, const torch::Tensor& values);      // the reverse
  void write_back(const torch::Tensor& part);   // this rank's part -> the whole (island all-gather) -> the slots
  Ranges ranges(int64_t p, int64_t lo, int64_t hi) const;  // fragment p's values within [lo, hi)
  static int64_t count(const Ranges& r);
  torch::Tensor take(const torch::Tensor& part, int64_t p) const;  // fragment p of a part-sized tensor
  void put(torch::Tensor& part, int64_t p, const torch::Tensor& values) const;  // the reverse
  torch::Tensor take_slots(int64_t p) const;    // fragment p of this rank's part, from the slots
  void write_fragment(int64_t p, const torch::Tensor& values);  // -> the slots (island all-gather)

  void start(int64_t p, int64_t due);            // the pseudo-gradient of fragment p onto the wire
  void complete(Exchange& ex);                   // waits for it, ex.mean set
  void apply(Exchange& ex, bool mixing);         // the outer step on its fragment; the slots written
  void progress_start();                         // a thread moving the MPI exchanges in flight on
  void progress_stop();

  std::string file_of(const std::string& dir, int rank) const;
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
  std::vector<int64_t> slot_offset_, slot_fragment_;  // each slot's flat offset and fragment
  std::deque<Exchange> pending_;    // in flight, in the order started (= the order due)
  bool poll_ = false;               // MPI with MPI_THREAD_MULTIPLE: progress_ polls pending_
  std::thread poller_;
  std::atomic<bool> poll_stop_{false};
  torch::Tensor outer_, momentum_;  // this rank's part, fp32
  torch::Tensor error_;             // int8: what rounding left out, sent at the next outer step
  uint64_t bytes_ = 0;
  torch::Tensor island_state_;  // set_island_state
  int64_t outer_steps_ = 0;
  double seconds_ = 0;
};

}  // namespace mpitrain
