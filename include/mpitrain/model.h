// The decoder language models in libtorch, GPT-2 and Llama as two configurations of one block made
// of parts (GPTDims says which):
//   norm       LayerNorm with bias (gpt2)          | RMSNorm in fp32, weight only (llama)
//   positions  learned wpe added to the embedding  | rotary on q and k, Hugging Face's half-split layout
//   attention  one c_attn [q; k; v] with biases    | q_proj, k_proj, v_proj (n_kv_head heads: grouped-
//              (n_head heads each)                 |   query attention), biases on them only with qkv_bias
//              of n_embd / n_head each             |   (Qwen2); heads of head_dim each (Qwen3: 128 at any
//                                                  |   width); with qk_norm an RMSNorm over each head's
//                                                  |   q and k before rotary (Qwen3's q_norm, k_norm)
//   MLP        c_fc -> GELU (tanh) -> c_proj,      | SwiGLU: c_proj(silu(gate_proj x) * up_proj x),
//              4 n_embd units, biases              |   intermediate_size units, no biases (Gemma: GeGLU,
//                                                  |   the GELU (tanh) for silu)
//   output     tied to the token embedding         | tied, or its own lm_head (tie_embeddings false)
// The llama block's Gemma 2 parts (Family::gemma_norms and ModelArgs' soft caps, model_fields.h):
// RMSNorm as x (1 + w) in fp32, a norm after the attention and after the MLP as well as before
// them (post_attn_norm, post_mlp_norm), the embedding times sqrt(n_embd), the attention scores
// and the output logits soft-capped (cap tanh(x / cap)), the query scaled by
// 1 / sqrt(query_pre_attn_scalar), and an attention window on layers 0, 2, 4, ... (any length:
// those layers mask keys more than the window - 1 positions back). Gemma 3's: the same norms
// (its q/k norms x (1 + w) too), windows on five layers of six, which rotate by a base of their
// own (rope_local_theta).
// Each module declares, where it makes a parameter, which part of it a tensor-parallel rank holds
// (TpDeclared below; GPTImpl::tp_split answers by full name). Every other path (ZeRO-1,
// checkpoints, export) reads the parameters by name; the names are GPT-2's where the role is the
// same (attn.c_proj is Llama's o_proj, mlp.c_proj its down_proj). Initialisation as GPT-2's: N(0, 0.02), residual projections
// (c_proj) scaled by 1/sqrt(2 n_layer), norms one, biases zero.
// With RunOptions::fused_kernels the residual adds and norms (LayerNorm | RMSNorm), the MLP's bias + GELU |
// SwiGLU and the rotary embedding (llama) run as the fused ops of fused_ops.h; the parameters
// (and so checkpoints) are the same either way.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mpitrain/checkpointing.h"
#include "mpitrain/config.h"
#include "mpitrain/fused_ops.h"
#include "mpitrain/model_fields.h"  // GPTDims
#include "mpitrain/tensor_parallel.h"

