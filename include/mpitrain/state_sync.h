// The distributed half of checkpointing: what the ranks exchange so that rank 0 writes one
// checkpoint of the whole training state, and so that any layout resumes from it.
//
// A checkpoint holds whole-parameter tensors whatever the layout (checkpoint.h). Under ZeRO-1
// (optim.zero: 1) each rank holds AdamW's moments for its slices only:
//  - save: gather_optim_state all-gathers one bucket's moments at a time (a transient buffer of
//    one padded bucket per rank) and rank 0 copies them into whole-parameter host tensors, so
//    rank 0 alone holds the full AdamW state, in host memory, while it writes;
//    (or, when every rank sees checkpoint.dir, each rank writes its own share: below);
//  - resume: rank 0 reads the file (ranks on other hosts need not see it) into whole-parameter
//    host tensors, then one bucket at a time is broadcast and every rank keeps its own slices.
// Parameters are whole on every rank in every layout and are broadcast from rank 0.
#pragma once

#include "mpitrain/mpi_ops.h"
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mpitrain/checkpoint.h"
#include "mpitrain/comm.h"
#include "mpitrain/grad_sync.h"
#include "mpitrain/model.h"
#include "mpitrain/optim.h"
#include "mpitrain/zero3.h"

namespace mpitrain {

// AdamW's state in whole-parameter shapes for the writer (rank 0 of opt's group). Unsharded: the
// optimizer's own tensors (every rank). Sharded: collective over `shards`' communicator; rank 0
// gets host fp32 tensors, the other ranks an empty state. `reuse` (rank 0, sharded): host tensors
// of an earlier gather to fill again instead of allocating (the training loop keeps them between
// saves, so that no save pays for fresh memory); filled on first use.
FullOptimState gather_optim_state(AdamW& opt, const GradSync* shards, GPT& model, FullOptimState* reuse = nullptr);
// Tensor parallel: the whole model's parameters and AdamW moments, assembled from the tp ranks'
// shards (tp_unshard over `tp`, after gather_optim_state over the dp group when sharded) by the
// ranks of rank 0's tp group; rank 0 copies them into `whole` (a dense model of the same
// dimensions, host) and `whole_state` (host_optim_state_like(whole)). Every rank calls it.
// `units` (ZeRO-3): the parameters are gathered over the dp group one unit at a time
// (ParamShards::for_each_unit_whole) and unsharded over tp while their unit is whole.
void gather_tp_state(GPT& model, AdamW& opt, const GradSync* shards, Communicator& tp, bool first_tp_group,
                     GPT* whole, FullOptimState* whole_state, ParamShards* units = nullptr);
// Expert parallelism: the whole model's parameters and AdamW moments, the experts gathered from the
// ranks of rank 0's ep group (`ep`; `first_ep_group`: this rank is one of them) into rank 0's
// `whole` (a model of ep 1, host) and `whole_state` (host_optim_state_like(whole)). ZeRO-1/2/3
// (`shards`: the shared parameters' sharded GradSync, `opt` its AdamW with the experts whole): their
// moments are first gathered over its dp group, one bucket at a time. Tensor parallelism (`tp`):
// each tensor is made whole over the tp group before the experts' gather (the first
// ep group of every tp rank takes part). Every rank calls it (without `shards` the ranks outside
// the first ep group return at once).
// ZeRO-3 (`units`, over the shared parameters): their values are gathered one unit at a time too.
void gather_ep_state(GPT& model, AdamW& opt, Communicator& ep, bool first_ep_group, GPT* whole,
                     FullOptimState* whole_state, const GradSync* shards = nullptr, Communicator* tp = nullptr,
                     ParamShards* units = nullptr);
// The whole model's parameters: names and shapes, in order (pipeline parallelism: every rank's
// list, of which no stage holds all).
using ParamShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;
// Pipeline parallelism (`opt` unsharded: slot k is parameter k): the whole model's parameters and
// AdamW moments, each sent by the stage that holds it (pipeline.h's stage_of; a tied embedding's by
// the first stage) to rank 0 of `pp` (the first pipeline: Mesh::pp_mpi() of the dp rank 0 ranks,
// which call it), one tensor at a time, into rank 0's `whole` (the whole model, host) and
// `whole_state`. `names`: the whole model's (whole's order).
// ZeRO-1/2 (`stage_moments`: gather_optim_state over the stage's dp group, on its dp rank 0): the
// moments from there. Tensor parallel (`tp`: the stage's tp group, every rank of which calls it):
// each tensor made whole over it first (tp_unshard), then sent by tp rank 0's pipeline.
void gather_pp_state(GPT& model, AdamW& opt, MpiComm pp, const ParamShapes& names, GPT* whole, FullOptimState* whole_state,
                     const FullOptimState* stage_moments = nullptr, Communicator* tp = nullptr);
// Whole-parameter host fp32 tensors (zeros) for AdamW's moments, named as the parameters.
FullOptimState host_optim_state_like(GPT& model);

// ---- ranks writing one checkpoint together ----
//
// When the state is spread over the ranks, the ranks that hold it write it straight into the one
// checkpoint file, all at once, instead of gathering it on rank 0: under ZeRO-1 every rank its
// slices of the parameters and of AdamW's moments; under tensor parallelism the ranks of rank 0's
// tp group their shards (with ZeRO-1: every rank its slices of its shards), each shard's elements
// as the runs they form in the whole tensor (tp_runs), the replicated parameters by tp rank 0. This
// needs every rank to see checkpoint.dir (Startup::checkpoint_dir_blind_rank). No rank holds more
// than its share in host memory, and the bytes leave through every writing rank's copy, checksum
// and write path (and every node's link to a parallel filesystem). The file is byte for byte the
// one rank 0 alone would write (tests/test_train.cpp), so any layout loads it.

// This rank's part of a checkpoint: pieces of the file's tensors (checkpoint_tensors order: whole
// shapes), each the elements [begin, begin + data.numel()) of tensor `tensor`, host fp32 1-D.
struct CheckpointShare {
  struct Piece {
    size_t tensor = 0;
    int64_t begin = 0;
    torch::Tensor data;
  };
  GPTDims dims;                           // the whole model's (tp 1)
  std::vector<CheckpointTensor> tensors;  // every tensor of the file: the same on every rank
  std::vector<Piece> pieces;              // this rank's; views of the host buffers below
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;  // (live state, flat; its host buffer)
  bool built = false;                     // the host buffers exist (copying shares)
  int64_t steps_taken = 0;
  TrainState state;  // rank 0's goes into the file
};

// This rank's share of the state of `model` and `opt`: with `shards` (ZeRO-1: its GradSync) the
// owned slices; without, the whole local tensors when `holds_unsharded` (the ranks of rank 0's tp
// group), else nothing. copy: into host buffers (pinned for CUDA tensors), allocated on the first
// call and reused by later ones; else the pieces reference the state where it already is host fp32
// (a synchronous write on the calling thread).
// Pipeline parallelism (`whole`: the whole model's names and shapes): the file is the whole model's,
// of which this stage's rank writes the tensors its stage holds (a tied embedding: the first stage).
// Expert parallelism (`whole` too; `expert[k]`: parameter k is one of this rank's experts, which
// it writes whole when `holds_experts`, the ranks of the first ep group; the other parameters as
// above, AdamW's slots past the GradSync's slices being the experts).
void share_checkpoint(CheckpointShare& into, GPT& model, AdamW& opt, const GradSync* shards, bool holds_unsharded,
                      const TrainState& st, bool copy, const ParamShapes* whole = nullptr,
                      const std::vector<bool>* expert = nullptr, bool holds_experts = false);

// Writes one checkpoint from every rank's share; collective over `comm` (each rank passes its share
// of the same step). Rank 0 creates the file (CheckpointFile: attributes, every dataset allocated)
// and broadcasts where each tensor's bytes go; every rank writes its pieces there (write_tensors:
// direct I/O, CRC32 per piece) and fsyncs them; rank 0 gathers the pieces' CRC32s, checks that
// they cover every tensor exactly once, combines them into each tensor's CRC32 and finishes the
// file (fsync, rename, `latest`, keep). A failure on any rank (disk full, not writable) removes the
// .tmp and ends the save on every rank: rank 0 throws the UsageError naming the first failing rank,
// the others ReportedUsageError (one message, exit 2). Returns the checkpoint's path.
std::string write_checkpoint_shares(const std::string& dir, const CheckpointShare& share, int64_t keep, MpiComm comm);

// One save through `writer` with every rank writing its share (every rank calls it at the same
// step). Async: the loop stalls for share_checkpoint's copies into `buffers` (kept by the caller
// between saves, alive until the writer is gone), and write_checkpoint_shares runs on the
// writer's thread, so `comm` must be a communicator no other thread uses (CommDup) and MPI must
// provide MPI_THREAD_MULTIPLE. `shards` and `holds_unsharded` as share_checkpoint.
std::string save_shares(AsyncCheckpointWriter& writer, CheckpointShare& buffers, GPT& model, AdamW& opt,
                        const GradSync* shards, bool holds_unsharded, const TrainState& st, MpiComm comm,
                        const ParamShapes* whole = nullptr, const std::vector<bool>* expert = nullptr,
                        bool holds_experts = false);

// A communicator of its own for one purpose (the checkpoint writer's collectives on a background
// thread never meet the training loop's): MPI_Comm_dup, freed with the object. Collective.
class CommDup {
 public:
  explicit CommDup(MpiComm comm);
  ~CommDup();
  CommDup(const CommDup&) = delete;
  CommDup& operator=(const CommDup&) = delete;
  MpiComm get() const { return comm_; }

