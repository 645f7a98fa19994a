// Megatron-style tensor parallelism for the GPT of model.h (parallel.tp: N; Shoeybi et al. 2019).
//
// Inside a block, attention's QKV projection is column-parallel (each tp rank computes whole
// heads: n_head / tp of them) and its output projection row-parallel; the MLP's first projection
// is column-parallel and its second row-parallel. A column-parallel layer's input passes through
// tp_copy (identity forward, all-reduce of the gradient backward: Megatron's f), a row-parallel
// layer's output through tp_reduce (all-reduce forward, identity backward: g), after which the
// replicated bias is added once. So each attention and each MLP costs one all-reduce forward and
// one backward over the tp group. LayerNorms, the position embedding and the row-parallel biases
// are replicated: every tp rank computes the same gradient for them from the same inputs.
//
// The token embedding, tied to the output layer, is vocabulary-parallel: tp rank r holds rows
// [r V/tp, (r+1) V/tp). A lookup takes the rows this rank holds (zeros elsewhere) and all-reduces;
// the classifier computes this rank's slice of the logits only, and the cross-entropy combines
// the slices with a max and two sum all-reduces (vocab_parallel_cross_entropy), so the full
// logits never exist on one rank.
//
// Every parameter keeps its name; its shape is the tp rank's shard (tp_shard says which part of
// the whole parameter that is). With tp = 1 the model is exactly model.h's.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mpitrain/comm.h"

namespace mpitrain {

// Megatron's f: x forward; the gradient all-reduced (summed) over `tp` backward.
torch::Tensor tp_copy(const torch::Tensor& x, Communicator& tp);
// Megatron's g: x all-reduced (summed) over `tp` forward; the gradient unchanged backward.
torch::Tensor tp_reduce(const torch::Tensor& x, Communicator& tp);

// Rows idx of the whole [V, C] embedding whose rows [vocab_start, vocab_start + local.size(0))
// are `local` on this rank: each rank looks up the ids it holds, zeros for the others, and the
// sum over `tp` is the lookup (tp_reduce).
torch::Tensor vocab_parallel_embedding(const torch::Tensor& idx, const torch::Tensor& local, int64_t vocab_start,
                                       Communicator& tp);

// mean over rows of cross_entropy(logits, targets) where this rank holds the columns
// [vocab_start, vocab_start + local_logits.size(1)) of the [N, V] logits: the row maxima and the
// sums of exponentials are all-reduced (max, sum), and so is the target's logit (held by one rank).
// Differentiable: this rank's logits get (softmax - onehot) / N for its columns.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& local_logits, const torch::Tensor& targets,
                                           int64_t vocab_start, Communicator& tp);

// One row chunk of the same loss computed from hidden states (model.fused_loss: linear_cross_entropy
// with a tp communicator, model.h), so that not even this rank's slice of the logits exists whole:
// `logits` [rows, V / tp] are this rank's columns from `vocab_start` of the chunk's logits (fp32).
// The row maxima and the sums of exponentials and target logits are all-reduced over `tp`. Returns
// the sum of the rows' losses; with grad_scale != 0 `logits` becomes grad_scale * (softmax -
// onehot) over this rank's columns, the gradient of grad_scale * that sum.
torch::Tensor vocab_parallel_chunk_loss(torch::Tensor& logits, const torch::Tensor& targets, int64_t vocab_start,
                                       Communicator& tp, double grad_scale);

// What each rank of `ep` sends this one: `counts` [ep, n] (int64, on the CPU) holds this rank's row
// counts for each rank's n experts, the result rank q's for this rank's (an all-to-all of one row each).
torch::Tensor ep_exchange_counts(const torch::Tensor& counts, Communicator& ep);
// Expert parallelism's exchange (model.h's MoE), an all_to_all (comm.h) split in two so that work
// which needs no exchange runs while it is in flight: the constructor starts sending x's rows to
// the ranks of `ep`, send_rows[q] of them (in order) to rank q; wait() returns what every rank
// sent here, recv_rows[q] rows from rank q, in rank order. In backward the gradients go back the
// same way, started where wait() was called and finished where the exchange started, so the work
// between the two in forward also runs while they travel. Every rank of `ep` starts its exchanges
// in the same order.
struct EpPending;
class EpExchange {
 public:
  EpExchange(const torch::Tensor& x, std::vector<int64_t> send_rows, std::vector<int64_t> recv_rows, Communicator& ep);
  ~EpExchange();
  EpExchange(const EpExchange&) = delete;
  EpExchange& operator=(const EpExchange&) = delete;
  torch::Tensor wait();

 private:
  c10::intrusive_ptr<EpPending> pending_;
  torch::Tensor started_;
};
// Seconds this process has spent in those exchanges since it started (waiting included; an
// exchange in flight counts only its start and its wait).
double ep_collective_seconds();

// A communicator carried through an autograd function's arguments or saved data, as an integer.
int64_t comm_handle(Communicator& comm);
Communicator& comm_from_handle(int64_t handle);

// Which part of a whole GPT parameter a tp rank holds; each module declares it for the parameters
// it makes (TpDeclared, GPTImpl::tp_split in model.h).
enum class TpSplit {
  replicated,  // the whole tensor (LayerNorms, wpe, row-parallel biases)
  rows,        // dim 0 in tp equal blocks (column-parallel weights and biases: llama's q/k/v_proj by whole
               // heads, gate/up_proj; the vocabulary of wte and of an untied lm_head)
  qkv_rows,    // dim 0 as [q; k; v], each in tp equal blocks of whole heads (attention's c_attn)
  cols,        // dim 1 in tp equal blocks (row-parallel weights)
};

// Rank `rank`'s shard of the whole parameter `whole` (a view where it can be: rows, replicated).
torch::Tensor tp_shard(const torch::Tensor& whole, TpSplit split, int64_t rank, int64_t size);

// Where a tp rank's elements lie in the whole parameter: the flat elements [begin, begin + length)
// of its shard (of shape `shard`) as runs contiguous in the whole parameter (flat index `whole`),
// each starting at `local` elements from `begin`. One run for rows and replicated splits; one per
// q/k/v block for qkv_rows; one per row for cols. (Ranks writing their shards of a checkpoint.)
struct TpRun {
  int64_t whole, local, length;
};
std::vector<TpRun> tp_runs(TpSplit split, c10::IntArrayRef shard, int64_t rank, int64_t size, int64_t begin,
                           int64_t length);

// Seconds this process has spent in tensor-parallel all-reduces (tp_copy's backward, tp_reduce's
// forward, the cross-entropy's), since it started: what tensor parallelism costs a step.
double tp_collective_seconds();

// The shape of the whole parameter whose shards have shape `shard`, and the shards' shape of a
// whole parameter of shape `whole`.
std::vector<int64_t> tp_whole_shape(c10::IntArrayRef shard, TpSplit split, int64_t size);
std::vector<int64_t> tp_shard_shape(c10::IntArrayRef whole, TpSplit split, int64_t size);

// The whole parameter from every tp rank's `shard` (all ranks of `tp` call it): an all-gather,
// then the shards put back in their places.
torch::Tensor tp_unshard(const torch::Tensor& shard, TpSplit split, Communicator& tp);

}  // namespace mpitrain
