// GPT-2 in Hugging Face's format: model.safetensors + config.json, what transformers'
// GPT2LMHeadModel.from_pretrained reads (`mpitrain export CKPT --format hf DIR`), and the same
// file as initial weights (`model.init_from: .../model.safetensors`).
//
// Names: mpitrain's parameter names with the "transformer." prefix of GPT2LMHeadModel
// ("transformer.h.0.attn.c_attn.weight"); lm_head.weight is tied to transformer.wte.weight and,
// as save_pretrained does, not stored. Layout: HF's GPT-2 uses Conv1D layers whose weight is
// [in, out], the transpose of torch.nn.Linear's [out, in]: attn.c_attn, attn.c_proj, mlp.c_fc
// and mlp.c_proj are transposed on the way out and back. Everything else (the q|k|v order in
// c_attn, heads contiguous within each, LayerNorm eps 1e-5, GELU with the tanh approximation =
// "gelu_new") is already GPT-2's.
//
// safetensors: an 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ..., "__metadata__": {...}}
// (padded with spaces to a multiple of 8), then the tensors' bytes, little-endian, C order.
#pragma once

#include <cstdint>
#include <string>

#include "mpitrain/model.h"

namespace mpitrain {

// Hugging Face's name of an mpitrain parameter, and whether it is stored transposed (Conv1D).
std::string hf_name(const std::string& name);
bool hf_transposed(const std::string& name);

// Writes model.safetensors (float32, or "bf16"/"fp16") and config.json for a dense (tp = 1) model
// into `dir` (created; existing files replaced atomically). `eot_token` becomes bos/eos.
void write_hf_model(const std::string& dir, GPT& model, int64_t eot_token, const std::string& dtype = "fp32");

// Loads a GPT-2 model.safetensors (HF names with or without "transformer."; F32, F16, BF16 or F64)
// into `model`: every tensor's name, dtype, shape and byte range is checked before any weight
// changes; an untied lm_head.weight, a missing or unknown tensor, a truncated file or NaN/inf
// values are a UsageError "<key>: <file>: ...". Attention-mask buffers (attn.bias,
// attn.masked_bias) of older files are ignored. Returns the number of tensors loaded.
int64_t load_hf_safetensors(const std::string& path, GPT& model, const std::string& key = "model.init_from");

// model.init_from: a .safetensors file, or a directory holding model.safetensors (a Hugging Face
// GPT-2 checkpoint directory), else a directory of .npy files (load_npy_weights).
int64_t load_initial_weights(const std::string& path, GPT& model, const std::string& key = "model.init_from");

}  // namespace mpitrain