 private:
  MpiComm comm_ = MpiComm{};
};

// Every rank's RNG state, gathered (all ranks call; rank 0 keeps them for the checkpoint).
std::vector<std::vector<uint8_t>> gather_rng_states(Communicator& comm, const torch::Device& device);

// Loads the first loadable of `candidates` on rank 0 and gives every rank its part: parameters,
// AdamW state (whole or, with `shards`, this rank's slices), the training state, the fp16 loss
// scale and the RNG streams (restored per rank when the world size and kind of device are
// unchanged, else reseeded from `seed`). A corrupt newest checkpoint (checksum, truncation)
// falls back to the previous one, with a warning; an explicitly named checkpoint must load.
// ZeRO-3 (`param_shards`: ParamShards::param_shards(), tp 1): rank 0 loads into a whole model in
// host memory and each rank receives its parameter shards one unit at a time; `model`'s
// parameters are not written (they need not be whole). Expert parallelism (`model`'s dims.ep > 1,
// any optim.zero): rank 0 opens the file with `whole` (its model of ep 1) and hands every rank of
// each ep group its experts (ZeRO-1/2/3: `shards` over the shared parameters, whose moments, and
// under ZeRO-3 values, each rank keeps its slices of). Pipeline parallelism (`model`'s dims.pp > 1;
// `pp_names`: the whole model's names and shapes): rank 0 opens the file with `whole`, every tensor
// goes to every rank and each stage keeps its own. Returns the file loaded (rank 0; "" elsewhere).
std::string resume_from(const std::vector<std::string>& candidates, GPT& model, AdamW& opt, const GradSync* shards,
                 TrainState& st, Communicator& comm, MpiComm mpi_comm, uint64_t seed, const torch::Device& device,
                 const std::vector<torch::Tensor>* param_shards = nullptr, GPT* whole = nullptr,
                 const ParamShapes* pp_names = nullptr);

}  // namespace mpitrain
