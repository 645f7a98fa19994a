// The GPT-2 family in libtorch: token + position embeddings, pre-LayerNorm blocks of causal
// self-attention and a GELU MLP, a final LayerNorm, and an output layer tied to the token
// embedding. GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer).
// With dims.fused_kernels the residual adds, LayerNorms and the MLP's bias + GELU run as the
// fused ops of fused_ops.h; the parameters (and so checkpoints) are the same either way.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mpitrain/config.h"
#include "mpitrain/fused_ops.h"

namespace mpitrain {

class Communicator;

struct GPTDims {
  int64_t n_layer = 0;
  int64_t n_head = 0;
  int64_t n_embd = 0;
  int64_t seq_len = 0;
  int64_t vocab_size = 0;
  double dropout = 0.0;
  bool fused_loss = false;  // classifier + cross-entropy fused and chunked (see linear_cross_entropy)
  int64_t fused_loss_rows = 0;  // rows per chunk of the fused loss (0: automatic; tests use small ones)
  bool fused_kernels = false;  // residual add + LayerNorm, bias + GELU as fused ops (fused_ops.h)
  // Tensor parallelism (tensor_parallel.h): this rank's place in its tp group of `tp` ranks, and
  // the group's communicator (not owned; set when tp > 1). n_head, 4 n_embd and vocab_size divide by tp.
  int64_t tp = 1, tp_rank = 0;
  Communicator* tp_comm = nullptr;
};

// The model's dimensions: the config's (presets already resolved by parse_config), vocab_size 0
// taking the data's. A model vocabulary smaller than the data's is a UsageError.
GPTDims model_dims(const ModelConfig& cfg, int64_t data_vocab_size);

// model.attention: restricts libtorch's scaled_dot_product_attention to the chosen kernel (auto:
// libtorch's own choice, unchanged) and returns which kernel runs for this model's attention on
// `device` with q/k/v in `dtype`, for the start-up line "attention: ...". A kernel that cannot run
// there (or a libtorch without SDPA, < 2.0, for anything but auto|math) is a UsageError naming the
// key. The choice is process-wide (libtorch's global context).
std::string configure_attention(const std::string& choice, const GPTDims& d, const torch::Device& device,
                                c10::ScalarType dtype);

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GPTDims& d);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};

 private:
  Communicator* tp_;  // tensor parallel: c_attn column-, c_proj row-parallel (null: tp = 1)
  int64_t n_head_, n_embd_;
  double dropout_;
  torch::Tensor causal_mask_;  // cached [T, T] mask for the explicit path (not a parameter)
};
TORCH_MODULE(CausalSelfAttention);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const GPTDims& d);
  torch::Tensor forward(const torch::Tensor& x);
  // The same with c_fc's bias add and the GELU as one bias_gelu (dims.fused_kernels).
  torch::Tensor forward_fused(const torch::Tensor& x);

  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};

 private:
  Communicator* tp_;  // tensor parallel: c_fc column-, c_proj row-parallel (null: tp = 1)
};
TORCH_MODULE(MLP);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GPTDims& d);
  torch::Tensor forward(torch::Tensor x);
  // dims.fused_kernels: each LayerNorm absorbs the residual add before it. Takes the residual
  // stream x (fp32) and the previous block's MLP output `delta` (undefined for the first block),
  // returns the stream after the attention add and this block's MLP output, still to be added.
  // `normed_dtype` is the dtype of the LayerNorm outputs (autocast's, else fp32).
  std::pair<torch::Tensor, torch::Tensor> forward_fused(const torch::Tensor& x, const torch::Tensor& delta,
                                                        c10::ScalarType normed_dtype);

  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  MLP mlp{nullptr};

 private:
  double dropout_;
};
TORCH_MODULE(Block);

class GPTImpl : public torch::nn::Module {
 public:
  explicit GPTImpl(const GPTDims& d);

  // idx: [B, T] int64 token ids (T <= seq_len) -> logits [B, T, vocab_size] (tensor parallel:
  // this rank's vocabulary slice of them, [B, T, vocab_size / tp]).
  torch::Tensor forward(const torch::Tensor& idx);
  // Mean cross-entropy of next-token prediction; targets [B, T]. With dims.fused_loss the
  // logits never exist in full (linear_cross_entropy); tensor parallel, never on one rank
  // (vocab_parallel_cross_entropy).
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets);

  const GPTDims& dims() const { return dims_; }
  // Parameters in a fixed order with stable names ("wte.weight", "h.0.attn.c_attn.weight", ...).
  std::vector<std::pair<std::string, torch::Tensor>> named_params() const;
  int64_t num_params() const;

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  void build_modules(const GPTDims& d);  // this rank's shapes (tensor parallel: its shards)
  torch::Tensor hidden(const torch::Tensor& idx);
  torch::Tensor hidden_fused(torch::Tensor x);  // blocks and ln_f with add_layernorm
  GPTDims dims_;
};
TORCH_MODULE(GPT);

// mean(cross_entropy(hidden @ weight^T, targets)) without materialising the [N, V] logits: the
// rows go through the vocabulary in chunks of about 256 MiB of logits (64 Mi in fp32; 128 Mi on
// the CUDA kernel path under 16-bit autocast, which keeps no fp32 copy), and, when gradients are
// wanted, the forward pass computes the gradients of hidden and weight in the same pass over
// each chunk (softmax minus one-hot), so the backward pass only scales them. Peak memory for
// the classifier is one chunk's logits instead of N x V floats several times over (GPT-2 at
// B=16, T=1024: 3.3 GB per fp32 copy). On CUDA, with the kernels built, each chunk's softmax,
// loss and gradient are one kernel over the logits in their autocast dtype
// (fused_softmax_cross_entropy); FusedImpl::reference forces the ATen path over an fp32 copy.
// hidden [N, C], weight [V, C], targets [N] (int64). `rows` overrides the chunk height
// (0 = automatic; tests use small ones).
// Tensor parallel (`tp` set): `weight` holds this rank's vocabulary rows from `vocab_start`, and
// `hidden` is the same on every tp rank (passed through tp_copy, which sums its gradient over the
// group); each chunk's loss and gradient combine the ranks' slices of its logits
// (vocab_parallel_chunk_loss, tensor_parallel.h), through ATen ops: the CUDA kernel needs the
// whole vocabulary.
torch::Tensor linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                   const torch::Tensor& targets, int64_t rows = 0,
                                   FusedImpl impl = FusedImpl::automatic, Communicator* tp = nullptr,
                                   int64_t vocab_start = 0);

// Autoregressive sampling from `prompt` (non-empty): `n` new tokens, temperature and top-k
// (0 = all), seeded so that the same call gives the same tokens.
std::vector<int64_t> generate(GPT& model, std::vector<int64_t> prompt, int64_t n,
                              double temperature, int64_t top_k, uint64_t seed);

// Byte tokens as printable text: `eot` as "\n<|endoftext|>\n", newlines, tabs and bytes from 32
// up kept, other tokens escaped as "\x..".
std::string decode_bytes(const std::vector<int64_t>& tokens, int64_t eot);

}  // namespace mpitrain