namespace mpitrain {

class Communicator;

// The model's dimensions: the config's (presets already resolved by parse_config). vocab_size 0
// pads the data's vocabulary up to a multiple of `pad_multiple` (model.vocab_multiple, resolved
// by the caller, times tp), the padded rows outside the loss (vocab_live). A model vocabulary
// smaller than the data's is a UsageError.
GPTDims model_dims(const ModelConfig& cfg, int64_t data_vocab_size, int64_t pad_multiple = 1);
// model.vocab_multiple 0 (automatic): 64 on CUDA (tensor-core tiles, as nanoGPT's 50304), 1 on
// the CPU (padding buys nothing there); either times the tp degree, which splits the rows.
int64_t vocab_pad_multiple(const ModelConfig& cfg, bool cuda, int64_t tp);

// The expert of a named_params() name: E for "h.<L>.mlp.experts.<E>.<...>", -1 for any other
// parameter; and the same name for expert `e` (expert parallelism: the same parameter of the
// experts another rank of the ep group holds).
int64_t expert_of(const std::string& name);
std::string with_expert(const std::string& name, int64_t e);

// The block of a named_params() name: L for "h.<L>.<...>", -1 for the parameters outside the
// blocks (embeddings, final norm, head).
int64_t block_of(const std::string& name);

// model.attention: restricts libtorch's scaled_dot_product_attention to the chosen kernel (auto:
// libtorch's own choice, unchanged) and returns which kernel runs for this model's attention on
// `device` with q/k/v in `dtype` (a rank's heads: n_head / tp), for the start-up line "attention:
// ...". A kernel that cannot run there (or a libtorch without SDPA, < 2.0, for anything but
// auto|math) is a UsageError naming the key. The choice is process-wide (libtorch's global context).
std::string configure_attention(const std::string& choice, const GPTDims& d, int64_t tp, const torch::Device& device,
                                c10::ScalarType dtype);

// A module that declares, where it makes its parameters, how tensor parallelism splits them
// (TpSplit); what it does not declare every tp rank holds whole. GPTImpl gathers the declarations
// of all its modules by full parameter name (GPTImpl::tp_split).
class TpDeclared {
 public:
  // (local name, split): a parameter of this module ("c_proj.weight"), or a submodule's name for
  // all of that submodule's parameters ("q_proj": weight and bias).
  const std::vector<std::pair<std::string, TpSplit>>& tp_declared() const { return declared_; }

 protected:
  void tp_declare(std::string local, TpSplit split) { declared_.emplace_back(std::move(local), split); }

 private:
  std::vector<std::pair<std::string, TpSplit>> declared_;
};

// LayerNorm over the last dimension (weight and bias; GPT-2), or RMSNorm (weight only; Llama):
// x / sqrt(mean(x^2) + eps) computed in fp32, cast back to x's dtype, times the weight, as
// Hugging Face's LlamaRMSNorm.
// `partial_grad` (tensor parallel, the q/k norms): every tp rank holds the whole weight but
// normalises only its own heads, so the weight's gradient is summed over that group (tp_copy).
// `unit_offset` (Gemma): RMSNorm times (1 + weight) in fp32, then cast; the weight starts at 0.
class NormImpl : public torch::nn::Module {
 public:
  NormImpl(int64_t dim, bool rms, double eps, Communicator* partial_grad = nullptr, bool unit_offset = false);
  torch::Tensor forward(const torch::Tensor& x);
  void set_partial_grad(Communicator* group) { partial_grad_ = group; }  // (GPT::parallelize)
  // RunOptions::fused_kernels: the residual add before the norm and the norm as one op (add_layernorm or
  // add_rmsnorm, fused_ops.h): {x + delta (fp32), norm(x + delta) in out_dtype}; delta may be undefined.
  std::pair<torch::Tensor, torch::Tensor> add_forward(const torch::Tensor& x, const torch::Tensor& delta,
                                                      c10::ScalarType out_dtype);

  torch::Tensor weight, bias;  // bias: LayerNorm only
  const bool rms;
  const double eps;
  const bool unit_offset;

 private:
  Communicator* partial_grad_;
};
TORCH_MODULE(Norm);

// Rotary position embedding tables (Llama): cos and sin [seq_len, head_dim] in fp32, each
// frequency twice (the half-split layout: dimension i pairs with i + head_dim / 2), with Llama
// 3.1's frequency scaling when dims.rope_scaling is llama3, each frequency / rope_factor when it is
// linear. `local`: Gemma 3's windowed layers' table (base rope_local_theta, unscaled). Computed
// once per device.
class Rotary {
 public:
  explicit Rotary(const GPTDims& d, bool local = false);
  // q or k [B, T, heads, head_dim] rotated by position: x cos + rotate_half(x) sin, with the
  // tables in x's dtype (Hugging Face's roundings); set_fused (RunOptions::fused_kernels) as the
  // fused op `rotary` (fused_ops.h), which rounds alike.
  torch::Tensor apply(const torch::Tensor& x);
  void set_fused(bool fused) { fused_ = fused; }
  const torch::Tensor& inv_freq() const { return inv_freq_; }

