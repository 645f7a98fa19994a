// Activation checkpointing of the transformer blocks (train.activation_checkpointing,
// GPTDims::ac; docs/layouts.md).
//
// full: a checkpointed block keeps only its inputs for backward; backward runs the block a second
// time from them, with the first run's random state (dropout) and autocast, and backpropagates
// through that second run's graph. The same operations on the same values give the same
// gradients, bit for bit.
//
// selective (torchtitan's "op" policy: keep what is expensive to compute, recompute what is cheap
// and memory-hungry): the first run also keeps the outputs of the block's linear layers and its
// attention, the ops that call tape_linear and tape_attention. The second run recomputes the
// norms, rotary embeddings, activation functions, dropout and residual adds, and replays those
// ops from what the first run kept instead of running them again:
// - a linear layer's output comes back as the recorded tensor, with a backward that computes
//   PyTorch's own formulas for the matmul's gradients (derivatives.yaml's mm_mat1_backward and
//   mm_mat2_backward, the bias's sum_to) on the recomputed input, with autocast's casts made as
//   autocast made them: the same kernels on the same operands, so the same bits;
// - attention, where its kernel keeps O(T) per head for backward (scaled_dot_product_attention's
//   flash, memory-efficient or cuDNN kernel: the output and the log-sum-exp), keeps the graph of
//   its first run (recorded with gradients on detached copies of q, k and v): that kernel's own
//   saved tensors and its own backward, which the second run's graph calls through. Where it
//   keeps the T x T weights of every head (SDPA's math kernel; libtorch < 2.0's explicit
//   softmax), keeping it would keep most of what the block holds, so it is recomputed instead
//   (Megatron-LM's choice for its selective recomputation).
// What a selective block keeps: its input, every linear layer's output and, with a fused
// attention kernel, attention's q, k, v (for Llama the rotated copies of q and k besides the
// projections' outputs) and that kernel's saved tensors. What it gives up: the norms' outputs and
// statistics, the activation function's inputs and output, dropout's masks, the attention
// output's transposed copy (and an unfused attention's weights).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <vector>

namespace mpitrain {

// A block's forward on {x, delta} (delta: the fused path's pending MLP output, else undefined).
using BlockRun = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

// `run` under checkpointing (above): its outputs, connected to x and delta (and, through the
// second run, to the block's parameters) for backward.
std::vector<torch::Tensor> checkpointed_block(const BlockRun& run, const torch::Tensor& x, const torch::Tensor& delta,
                                              bool selective);

// A linear layer of a block: compute() is the layer (at::linear(x, weight, bias), or tensor
// parallelism's row-parallel product summed over the tp group, whose backward is the product's),
// x, weight and bias (undefined: none) its operands. Outside a selective block's runs it is
// compute(); in the first run its output is recorded, in the second replayed.
torch::Tensor tape_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                          const std::function<torch::Tensor()>& compute);

// Attention's core on q, k, v ([B, heads, T, head_dim]; no parameters inside): core(q, k, v)
// outside a selective block. In a selective block's first run, keeps(q) (asked with q as it
// needs gradients) says whether core's kernel keeps O(T) per head: then it is kept with its graph
// and replayed in the second run (uses_rng: core draws random numbers, dropout, which the second
// run then skips over); else it runs again in the second run.
using AttentionCore = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;
torch::Tensor tape_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool uses_rng,
                             const std::function<bool(const torch::Tensor&)>& keeps, const AttentionCore& core);

// Counters since the process started (tests: the checkpointing really happened): blocks run a
// second time in backward, and linear layers and attention cores replayed there (not run again).
int64_t recomputed_blocks();
// Whether this thread is running a checkpointed block a second time (in backward): what the first
// run recorded on the side (a mixture of experts' router log) is not recorded again.
bool recomputing();
int64_t replayed_linear_layers();
int64_t replayed_attention();

}  // namespace mpitrain
