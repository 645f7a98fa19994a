// The model's fields in one place: the families (a named row each: the block it is made of, the
// flags it fixes, the Hugging Face class it is), the model's architecture (ModelArgs; GPTDims adds
// a run's options), and one row per architecture field saying its key (model.<key> in the YAML,
// the checkpoint attribute, ModelArgs' member), its type, the families it applies to, what a file
// written before it existed means, its allowed range, whether a resume may change it and what the
// start-up line says of it. Checkpoint attributes (write, read, compare on resume), model_dims
// (config -> dims), the config's family rules, config.json in and out (family rows), the start-up
// description and the docs check (tests/test_config.cpp: every key and family is in
// docs/config.md) read these tables. No libtorch here.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "mpitrain/config.h"

namespace mpitrain {

class Communicator;

// ---- families ------------------------------------------------------------------------------------
// A family is one row: which of model.h's two blocks it is made of, the parts of that block it
// has (some fixed, so that a config may not set them otherwise), and the Hugging Face class and
// model_type it is read from and written as.
struct Family {
  const char* name;             // model.family
  const char* block;            // ModelArgs::arch: gpt2 | llama (model.h's two configurations)
  const char* hf_architecture;  // config.json "architectures"[0]
  const char* hf_model_type;    // config.json "model_type"
  bool qkv_bias;                // biases on q, k and v (Qwen2)
  bool qk_norm;                 // RMSNorm over each head's q and k (Qwen3)
  // Which layers are windowed (ModelArgs' window; Gemma 3's rotary base rope_local_theta): 0
  // none may have a window; 1 every layer (Mistral); P >= 2 every layer but each P-th, layer i
  // global when (i + 1) % P == 0 (Gemma 2: P 2, layers 0, 2, 4, ... windowed; Gemma 3: P 6, five
  // local layers to one global).
  int window_pattern;
  // The llama block's gated MLP: config.json's hidden_act, silu (SwiGLU) | gelu_pytorch_tanh
  // (GeGLU, Gemma); "" for the gpt2 block (its GELU MLP has no gate).
  const char* mlp_act;
  // Gemma's norms: RMSNorm as x (1 + w) in fp32 (the stored weight starts at 0), a second norm
  // after each sublayer (post_attention, post_feedforward) besides the one before it, and the
  // token embedding times sqrt(n_embd).
  bool gemma_norms;
  // OLMoE's q/k norms: one RMSNorm over the whole q projection and one over k's (all heads at
  // once) instead of one per head.
  bool qk_norm_whole;
  const char* about;            // for docs and messages
};
const std::vector<Family>& families();
const Family* find_family(const std::string& name);
const Family* family_by_model_type(const std::string& hf_model_type);
// "gpt2|llama|qwen2|qwen3|mistral|gemma2|gemma3" (with `sep` between).
std::string family_names(const char* sep = "|");
// The family of a model that names none: configs with only model.arch (as before model.family)
// and checkpoints written before the family attribute. The one place the flags say the family:
// the gpt2 block is gpt2; a llama block with a window is mistral, with q/k/v biases qwen2, with q/k
// norms qwen3, else llama.
const Family& family_of_parts(const std::string& block, bool qkv_bias, bool qk_norm, int64_t window);
// The key whose value a model of family `f` may not have ("arch", "qkv_bias", "qk_norm", the
// window's: window_key()), or nullptr: the block must be the family's; a llama block's q/k/v biases
// and q/k norms are the family's, and only a family with a window may have one. (The fields of
// some families only, such as Gemma 2's soft-capping: field_conflict.)
const char* family_conflict(const Family& f, const std::string& block, bool qkv_bias, bool qk_norm, int64_t window);
// The attention window's key (a generic row's: ModelConfig::args) and a config's window (0: none).
const char* window_key();
int64_t window_of_config(const ModelConfig& c);

// ---- the model's architecture and the run's options ----------------------------------------------
// ModelArgs: what the model is (what a checkpoint and config.json record; one row of the table
// below per field beyond the five dimensions). GPTDims: a ModelArgs and which of the model's
// parts this rank builds (its experts, its pipeline stage's blocks), and dropout. TpPlace:
// tensor parallelism, which Parallelism applies to a built model (GPT::parallelize: each
// split parameter replaced by this rank's shard, each module switched to its sharded path).
// RunOptions: how a built model runs (the fused paths, activation checkpointing, the experts'
// capacity and balancing), which the step applies to it (GPT::apply) and may change between
// calls. No file of the model records the last three.
struct ModelArgs {
  int64_t n_layer = 0;
  int64_t n_head = 0;
  int64_t n_embd = 0;
  int64_t seq_len = 0;
  int64_t vocab_size = 0;         // rows of the token embedding and of the output layer
  std::string family = "";        // a row of families(); "" = what the parts make (family_row())
  std::string arch = "gpt2";      // the family's block, gpt2 | llama: which parts the block is made of (model.h)
  int64_t n_kv_head = 0;          // llama: key/value heads (gpt2: n_head)
  int64_t intermediate_size = 0;  // the MLP's hidden units (gpt2: 4 n_embd)
  int64_t max_position = 0;       // llama: config.json's max_position_embeddings (gpt2: seq_len)
  double norm_eps = 1e-5;
  double rope_theta = 10000;
  std::string rope_scaling = "none";  // none | llama3 | linear (Gemma 3's global layers: inv_freq / rope_factor)
  double rope_factor = 0, rope_low_freq_factor = 0, rope_high_freq_factor = 0;
  int64_t rope_original_max_position = 0;
  bool qkv_bias = false;        // llama: biases on q/k/v (Qwen2)
  bool tie_embeddings = true;   // llama: false = an lm_head of its own
  int64_t head_size = 0;        // llama: model.head_dim; 0 = n_embd / n_head (see head_dim())
  bool qk_norm = false;         // llama: RMSNorm over each head's q and k before rotary (Qwen3)
  // The attention window (0 none) of the family's windowed layers (Family::window_pattern):
  // query i sees keys i - window + 1 .. i (>= seq_len: causal attention).
  int64_t sliding_window = 0;
  // Gemma 2 and 3 (0 = none): attention scores and the output logits soft-capped, cap tanh(s /
  // cap); the query scale 1 / sqrt(query_pre_attn_scalar) (0: 1 / sqrt(head_dim)).
  double attn_softcap = 0, final_softcap = 0, query_pre_attn_scalar = 0;
  // Gemma 3: the rotary base of the windowed (local) layers (0: rope_theta everywhere); rope_theta
  // and rope_scaling are the global layers'.
  double rope_local_theta = 0;
  // A mixture of experts (Qwen3-MoE; 0 experts: every layer's MLP dense): each sparse layer's MLP
  // is num_experts SwiGLU experts of moe_intermediate_size units and a router choosing
  // num_experts_per_tok of them per token (softmax in fp32, top k, the chosen weights renormalised
  // to sum to 1 with norm_topk_prob); layer i is sparse when (i + 1) % decoder_sparse_step == 0.
  // Training adds router_aux_loss_coef x transformers' load-balancing loss (model.h).
  int64_t num_experts = 0, num_experts_per_tok = 0, moe_intermediate_size = 0, decoder_sparse_step = 1;
  bool norm_topk_prob = false;
  double router_aux_loss_coef = 0.001;  // (every default here is its row's fallback)
  // Automatic vocabulary padding (model_dims): the first vocab_live rows are the data's tokens;
  // the rows after them are padding, initialised to zero, outside the loss and the logits, so
  // they get no gradient and are never sampled. 0: every row is a class (an explicit
  // model.vocab_size, as nanoGPT's 50304 and Hugging Face's padded checkpoints have it).
  int64_t vocab_live = 0;