 private:
  torch::Tensor inv_freq_, cos_, sin_;  // cos_/sin_ on the device last used
  int64_t seq_len_;
  bool fused_ = false;
};

class CausalSelfAttentionImpl : public torch::nn::Module, public TpDeclared {
 public:
  // Block `layer`'s attention (its window: ModelArgs::window_of_layer).
  CausalSelfAttentionImpl(const GPTDims& d, std::shared_ptr<Rotary> rotary, int64_t layer = 0);
  torch::Tensor forward(const torch::Tensor& x);
  // Tensor parallel (GPT::parallelize, which has replaced the parameters by their shards): this
  // rank's n_head / tp and n_kv_head / tp heads, q/k/v column- and c_proj row-parallel.
  void parallelize(const TpPlace& tp);

  // gpt2: c_attn ([q; k; v]); llama: q_proj, k_proj, v_proj. Both: c_proj, the output projection.
  torch::nn::Linear c_attn{nullptr}, q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, c_proj{nullptr};
  Norm q_norm{nullptr}, k_norm{nullptr};  // llama with qk_norm: RMSNorm over head_dim, whole on every tp rank

 private:
  // q, k, v ([B, heads, T, head_dim]) to the attention output: the causal softmax and dropout p.
  torch::Tensor core(const torch::Tensor& q, torch::Tensor k, torch::Tensor v, double p);
  // Whether this attention is the plain causal one (scaled_dot_product_attention's): no soft cap,
  // no window that cuts T tokens, the 1 / sqrt(head_dim) scale.
  bool plain(int64_t T) const { return softcap_ == 0 && (window_ == 0 || window_ >= T) && scale_ == 0; }
  // The other (Gemma's; Mistral's cutting window on libtorch 1.x): scores q k^T scaled, soft-capped, masked (causal and window), softmax
  // in fp32 and cast back, as Hugging Face's eager attention.
  torch::Tensor capped_core(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double p);
  Communicator* tp_ = nullptr;  // tensor parallel: q/k/v column-, c_proj row-parallel (null: tp = 1)
  int64_t n_head_, n_kv_head_, head_dim_;  // this rank's heads (tensor parallel: its share)
  double dropout_;
  int64_t window_;  // this layer's attention window (0: none)
  double softcap_;  // the scores' soft cap (0: none)
  double scale_;    // the scores' scale (0: 1 / sqrt(head_dim))
  bool whole_qk_norm_ = false;  // OLMoE: q_norm and k_norm over the whole projections, not per head
  std::shared_ptr<Rotary> rotary_;  // llama; null for gpt2
  torch::Tensor causal_mask_;  // cached [T, T] mask for the explicit path (not a parameter)
};
TORCH_MODULE(CausalSelfAttention);

class MLPImpl : public torch::nn::Module, public TpDeclared {
 public:
  explicit MLPImpl(const GPTDims& d);
  torch::Tensor forward(const torch::Tensor& x);
  // Tensor parallel (GPT::parallelize): c_fc (gate/up) column-, c_proj row-parallel over tp.
  void parallelize(const TpPlace& tp) { tp_ = tp.sharded() ? tp.comm : nullptr; }
  // RunOptions::fused_kernels: the same with c_fc's bias add and the GELU as one bias_gelu (gpt2), or
  // silu(gate) * up as one swiglu (llama).
  torch::Tensor forward_fused(const torch::Tensor& x);
  // Tensor parallel, llama block: this rank's share of forward(x) for an x already through
  // tp_copy, before the sum over the tp group (a mixture of experts sums all its experts' at once).
  torch::Tensor forward_partial(const torch::Tensor& x);

  // gpt2: c_fc; llama: gate_proj and up_proj. Both: c_proj, the projection back to the width.
  torch::nn::Linear c_fc{nullptr}, gate_proj{nullptr}, up_proj{nullptr}, c_proj{nullptr};

