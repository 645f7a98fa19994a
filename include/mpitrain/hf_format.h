// GPT-2 and Llama in Hugging Face's format: safetensors + config.json, what transformers'
// GPT2LMHeadModel / LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM .from_pretrained read (`mpitrain export
// CKPT --format hf DIR`), and the same files as initial weights (model.init_from).
//
// Names, one table per family (hf_name):
//   gpt2   mpitrain's names with GPT2LMHeadModel's "transformer." prefix
//          ("transformer.h.0.attn.c_attn.weight"); lm_head.weight is tied to transformer.wte.weight
//          and, as save_pretrained does, not stored. HF's GPT-2 uses Conv1D layers whose weight is
//          [in, out], the transpose of torch.nn.Linear's [out, in]: attn.c_attn, attn.c_proj,
//          mlp.c_fc and mlp.c_proj are transposed on the way out and back.
//   llama  wte -> model.embed_tokens, h.N -> model.layers.N, ln_1 -> input_layernorm,
//          attn.{q,k,v}_proj -> self_attn.{q,k,v}_proj, attn.c_proj -> self_attn.o_proj,
//          ln_2 -> post_attention_layernorm, mlp.{gate,up}_proj as they are, mlp.c_proj ->
//          mlp.down_proj, ln_f -> model.norm, lm_head as it is (untied only), attn.{q,k}_norm ->
//          self_attn.{q,k}_norm (Qwen3). A rename and nothing else: mpitrain's rotary uses HF's
//          half-split layout, so q/k are not permuted.
//
// safetensors: an 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ..., "__metadata__": {...}}
// (padded with spaces to a multiple of 8), then the tensors' bytes, little-endian, C order. A
// sharded model is model-0000i-of-0000n.safetensors files plus model.safetensors.index.json
// {"metadata": {"total_size": bytes}, "weight_map": {"name": "file", ...}}.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mpitrain/model.h"

namespace mpitrain {

// The transformers class of a model: GPT2LMHeadModel (gpt2), Qwen2ForCausalLM (llama with q/k/v
// biases), Qwen3ForCausalLM (llama with q/k norms) or LlamaForCausalLM (llama).
std::string hf_architecture(const GPTDims& d);

// Hugging Face's name of an mpitrain parameter, and whether it is stored transposed (GPT-2's Conv1D).
std::string hf_name(const std::string& name, const GPTDims& d);
bool hf_transposed(const std::string& name, const GPTDims& d);

struct HfWriteOptions {
  std::string dtype = "fp32";          // fp32 | bf16 | fp16
  uint64_t max_shard_bytes = 5'000'000'000;  // safetensors files of at most this many bytes of tensors (HF's 5GB)
};

// Writes the safetensors file(s) (one model.safetensors when the model fits in one shard, else
// model-0000i-of-0000n.safetensors and model.safetensors.index.json, built from the tensors
// written), config.json and, for llama, generation_config.json for a dense (tp = 1) model into
// `dir` (created; each file replaced atomically; files of the other layout, single or sharded,
// removed). `eot_token` becomes bos/eos. Returns the safetensors files' names, one per line.
// `values` (given): named_params()[k]'s whole values come from values(k), called once per
// parameter, one at a time (`export` streams a checkpoint through it into the files: a model made
// deferred, no whole model in memory); else the model's own parameters.
std::string write_hf_model(const std::string& dir, GPT& model, int64_t eot_token, const HfWriteOptions& opts = {},
                           const std::function<torch::Tensor(size_t)>& values = {});

// The files of `dir` that an export would replace or remove (config.json, generation_config.json,
// model.safetensors, model-*.safetensors, model.safetensors.index.json, and the tokenizer files
// export copies) when they are not an earlier mpitrain export's: some safetensors file among them
// was not written by mpitrain (its header's __metadata__ producer), or there are such files but no
// safetensors of mpitrain's beside them. Empty when `dir` is absent, holds none of them, or holds
// an earlier export (which an export replaces). Files of other names are never touched.
std::vector<std::string> foreign_model_files(const std::string& dir);

// model.init_from's files, opened and checked, read one parameter at a time: what a
// ZeRO-3 start-up hands out tensor by tensor, and the loaders below copy into a model.
class InitialWeights {
 public:
  virtual ~InitialWeights() = default;
  // named_params()[k]'s values of the model it was opened for: this tp rank's part, fp32, on the
  // host. A read error or a bad value is a UsageError "<key>: <file>: ...".
  torch::Tensor read(size_t k);
  size_t size() const { return names_.size(); }
  // Every parameter of `model` (the one it was opened for) from read(); returns their number.
  int64_t copy_into(GPT& model);

 protected:
  InitialWeights(GPT model, std::string key);
  virtual torch::Tensor read_values(size_t k) = 0;
  GPT model_;
  std::string key_;
  std::vector<std::string> names_;  // named_params() order
};

// Loads Hugging Face weights into `model`: a .safetensors file, or a directory (hf:DIR or DIR)
// holding model.safetensors or a sharded model.safetensors.index.json. F32, F16, BF16 or F64.
// Every file's header, every tensor's name, dtype, shape and byte range, and the index are
// checked before any weight changes; the values are then read one tensor at a time, twice: to
// check them (finite, a tied lm_head), then to copy them, so a refused file changes no weight and
// no second copy of the model is held. A missing, unknown or twice-named tensor, an
// index naming a missing file, a truncated file, NaN/inf values, or (tied models) an lm_head
// that differs from the embedding are a UsageError "<key>: <file>: ...". Buffers older files
// carry (GPT-2's attn.bias masks, Llama's rotary_emb.inv_freq) are ignored. Returns the number
// of tensors loaded.
int64_t load_hf_safetensors(const std::string& path, GPT& model, const std::string& key = "model.init_from");
// The same checks (headers, then every value), the values left to read().
std::unique_ptr<InitialWeights> open_hf_safetensors(const std::string& path, GPT& model,
                                                    const std::string& key = "model.init_from");

// Initial weights from a directory of .npy files (model.init_from; docs/formats.md): one
// `<parameter name>.npy` per entry of named_params() ("wte.weight.npy", "h.0.ln_1.bias.npy"),
// dtype '<f4' or '<f8' ('<f2' too), C order, the parameter's shape; other files are ignored.
// Every file's header and size are checked before any weight changes. A missing directory or
// file, a .npy that matches no parameter, a bad header, dtype, order, shape or size, and NaN or
// infinite values are a UsageError "<key>: <file>: ...". Returns the number of tensors loaded.
int64_t load_npy_weights(const std::string& dir, GPT& model, const std::string& key = "model.init_from");
// The same header checks, the values left to read() (which checks them).
std::unique_ptr<InitialWeights> open_npy_weights(const std::string& dir, GPT& model,
                                                 const std::string& key = "model.init_from");

// model.init_from: hf:DIR, a .safetensors file or a directory holding model.safetensors or its
// index (load_hf_safetensors), else a directory of .npy files (load_npy_weights).
int64_t load_initial_weights(const std::string& path, GPT& model, const std::string& key = "model.init_from");
std::unique_ptr<InitialWeights> open_initial_weights(const std::string& path, GPT& model,
                                                     const std::string& key = "model.init_from");

}  // namespace mpitrain