  bool llama() const { return arch == "llama"; }
  int64_t head_dim() const { return head_size > 0 ? head_size : n_embd / n_head; }
  int64_t attn_width() const { return n_head * head_dim(); }  // q's and attention output's width
  int64_t classes() const { return vocab_live > 0 ? vocab_live : vocab_size; }  // the loss's and logits' columns
  // The row of `family`; unnamed (dims built by hand, as tests do), family_of_parts.
  const Family& family_row() const;
  // Whether layer `layer` is one of the family's windowed (local) layers (Family::window_pattern),
  // and its attention window (0: none): the window on those layers.
  bool local_layer(int64_t layer) const;
  int64_t window_of_layer(int64_t layer) const;
  // Which layers are windowed, for messages: "every layer", "every other layer", "5 of every 6 layers".
  std::string local_layers() const;
  // Whether layer `layer`'s MLP is a mixture of experts.
  bool has_experts() const { return num_experts > 0; }
  // The sparse layers among layers [0, end) (so a sparse layer's row among the model's sparse
  // layers is sparse_layers(layer)), and the token copies a forward of `tokens` tokens routes to
  // experts in each.
  int64_t sparse_layers(int64_t end = -1) const {
    int64_t n = 0;
    for (int64_t l = 0; l < (end < 0 ? n_layer : end); ++l) n += moe_layer(l) ? 1 : 0;
    return n;
  }
  int64_t routed_copies(int64_t tokens) const { return tokens * num_experts_per_tok; }
  bool moe_layer(int64_t layer) const { return num_experts > 0 && (layer + 1) % decoder_sparse_step == 0; }
  // Its experts (0: a dense MLP) and the hidden units of its MLP or of each expert.
  int64_t experts_of_layer(int64_t layer) const { return moe_layer(layer) ? num_experts : 0; }
  int64_t mlp_units(int64_t layer) const { return moe_layer(layer) ? moe_intermediate_size : intermediate_size; }
};

struct GPTDims : ModelArgs {
  double dropout = 0.0;
  // Expert parallelism (parallel.ep; model.h's MoE): this rank's place in its ep group of `ep`
  // ranks, which holds experts [ep_rank E / ep, (ep_rank + 1) E / ep) of every sparse layer, and the
  // group's communicator (not owned; set when ep > 1). The experts' count divides by ep.
  int64_t ep = 1, ep_rank = 0;
  Communicator* ep_comm = nullptr;
  int64_t local_experts() const { return num_experts / ep; }
  // Pipeline parallelism (parallel.pp, pipeline.h): this rank's stage of `pp`, holding its
  // `pp_virtual` chunks of blocks (1 but under the interleaved schedule): chunk j is virtual stage
  // j pp + pp_stage of pp x pp_virtual, blocks [chunk_begin(j), chunk_end(j)) (the virtual stages'
  // shares as even as the blocks allow, the later ones larger). The embedding is on the first
  // stage (its chunk 0), the final norm and the output layer on the last (its last chunk; with
  // tied embeddings a copy of the embedding there too). Names stay the whole model's.
  // (parallel.pp_first_stage_blocks / pp_last_stage_blocks, pp_virtual 1: the first or the last
  // stage that many blocks, the other stages the rest as evenly; 0: as evenly as all.)
  int64_t pp = 1, pp_stage = 0, pp_virtual = 1, pp_first_blocks = 0, pp_last_blocks = 0;
  int64_t virtual_stages() const { return pp * pp_virtual; }
  // Where virtual stage u begins (u = 0 .. virtual_stages()).
  int64_t stage_boundary(int64_t u) const {
    const int64_t P = virtual_stages(), F = pp_first_blocks, B = pp_last_blocks;
    if ((F == 0 && B == 0) || P == 1 || u == 0 || u == P) return u * n_layer / P;
    if (B == 0) return F + (u - 1) * (n_layer - F) / (P - 1);
    if (F == 0) return u * (n_layer - B) / (P - 1);
    return P == 2 ? F : F + (u - 1) * (n_layer - F - B) / (P - 2);
  }
  int64_t chunk_begin(int64_t j) const { return stage_boundary(j * pp + pp_stage); }
  int64_t chunk_end(int64_t j) const { return stage_boundary(j * pp + pp_stage + 1); }
  bool holds_block(int64_t block) const {
    for (int64_t j = 0; j < pp_virtual; ++j)
      if (block >= chunk_begin(j) && block < chunk_end(j)) return true;
    return false;
  }
  bool first_stage() const { return pp_stage == 0; }
  bool last_stage() const { return pp_stage == pp - 1; }
};

// Tensor parallelism (tensor_parallel.h) as GPT::parallelize applies it: this rank's place in its
// tp group of `size` ranks, and the group's communicator (not owned; set when size > 1).
// n_head, n_kv_head, intermediate_size (and moe_intermediate_size) and vocab_size divide by size.
struct TpPlace {
  int64_t size = 1, rank = 0;
  Communicator* comm = nullptr;
  bool sharded() const { return size > 1; }
};

// How a built model runs (GPT::apply; the step's switches, not the architecture's).
struct RunOptions {
  bool fused_loss = false;      // classifier + cross-entropy fused and chunked (see linear_cross_entropy)
  int64_t fused_loss_rows = 0;  // rows per chunk of the fused loss (0: automatic; tests use small ones)
  bool fused_kernels = false;   // residual add + norm, GELU | SwiGLU, rotary as fused ops (fused_ops.h)
  // Activation checkpointing (train.activation_checkpointing) of every ac_every-th block (blocks
  // ac_every - 1, 2 ac_every - 1, ...): full keeps a block's input only and runs the block again in
  // backward; selective also keeps its linear layers' outputs and a fused attention kernel's
  // graph, which the second run replays instead of computing again (checkpointing.h). The random
  // state (dropout) and autocast of the first run are the second's, so gradients are bitwise
  // those without it.
  enum class Ac { none, full, selective } ac = Ac::none;
  int64_t ac_every = 1;
  // train.moe_capacity_factor (0: dropless): each expert takes at most ceil(f x tokens x k / E) of a
  // forward's token copies, the first by position (model.h's MoE).
  double capacity_factor = 0;
  // train.moe_z_loss_coef (0: none): the router z-loss's weight in the loss (model.h's GPT::loss).
  double z_loss_coef = 0;
  // train.moe_bias_update_rate > 0: each sparse layer keeps a routing bias for the top-k choice
  // (model.h's MoE), which the training loop moves after every step (GPT::update_routing_bias).
  bool routing_bias = false;
};

// family_conflict over a model's own block, flags and window: the key it may not have, or nullptr.
const char* family_conflict(const Family& f, const ModelArgs& a);

// ---- the architecture fields ----------------------------------------------------------------------
// One row per field of the architecture beyond the five dimensions every file has (n_layer,
// n_head, n_embd, seq_len, vocab_size). `key` is the YAML key under model., the checkpoint
// attribute and the name in messages.
struct ModelField {
  enum class Type { integer, number, flag, text };
  using Value = std::variant<int64_t, double, bool, std::string>;
  const char* key;
  Type type;
  bool llama_block;        // applies to the llama block's families only (gpt2 derives or fixes it)
  const char* families;    // "" = every family of its block; else the families that have it ("gemma2"):
                           // checkpoints and config.json carry it only for them, and a config may
                           // set it for no other (field_conflict)
  bool required;           // a checkpoint must have it (else: files before it existed mean `fallback`)
  Value fallback;          // what an absent attribute means
  int64_t lo, hi;          // allowed range of an integer attribute (a number: >= lo)
  const char* values;      // text: the allowed values, "a|b" ("" = the family table's names)
  // The key in a llama-block family's config.json when it is the value as it is ("" = written and
  // read by hand: the family row gives qkv_bias and qk_norm, rope_scaling is an object). GPT-2's
  // config.json has keys of its own (hf_format.cpp).
  const char* hf_key;
  // config.json's null is `fallback` (none: a window, a cap): read so, and `fallback` written as
  // null. Such a field is read from config.json generically (hf_config.cpp), for the families
  // that have it, a key absent from the file being its transformers class's default.
  bool hf_null;
  bool resume_may_change;  // a checkpoint resumes into a config that differs in it
  Value (*get)(const ModelArgs&);
  void (*set)(ModelArgs&, const Value&);
  void (*from_config)(ModelArgs&, const ModelConfig&);  // the resolved config's value
  void (*to_config)(ModelConfig&, const Value&);        // a value into the config (config.json's)
  // Its part of the start-up line's description of the model (", attention window 4096 on every
  // other layer"; "" when it says nothing there), after the five dimensions, in row order.
  std::string (*describe)(const ModelArgs&);
  // What config.json means where the key is absent, per family: "qwen3_moe=128 olmoe=64" (the
  // transformers class's default; "" = the generic reading's fallback).
  const char* hf_defaults;
  // The families that fix its value, "mixtral=true": a config of one takes it, and may set no
  // other (a generic row's).
  const char* fixed_by_family;
  // A field the config keeps by key (ModelConfig::args) rather than in a member of its own: the
  // YAML reader, presets, validation (its range; a fallback outside the range must be set where
  // the field applies), config.json in (hf_defaults) and out read and write it from this row alone.
  bool generic;
};

const std::vector<ModelField>& model_fields();
// The row of `key` (nullptr: none).
const ModelField* find_model_field(const std::string& key);
// Whether field `f` is a field of family `fam` (its block and its families).
bool field_applies(const ModelField& f, const Family& fam);
// The first field of some families only that `d` sets (a value other than its fallback) although
// its family `fam` has no such field, or nullptr.
const ModelField* field_conflict(const Family& fam, const ModelArgs& d);
// A generic field's value from its YAML text (ModelConfig::args), or a message saying what it
// must be ("an integer"); and a value as the text args holds.
bool field_from_text(const ModelField& f, const std::string& text, ModelField::Value& out);
std::string field_value_text(const ModelField::Value& v);
// The transformers class's default of field `f` for config.json's model_type `hf_model_type`
// (ModelField::hf_defaults), or nullptr; the value family `family` fixes it to
// (ModelField::fixed_by_family), or nullptr.
const char* hf_default_of(const ModelField& f, const std::string& hf_model_type);
const char* fixed_value_of(const ModelField& f, const std::string& family);
// Field `f`'s key in config.json of model_type `hf_model_type`: ModelField::hf_key is "key" or
// "key type=other_key ..." (Mixtral's num_local_experts for num_experts).
std::string hf_key_of(const ModelField& f, const std::string& hf_model_type);
// The value as text, for messages and comparisons ("1e-05", "1" for a true flag, "llama3").
std::string field_text(const ModelField& f, const ModelArgs& d);
// The start-up line's description of the model: its family and block, `whole_params` parameters,
// the dimensions, then each row's describe.
std::string describe_model(const ModelArgs& d, int64_t whole_params);

// The presets (model.preset): a name and its fields as the model.* keys of a config ("family:
// qwen3, n_layer: 28, ..."), with the published config.json values.
struct ModelPreset {
  const char* name;
  const char* fields;
};
const std::vector<ModelPreset>& model_presets();

// What a model's fields refuse together and with a run's layout, for the config's validation: a
// message "model.<key>: ..." or "<section>.<key>: ..." naming the key, or "" (none). OLMoE's q/k
// norms over the whole projections: not split by tensor parallelism. The experts:
// no more chosen than there are; each expert's units split by tensor parallelism (`tp` dividing
// them); split by expert parallelism (`ep`) only when there are experts and ep divides their count.
std::string args_conflict(const ModelArgs& a, int64_t tp, int64_t ep = 1);

// The model's dimensions from a resolved config (model.h's model_dims adds the vocabulary): the
// five dimensions, the family and its block, every field of the table that applies to the block,
// then complete_dims.
GPTDims dims_of_config(const ModelConfig& cfg);
// What no row of the table gives, once the rows are read (from a config or a checkpoint): the gpt2
// block's fixed values (n_kv_head = n_head, 4 n_embd MLP units, max_position = seq_len), and the
// family where none is named (what the parts make).
void complete_dims(ModelArgs& d);

}  // namespace mpitrain