 private:
  torch::Tensor gated(const torch::Tensor& in);  // llama block: act(gate_proj(in)) x up_proj(in)
  bool geglu_;        // llama block: the gate's GELU (tanh) instead of silu (Gemma)
  Communicator* tp_ = nullptr;  // tensor parallel: c_fc / gate / up column-, c_proj row-parallel (null: tp = 1)
};
TORCH_MODULE(MLP);

// What the routers of one forward chose (GPT's, shared by its MoE layers; cleared by each forward):
// per layer the sum over tokens of the router's probabilities [E] (connected to the router for
// backward), the tokens each expert got [E] (int64, summed over the k choices) and the tokens.
// With a capacity factor, also the token copies every sparse layer dropped and routed.
struct RouterLog {
  std::vector<torch::Tensor> prob_sums, counts;
  int64_t rows = 0;
  int64_t dropped = 0, copies = 0;
  void clear() { prob_sums.clear(), counts.clear(), rows = 0, dropped = 0, copies = 0; }
};

// A mixture of experts in place of the llama block's MLP (ModelArgs::moe_layer; Qwen3-MoE's
// sparse block): router `gate` (a linear layer to the experts' logits, no bias), the softmax in
// fp32, the top k per token, their weights renormalised where the family's field says so, then
// cast to the input's dtype (ModelArgs' expert fields); each expert a SwiGLU MLP of its own size (MLP:
// gate_proj, up_proj, c_proj = Hugging Face's down_proj). Dropless: the token copies are grouped
// by expert and each expert's group goes through its weights in one GEMM each (an expert without
// tokens gets an empty product, so every parameter has a gradient); the outputs, times their
// weights, are summed back per token. Under activation checkpointing the block's second run (in
// backward) does not log again (recomputing()).
// Tensor parallelism (GPT::parallelize): the router is replicated (every rank of the tp group routes the
// same tokens alike) and each expert split as the dense MLP is (gate/up by their units, c_proj by
// its inputs); the grouped rows enter through one tp_copy and the experts' partial outputs leave
// through one tp_reduce for the whole layer (not one per expert; under ep one for this rank's own
// rows and one for the others').
// Expert parallelism (dims.ep > 1): this rank holds its ep group's share of the experts (named by
// their index in the whole layer); each token copy goes to the rank holding its expert and comes
// back by all-to-all over the ep group, so every rank of the group must run each sparse layer's
// forward (and backward) together. The copies this rank routes to its own experts stay here:
// those of its first half of experts run while the others' copies travel here, the rest while the
// outputs travel back (EpExchange both ways; in backward, while their gradients travel).
class MoEImpl : public torch::nn::Module {
 public:
  MoEImpl(const GPTDims& d, RouterLog* log);
  torch::Tensor forward(const torch::Tensor& x);
  void parallelize(const TpPlace& tp);  // (GPT::parallelize, which switches its experts' MLPs too)

  torch::nn::Linear gate{nullptr};
  std::shared_ptr<torch::nn::Module> experts;  // this rank's experts, each an MLP named by its index
  std::vector<MLP> local;                      // the same, in order: experts first .. first + local.size() - 1
  int64_t first = 0;
  // The run's capacity and balancing (GPT::apply): capacity_factor, z_loss_coef, and routing_bias,
  // which makes routing_bias below (zeros where it has none) or drops it.
  void configure(const RunOptions& run);
  // In training, the last forward's router probabilities summed over its tokens [E], then with
  // a z-loss coefficient the sum of its tokens' logsumexp(router logits)^2 (one more element) (what the
  // router log holds; a checkpointed block returns it as an output of its own: GPTImpl::hidden).
  torch::Tensor prob_sums;
  // RunOptions::routing_bias: the bias [E] (fp32) added to the router's probabilities to choose the top k
  // (not to weigh them): DeepSeek-V3's aux-loss-free balancing, moved by GPT::update_routing_bias.
  torch::Tensor routing_bias;

