// A Hugging Face model directory's config.json as mpitrain's model keys (model.init_from: hf:DIR).
//
// The family is the row of model_fields.h whose model_type config.json names: LlamaForCausalLM
// (llama: Llama 2/3.x), Qwen2ForCausalLM (qwen2: q/k/v biases), Qwen3ForCausalLM (qwen3: q/k norms,
// 128-wide heads), MistralForCausalLM (mistral: its attention window), Gemma2ForCausalLM (gemma2:
// the window, attn_logit_softcapping, final_logit_softcapping, query_pre_attn_scalar) and
// Gemma3ForCausalLM (gemma3_text: those, rope_local_base_freq, sliding_window_pattern or
// layer_types, rope_scaling linear), all the llama block. The keys read: hidden_size, num_hidden_layers, num_attention_heads,
// num_key_value_heads, head_dim, intermediate_size, vocab_size, max_position_embeddings,
// rms_norm_eps, tie_word_embeddings, rope_theta and rope_scaling (the older keys) or
// rope_parameters (newer transformers), hidden_act / hidden_activation (the family's: silu,
// Gemma's gelu_pytorch_tanh), attention_bias and mlp_bias (false only for llama and qwen3).
// Qwen's sliding windows and mixtures of experts are refused, naming the key.
// A key absent from config.json means its transformers config class's default (Gemma 2's caps
// 50 and 30, Gemma 3's rope_theta 1e6, a window of 4096, LlamaConfig's 7B shape, ...); null means
// none where the class allows it (caps, windows, num_key_value_heads, head_dim). transformers 5's
// rope_parameters nested per layer type ({full_attention: {...}, sliding_attention: {...}}) is read:
// full_attention is the global layers', sliding_attention Gemma 3's local base (another family's
// must equal full_attention's). Gemma 3 with a non-null attn_logit_softcapping is refused
// (transformers' Gemma 3 attention applies none).
// Torch-free: parse_config uses it before any model exists.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mpitrain/config.h"

namespace mpitrain {

// config.json is a few kB; a larger file is not one (a link to /dev/zero, a mistaken path).
constexpr uint64_t kMaxHfConfigBytes = uint64_t{1} << 20;

// "DIR" for model.init_from "hf:DIR", else "".
std::string hf_model_dir(const std::string& init_from);

// Fills m's unset fields (0, "" or auto) from DIR/config.json and makes the model a custom llama;
// model.seq_len, when unset, becomes min(max_position_embeddings, 2048). vocab_size is the weights'
// number of classes (m.init_vocab): model.vocab_size stays as given (unset: automatic padding of
// those classes, as for the data's, so a padded mpitrain export comes back with the rows it had).
// An explicit model key that disagrees with the file is a UsageError naming both; so is a file
// that is not one of the architectures above, or larger than kMaxHfConfigBytes, or not a regular
// file. Errors start with `where` (the config file's name).
void apply_hf_config(ModelConfig& m, const std::string& dir, const std::string& where);

// The same with config.json's text given (`path` names it in errors; the fuzz target's entry).
void apply_hf_config_text(ModelConfig& m, const std::string& text, const std::string& path, const std::string& where);

// The keys whose transformers class default stands for an absent key, for `model_type` (the
// exporter writes every one of them).
std::vector<std::string> hf_class_default_keys(const std::string& model_type);

}  // namespace mpitrain