 private:
  // The grouped rows' outputs through this rank's experts [begin, end): rows [n, C] sorted by
  // expert, count[e] of expert e's (the rows begin with expert begin's).
  torch::Tensor run_local(const torch::Tensor& grouped, const int64_t* count, size_t begin = 0, size_t end = SIZE_MAX);
  torch::Tensor run_parallel(const torch::Tensor& grouped, const torch::Tensor& host_counts);
  int64_t top_k_, num_experts_;
  double capacity_factor_ = 0;  // RunOptions::capacity_factor (0: dropless)
  bool norm_topk_;
  bool z_loss_ = false;         // RunOptions::z_loss_coef > 0
  Communicator* ep_ = nullptr;  // dims.ep_comm (ep > 1)
  Communicator* tp_ = nullptr;  // parallelize()'s (tp > 1)
  RouterLog* log_;  // GPT's (not owned)
};
TORCH_MODULE(MoE);

class BlockImpl : public torch::nn::Module {
 public:
  // `log`: the GPT's router log, for a layer whose MLP is a mixture of experts.
  BlockImpl(const GPTDims& d, std::shared_ptr<Rotary> rotary, int64_t layer = 0, RouterLog* log = nullptr);
  torch::Tensor forward(torch::Tensor x);
  // RunOptions::fused_kernels: each norm absorbs the residual add before it. Takes the residual
  // stream x (fp32) and the previous block's MLP output `delta` (undefined for the first block),
  // returns the stream after the attention add and this block's MLP output, still to be added.
  // `normed_dtype` is the dtype of the norm outputs (autocast's, else fp32).
  std::pair<torch::Tensor, torch::Tensor> forward_fused(const torch::Tensor& x, const torch::Tensor& delta,
                                                        c10::ScalarType normed_dtype);

  Norm ln_1{nullptr}, ln_2{nullptr};
  Norm post_attn_norm{nullptr}, post_mlp_norm{nullptr};  // Gemma: after the attention and after the MLP
  CausalSelfAttention attn{nullptr};
  MLP mlp{nullptr};
  MoE moe{nullptr};  // in mlp's place (registered as "mlp") on a sparse layer

 private:
  torch::Tensor ffn(const torch::Tensor& x);  // the MLP or the experts
  double dropout_;
};
TORCH_MODULE(Block);

// Where the parameters of a sharded model (ZeRO-3, zero3.h) are made whole and given back: the
// model calls these around each block (forward, and again before the block's backward: a block's
// output passes through an identity whose backward asks for the block), and before anything else
// of its forward for the parameters outside the blocks (embeddings, final norm, output layer).
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void need_outside_blocks() = 0;  // before the forward: wte, wpe, ln_f, lm_head whole
  // Before block `block` runs: in forward (the next block to run is block + 1), or in backward
  // (then block - 1), which lets the parameters of the next one be fetched meanwhile.
  virtual void need_block(int64_t block, bool backward) = 0;
  virtual void done_with_block(int64_t block) = 0;  // after block `block`'s forward
};

// A parameter without its values (GPT made `deferred`, a block of `sample --stream` put away):
// its shape kept, its memory one element expanded to that shape. param_has_values: whether it
// holds every element's memory.
void drop_param_values(const torch::Tensor& p);
void drop_param_values(const torch::Tensor& p, c10::IntArrayRef shape);  // ... at `shape` (a tp shard's)
bool param_has_values(const torch::Tensor& p);

class GPTImpl : public torch::nn::Module, public TpDeclared {
 public:
  // `deferred` (ZeRO-3): the modules are made (their own draws included) but every parameter is
  // left without memory, one block at a time, so that no whole model ever exists; initialize()
  // then draws the values the model would have had, one parameter at a time.
  // It runs with RunOptions' defaults (unfused, no checkpointing, dropless) until apply().
  explicit GPTImpl(const GPTDims& d, bool deferred = false);

  // Tensor parallelism applied to the built model, as torchtitan's parallelize applies it: every
  // parameter a module declared split (tp_split) replaced by this rank's shard of it (its values,
  // or its shape alone in a deferred model, whose initialize() then gives the shards of the whole
  // draws), and each module switched to its sharded path (its share of the heads and hidden
  // units, the all-reduces of tp.comm). Once, before the optimizer takes the parameters and
  // before the model moves to its device; tp.size 1 changes nothing.
  void parallelize(const TpPlace& tp);
  const TpPlace& tp() const { return tp_; }

  // How the built model runs from the next call on (the fused paths, activation checkpointing,
  // the experts' capacity and balancing): what Parallelism and the step apply, as torchtitan's
  // parallelize applies its own, not part of what the model is. Refuses by name a switch this
  // model has no path for (Gemma's norms unfused, a soft-capped loss unfused, a pipeline stage's
  // blocks unfused).
  void apply(const RunOptions& run);
  const RunOptions& run() const { return run_; }

  // A deferred model's initial values: named_params()[k]'s values (after parallelize, this rank's
  // tp shard of the whole parameter, drawn as a model made without `deferred` draws it; under expert parallelism
  // the whole model's draws of this rank's parameters) to `take(k, values)`, in order, one
  // parameter in memory at a time. Touches no generator's state; any number of times.
  void initialize(const std::function<void(size_t, const torch::Tensor&)>& take);

  // idx: [B, T] int64 token ids (T <= seq_len) -> logits [B, T, classes()] (tensor parallel:
  // this rank's vocabulary slice of them, [B, T, live_rows()]): padding rows have none.
  torch::Tensor forward(const torch::Tensor& idx);
  // Mean cross-entropy of next-token prediction; targets [B, T]; in training, with experts, plus
  // the aux coefficient x transformers' load-balancing loss over every sparse layer's tokens
  // (load_balancing_loss_func: the experts' count x sum over experts of the share of the k choices it
  // got times its mean router probability; last_aux_loss), and with RunOptions::z_loss_coef that x the
  // router z-loss (the mean over every sparse layer's tokens of logsumexp(router logits)^2;
  // last_z_loss). With RunOptions::fused_loss the
  // logits never exist in full (linear_cross_entropy); tensor parallel, never on one rank
  // (vocab_parallel_cross_entropy).
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets);
  // Per position the log-probability of `targets` [B, T] after idx [B, T]: [B, T] in fp32, over
  // the classes (tensor parallel: the ranks' vocabulary slices combined over the tp group, as
  // vocab_parallel_cross_entropy does). Multiple-choice evaluation's (mc_eval.h).
  torch::Tensor target_log_probs(const torch::Tensor& idx, const torch::Tensor& targets);
  // The same from the last stage's stage_forward output (pipeline parallelism).
  torch::Tensor stage_target_log_probs(const torch::Tensor& out, const torch::Tensor& targets);
  // The logits of the last stage's stage_forward output (not tensor parallel).
  torch::Tensor stage_logits(const torch::Tensor& out) { return head(out); }

  // Pipeline parallelism (dims.pp > 1): this stage's part of forward, its chunk `chunk` of blocks
  // (model_fields.h; 0 but under the interleaved schedule). `in`: the token ids on the first
  // stage's chunk 0, else the previous virtual stage's output [B, T, n_embd]; returns the residual
  // stream after the chunk's blocks (the last stage's last chunk: after the final norm).
  // stage_loss: the last stage's mean cross-entropy of that output against `targets` (as loss()
  // computes it, without experts).
  torch::Tensor stage_forward(const torch::Tensor& in, int64_t chunk = 0);
  torch::Tensor stage_loss(const torch::Tensor& out, const torch::Tensor& targets);
  // With experts: the router log of the last stage_forward (in training: its chunk's sparse layers'
  // token counts and probability sums, and the rows they routed), handed over and cleared.
  // router_counts: a log's counts per expert summed over its layers, and its rows (int64 [E + 1]
  // on the host; an empty log's are zeros). loss()'s load-balancing terms are linear in each
  // layer's probability sums once the counts and rows of every sparse layer are known, so each
  // stage adds its own layers' part: router_terms gives `log`'s, given the whole model's
  // router_counts (summed over every stage's logs): aux coefficient x its share of the aux loss
  // (+ z-loss coefficient x its share of the z-loss), setting last_aux_loss / last_z_loss to the
  // unweighted shares (undefined: no sparse layer in `log`).
  RouterLog take_router_log();
  torch::Tensor router_counts(const RouterLog& log) const;
  torch::Tensor router_terms(const RouterLog& log, const torch::Tensor& routing);

  const GPTDims& dims() const { return dims_; }
  // The last forward's load-balancing loss (undefined: no experts or not training) and each sparse
  // layer's expert load, max / mean tokens per expert (empty: no experts).
  const torch::Tensor& last_aux_loss() const { return aux_loss_; }
  const torch::Tensor& last_z_loss() const { return z_loss_; }  // undefined without a z-loss coefficient
  // RunOptions::routing_bias: every sparse layer's routing bias [sparse layers, E] (fp32, on the host), and
  // set from such a tensor (a checkpoint's). update_routing_bias: the tokens each expert was
  // given by the training forwards since the last update, summed over `dp` (every rank's
  // router), move each bias by rate x sign(mean - load), centred (torchtitan's
  // _update_expert_bias); the same result on every rank. Collective over dp.
  // (A pipeline stage: the whole model's rows, its own layers' filled and the others' zero; set
  // from the whole model's, taking its own layers' rows.) count_routed: a forward's log (a
  // pipeline stage's chunk `chunk`) into the load update_routing_bias uses.
  torch::Tensor routing_bias() const;
  void set_routing_bias(const torch::Tensor& bias);
  void update_routing_bias(double rate, Communicator& dp);
  void count_routed(const RouterLog& log, int64_t chunk = 0);
  std::vector<double> expert_load() const;
  static std::vector<double> expert_load(const RouterLog& log);  // each of its sparse layers' max / mean
  // With train.moe_capacity_factor: the share of the last forward's token copies dropped (-1: dropless).
  double dropped_share() const;
  // ZeRO-3: who makes the blocks' parameters whole (not owned; null: they always are).
  void set_unit_hooks(UnitHooks* units) { units_ = units; }
  // Parameters in a fixed order with stable names ("wte.weight", "h.0.attn.c_attn.weight", ...;
  // block_of() reads a name's block).
  std::vector<std::pair<std::string, torch::Tensor>> named_params() const;
  int64_t num_params() const;
  // The parameters a token does not use: per sparse layer, the experts it is not routed to
  // (all but the k chosen); 0 for a dense model. MFU counts the rest.
  int64_t inactive_params() const;
  // Expert parallelism: the parameters of the experts other ranks of this rank's ep group hold
  // (0 with ep 1): num_params() + this = the whole model's.
  int64_t remote_expert_params() const;
  // Which part of the whole parameter `name` (a named_params() name) a tensor-parallel rank
  // holds, as the module that made it declared (replicated where it declared nothing). The same
  // for every tp degree, tp 1 included.
  TpSplit tp_split(const std::string& name) const;

  // The output layer's weight: wte's (tied) or lm_head's (this rank's vocabulary rows under tp).
  const torch::Tensor& output_weight() const { return lm_head ? lm_head->weight : wte->weight; }
  // How many of this rank's output rows are classes (not padding): all but the padding at the end
  // of the vocabulary, which under tp may take some ranks' whole slice (then 0).
  int64_t live_rows() const;

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};  // wpe: gpt2 only
  torch::nn::ModuleList h{nullptr};
  Norm ln_f{nullptr};
  torch::nn::Linear lm_head{nullptr};  // llama with tie_embeddings false

 private:
  void build_modules(const GPTDims& d, bool deferred);  // this rank's modules (whole over tp)
  // Whether block `block` runs under activation checkpointing (run_.ac, in training with gradients).
  bool checkpointed(int64_t block) const;
  // ZeRO-3 (units_ set): block i's parameters whole before it runs and given back after; its
  // outputs through the identity whose backward makes them whole again.
  void before_block(int64_t block);
  std::vector<torch::Tensor> after_block(int64_t block, std::vector<torch::Tensor> outs);
  torch::Tensor hidden(const torch::Tensor& idx);
  // hidden()'s blocks of [begin, end) with the fused norms: the residual stream and the last
  // block's MLP output, which the next norm adds (add_forward).
  std::pair<torch::Tensor, torch::Tensor> run_blocks_fused(torch::Tensor x, int64_t begin, int64_t end);
  int64_t expert_params_times(const std::function<int64_t(const MoEImpl&)>& experts_left_out) const;
  std::vector<torch::Tensor> router_output(std::vector<torch::Tensor> outs, size_t block_outputs = 1);
  void collect_tp_splits();  // every module's declarations, by full parameter name
  torch::Tensor lm_loss(const torch::Tensor& idx, const torch::Tensor& targets);  // loss() without the aux loss
  torch::Tensor embed(const torch::Tensor& idx);  // hidden()'s first part: the embeddings (dropout)
  // hidden()'s blocks (unfused), those of [begin, end) this model holds.
  torch::Tensor run_blocks(torch::Tensor x, int64_t begin = 0, int64_t end = INT64_MAX);
  torch::Tensor lm_loss_of(const torch::Tensor& hidden, const torch::Tensor& targets);  // after ln_f
  torch::Tensor head(const torch::Tensor& x);  // the logits of x (after ln_f and tp_copy)
  // This model's parameters from `whole`'s draws (a model made without values whose parameters
  // include this one's by name: expert parallelism's, a pipeline stage's), one at a time.
  void keep_draws(GPTImpl& whole);
  // `whole`'s draws (GPT::initialize) of this model's parameters, by name, handed to take(k, values)
  // in this model's order, one parameter in memory at a time when both orders agree.
  void draws_of(GPTImpl& whole, const std::function<void(size_t, const torch::Tensor&)>& take);
  GPTDims dims_;
  TpPlace tp_;  // parallelize()'s
  RunOptions run_;
  std::vector<std::shared_ptr<Rotary>> rotaries_;  // the blocks' tables (apply sets their fused path)
  RouterLog router_log_;
  torch::Tensor aux_loss_, z_loss_;
  std::vector<torch::Tensor> routed_since_update_;  // run_.routing_bias: per sparse layer [E] int64
  std::vector<MoEImpl*> moe_layers() const;  // the sparse layers' MoE modules, in order
  std::vector<int64_t> held_sparse_rows() const;  // their rows among the whole model's sparse layers
  std::unordered_map<std::string, TpSplit> tp_splits_;  // by parameter name
  UnitHooks* units_ = nullptr;
  c10::optional<at::Generator> init_generator_;  // deferred: the generator's state after making the modules
  // Deferred under expert or pipeline parallelism: the whole model (ep and pp 1, without values)
  // whose draws initialize() hands out, this rank's parameters only (their tp shards after
  // parallelize).
  std::shared_ptr<GPTImpl> whole_draws_;
};
TORCH_MODULE(GPT);

// The whole model under `d`: ep 1, and pp 1 unless `stage` (then this stage's part, its
// blocks whole over ep; a built model is whole over tp until parallelize); made without values when `deferred` (its names and shapes), else
// with the initial ones, to be overwritten. The default generator's stream goes on as it was.
GPT whole_model(const GPTDims& d, bool deferred, bool stage = false);
// Its parameter names (stage false), in order.
std::vector<std::string> whole_model_names(const GPTDims& d);

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
// `last_logits` (pipeline parallelism): the logits [classes] of a window's last position, from
// wherever they are computed (default: model's forward), the same on every rank that samples.
std::vector<int64_t> generate(GPT& model, std::vector<int64_t> prompt, int64_t n,
                              double temperature, int64_t top_k, uint64_t seed,
                              const std::function<torch::Tensor(const torch::Tensor&)>& last_logits = {});

// Byte tokens as printable text: `eot` as "\n<|endoftext|>\n", newlines, tabs and bytes from 32
// up kept, other tokens escaped as "\x..".
std::string decode_bytes(const std::vector<int64_t>& tokens, int64_t eot);

}  // namespace mpitrain
