// Weights in: Hugging Face's format (safetensors + config.json) and .npy directories; and out: Hugging
// Face's format (see hf_format.h).
#include "mpitrain/hf_format.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <variant>
#include <nlohmann/json.hpp>

#include "mpitrain/durable.h"
#include "mpitrain/error.h"
#include "mpitrain/files.h"
#include "mpitrain/hf_config.h"
#include "mpitrain/importers.h"
#include "mpitrain/model_fields.h"
#include "mpitrain/tensor_parallel.h"

namespace mpitrain {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kPrefix = "transformer.";

// The tensors whose rows are the vocabulary (mpitrain names): the token embedding and an untied
// output layer.
bool vocab_rows(const std::string& name) { return name == "wte.weight" || name == "lm_head.weight"; }

struct DtypeName {
  const char* safetensors;
  torch::ScalarType torch;
};
const DtypeName kDtypes[] = {
    {"F32", torch::kFloat32}, {"F16", torch::kFloat16}, {"BF16", torch::kBFloat16}, {"F64", torch::kFloat64}};

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += concat(i ? ", " : "", shape[i]);
  return s + "]";
}

// What a safetensors header says about one tensor, checked against the file.
struct Entry {
  std::string name;  // as in the file
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;  // byte range in the data section
};

// The header's tensors, each with a known dtype, a shape and a byte range inside the file that
// holds exactly its elements; ranges may not overlap.
std::vector<Entry> read_header(const std::string& path, std::ifstream& in, uint64_t& data_start) {
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (ec) throw UsageError(concat(path, ": cannot read: ", ec.message()));
  uint64_t n = 0;
  if (size < 8 || !in.read(reinterpret_cast<char*>(&n), 8)) throw UsageError(concat(path, ": ", size, " bytes, not a safetensors file (no header length)"));
  if (n > size - 8 || n > (uint64_t{100} << 20))
    throw UsageError(concat(path, ": header length ", n, " exceeds the file (", size, " bytes): not a safetensors file"));
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    throw UsageError(concat(path, ": the header is not JSON: ", e.what()));
  }
  if (!header.is_object()) throw UsageError(concat(path, ": the header is not a JSON object"));
  data_start = 8 + n;
  const uint64_t data_size = size - data_start;
  std::vector<Entry> entries;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string where = concat(path, ": tensor '", name, "'");
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets") ||
        !v["dtype"].is_string() || !v["shape"].is_array() || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      throw UsageError(concat(where, ": needs dtype, shape and data_offsets [begin, end]"));
    const std::string dtype = v["dtype"];
    const auto* d = std::find_if(std::begin(kDtypes), std::end(kDtypes), [&](const DtypeName& k) { return dtype == k.safetensors; });
    if (d == std::end(kDtypes)) throw UsageError(concat(where, ": dtype '", dtype, "', expected F32, F16, BF16 or F64"));
    Entry e{name, d->torch, {}, 0, 0};
    uint64_t elements = 1;
    for (const auto& x : v["shape"]) {
      if (!x.is_number_unsigned() || x.get<uint64_t>() > (uint64_t{1} << 40)) throw UsageError(concat(where, ": bad shape ", v["shape"].dump()));
      e.shape.push_back(x.get<int64_t>());
      elements *= x.get<uint64_t>();
      if (elements > (uint64_t{1} << 40)) throw UsageError(concat(where, ": bad shape ", v["shape"].dump()));
    }
    const auto& off = v["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) throw UsageError(concat(where, ": bad data_offsets ", off.dump()));
    e.begin = off[0].get<uint64_t>(), e.end = off[1].get<uint64_t>();
    if (e.begin > e.end || e.end > data_size)
      throw UsageError(concat(where, ": bytes ", e.begin, "-", e.end, " lie outside the data (", data_size,
                              " bytes; truncated file?)"));
    if (e.end - e.begin != elements * c10::elementSize(e.dtype))
      throw UsageError(concat(where, ": ", e.end - e.begin, " bytes for shape ", shape_text(e.shape), " of ", dtype));
    entries.push_back(std::move(e));
  }
  std::vector<const Entry*> by_offset;
  for (const auto& e : entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      throw UsageError(concat(path, ": tensors '", by_offset[i - 1]->name, "' and '", by_offset[i]->name, "' overlap"));
  return entries;
}

// `shape` elements of the tensor's dtype from byte `offset` of the data section, as fp32; they
// must be finite.
torch::Tensor read_block(const std::string& path, std::ifstream& in, uint64_t data_start, const Entry& e,
                         uint64_t offset, const std::vector<int64_t>& shape) {
  torch::Tensor t = torch::empty(shape, e.dtype);
  in.seekg(static_cast<std::streamoff>(data_start + offset));
  in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  if (!in) throw UsageError(concat(path, ": tensor '", e.name, "': read error"));
  t = t.to(torch::kFloat32);
  if (!torch::isfinite(t).all().item<bool>()) throw UsageError(concat(path, ": tensor '", e.name, "' holds NaN or infinite values"));
  return t;
}

torch::Tensor read_tensor(const std::string& path, std::ifstream& in, uint64_t data_start, const Entry& e) {
  return read_block(path, in, data_start, e, e.begin, e.shape);
}

// Rows [row0, row0 + rows) of a tensor of at least one row along its first dimension, read alone
// (they are contiguous in the file).
torch::Tensor read_rows(const std::string& path, std::ifstream& in, uint64_t data_start, const Entry& e, int64_t row0,
                        int64_t rows) {
  std::vector<int64_t> shape = e.shape;
  const uint64_t row_bytes = (e.end - e.begin) / static_cast<uint64_t>(shape[0]);
  shape[0] = rows;
  return read_block(path, in, data_start, e, e.begin + static_cast<uint64_t>(row0) * row_bytes, shape);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Llama: mpitrain's name -> HF's, piece by piece ("h.3.attn.c_proj.weight" ->
// "model.layers.3.self_attn.o_proj.weight"). Gemma's block has four norms: its norm before the MLP
// is pre_feedforward_layernorm, and post_attention_layernorm is the one after the attention.
// Mixtral's experts are block_sparse_moe's, their projections w1 (gate), w3 (up), w2 (down).
std::string llama_hf_name(const std::string& name, const Family& family) {
  const bool gemma = family.gemma_norms;
  static const std::pair<const char*, const char*> whole[] = {
      {"wte.weight", "model.embed_tokens.weight"}, {"ln_f.weight", "model.norm.weight"}, {"lm_head.weight", "lm_head.weight"}};
  for (const auto& [ours, theirs] : whole)
    if (name == ours) return theirs;
  using Parts = std::vector<std::pair<const char*, const char*>>;
  static const Parts parts = {
      {".ln_1.", ".input_layernorm."},       {".ln_2.", ".post_attention_layernorm."},
      {".attn.c_proj.", ".self_attn.o_proj."}, {".attn.", ".self_attn."},
      {".mlp.c_proj.", ".mlp.down_proj."}, {".c_proj.", ".down_proj."}};  // (the last: an expert's)
  static const Parts gemma_norms = {{".ln_2.", ".pre_feedforward_layernorm."},
                                    {".post_attn_norm.", ".post_attention_layernorm."},
                                    {".post_mlp_norm.", ".post_feedforward_layernorm."}};
  MPITRAIN_CHECK(name.rfind("h.", 0) == 0, concat("no Hugging Face name for '", name, "'"));
  std::string out = "model.layers." + name.substr(2);
  if (family.name == std::string("mixtral") &&
      (out.find(".mlp.experts.") != std::string::npos || out.find(".mlp.gate.") != std::string::npos)) {
    out.replace(out.find(".mlp."), 5, ".block_sparse_moe.");
    for (const auto& [ours, theirs] : {std::pair{".gate_proj.", ".w1."}, std::pair{".up_proj.", ".w3."}, std::pair{".c_proj.", ".w2."}})
      if (const size_t at = out.find(ours); at != std::string::npos) out.replace(at, std::strlen(ours), theirs);
    return out;
  }
  auto rename = [&](const Parts& table) {  // the first piece of `table` in the name, replaced
    for (const auto& [ours, theirs] : table) {
      const size_t at = out.find(ours);
      if (at != std::string::npos) return out.replace(at, std::strlen(ours), theirs), true;
    }
    return false;
  };
  if (!(gemma && rename(gemma_norms))) rename(parts);
  return out;  // (mlp.gate_proj, mlp.up_proj as they are)
}

// transformers 5's packed experts: "model.layers.N.mlp.experts.gate_up_proj" [E, 2I, C] (each
// expert's gate rows, then its up rows) and "model.layers.N.mlp.experts.down_proj" [E, C, I]
// (transformers 4's per-expert tensors stacked; Mixtral's under mlp too). Each expert's tensor is a
// contiguous run of the packed one: entered into `out` as an entry of its own (its name says where
// it lies), returned with transformers 4's name for it. Not packed: empty.
std::vector<std::pair<std::string, const Entry*>> unpack_experts(const std::string& path, const Entry& e,
                                                                 const Family& family, std::deque<Entry>& out) {
  static const std::string head = "model.layers.";
  if (e.name.rfind(head, 0) != 0) return {};
  const size_t dot = e.name.find('.', head.size());
  const std::string layer = e.name.substr(head.size(), dot == std::string::npos ? 0 : dot - head.size());
  if (layer.empty() || !std::all_of(layer.begin(), layer.end(), [](char c) { return c >= '0' && c <= '9'; })) return {};
  const std::string kind = e.name.substr(dot);
  const bool gate_up = kind == ".mlp.experts.gate_up_proj", down = kind == ".mlp.experts.down_proj";
  if (!gate_up && !down) return {};
  // (No dimension 0: the experts' count is then bounded by the file's bytes.)
  if (e.shape.size() != 3 || e.shape[0] < 1 || e.shape[1] < 1 || e.shape[2] < 1 || (gate_up && e.shape[1] % 2 != 0))
    throw UsageError(concat(path, ": tensor '", e.name, "' has shape ", shape_text(e.shape), ", not transformers 5's packed ",
                            gate_up ? "[experts, 2 x an expert's units, width]" : "[experts, width, an expert's units]"));
  const uint64_t bytes = (e.end - e.begin) / static_cast<uint64_t>(e.shape[0]);  // one expert's
  std::vector<std::pair<std::string, const Entry*>> named;
  for (int64_t x = 0; x < e.shape[0]; ++x) {
    const std::string ours = concat("h.", layer, ".mlp.experts.", x, ".");
    const uint64_t at = e.begin + static_cast<uint64_t>(x) * bytes;
    if (down) {
      out.push_back(Entry{concat(e.name, "[", x, "]"), e.dtype, {e.shape[1], e.shape[2]}, at, at + bytes});
      named.emplace_back(llama_hf_name(ours + "c_proj.weight", family), &out.back());
      continue;
    }
    const int64_t units = e.shape[1] / 2;
    out.push_back(Entry{concat(e.name, "[", x, "] (its gate rows)"), e.dtype, {units, e.shape[2]}, at, at + bytes / 2});
    named.emplace_back(llama_hf_name(ours + "gate_proj.weight", family), &out.back());
    out.push_back(Entry{concat(e.name, "[", x, "] (its up rows)"), e.dtype, {units, e.shape[2]}, at + bytes / 2, at + bytes});
    named.emplace_back(llama_hf_name(ours + "up_proj.weight", family), &out.back());
  }
  return named;
}

// Buffers of older files that are no parameters.
bool ignored_buffer(const std::string& hf, const GPTDims& d) {
  if (d.llama()) return ends_with(hf, ".rotary_emb.inv_freq");
  return ends_with(hf, ".attn.bias") || hf.find(".attn.masked_bias") != std::string::npos;
}

// One safetensors file, its header checked.
struct SafetensorsFile {
  std::string path;
  std::ifstream in;
  uint64_t data_start = 0;
  std::vector<Entry> entries;
};

// The part of the file's tensor `e` that this rank's parameter `name` holds, as fp32 in the
// parameter's orientation: the whole tensor (tp 1, or a parameter every tp rank holds whole), or
// its tensor-parallel shard: a block of the file's rows read alone where the split is by rows,
// else the whole tensor read (one at a time) and cut.
torch::Tensor read_part(SafetensorsFile& f, const Entry& e, const std::string& name, GPT& model) {
  const GPTDims& d = model->dims();
  const TpPlace& tp = model->tp();
  const TpSplit split = model->tp_split(name);
  const bool transposed = hf_transposed(name, d);
  if (vocab_rows(name) && e.shape.size() == 2 && e.shape[0] < d.vocab_size) {
    // The file has the classes' rows, the model automatic padding's too: those start at zero, as
    // in a model that was never exported. Each tp rank reads only the file rows it holds.
    MPITRAIN_CHECK(split == TpSplit::rows && d.vocab_size % tp.size == 0, "the vocabulary's rows split over tp");
    const int64_t n = d.vocab_size / tp.size, first = tp.rank * n;
    const int64_t have = std::clamp<int64_t>(e.shape[0] - first, 0, n);
    torch::Tensor out = torch::zeros({n, e.shape[1]}, torch::kFloat32);
    if (have > 0) out.narrow(0, 0, have).copy_(read_rows(f.path, f.in, f.data_start, e, first, have));
    return out;
  }
  if (tp.sharded() && split == TpSplit::rows && !transposed) {
    const int64_t n = e.shape[0] / tp.size;
    return read_rows(f.path, f.in, f.data_start, e, tp.rank * n, n);
  }
  torch::Tensor t = read_tensor(f.path, f.in, f.data_start, e);
  if (transposed) t = t.t();
  return tp_shard(t, split, tp.rank, tp.size);
}

// One file, opened and its header checked.
std::unique_ptr<SafetensorsFile> open_one(const std::string& path) {
  auto f = std::make_unique<SafetensorsFile>();
  f->path = path;
  f->in.open(path, std::ios::binary);
  if (!f->in) throw UsageError(concat(path, ": cannot open: ", std::strerror(errno)));
  f->entries = read_header(path, f->in, f->data_start);
  return f;
}

// The files of `path`: itself, or a directory's model.safetensors or its index's shards.
std::vector<std::unique_ptr<SafetensorsFile>> open_safetensors(const std::string& path,
                                                               std::map<std::string, SafetensorsFile*>& index) {
  std::vector<std::string> paths;
  std::error_code ec;
  const fs::path dir(path);
  const fs::path single = dir / "model.safetensors", index_path = dir / "model.safetensors.index.json";
  if (!fs::is_directory(path, ec)) {
    paths.push_back(path);
  } else if (fs::exists(single, ec)) {
    paths.push_back(single.string());
  } else if (fs::exists(index_path, ec)) {
    // An index names a few thousand tensors (Llama 3.1 405B's is ~100 kB): 64 MiB is no index.
    const std::string text = read_bounded_file(index_path.string(), uint64_t{64} << 20, "a model.safetensors.index.json");
    json j;
    try {
      j = json::parse(text);
    } catch (const json::exception& e) {
      throw UsageError(concat(index_path.string(), ": not JSON: ", e.what()));
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw UsageError(concat(index_path.string(), ": needs an object 'weight_map' {tensor: file}"));
    std::map<std::string, size_t> file_numbers;
    for (const auto& [tensor, file] : j["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().empty() || file.get<std::string>().find('/') != std::string::npos ||
          file.get<std::string>().rfind("..", 0) == 0)
        throw UsageError(concat(index_path.string(), ": weight_map['", tensor, "']: ", file.dump(),
                                " is not a file name in the same directory"));
      if (file_numbers.emplace(file.get<std::string>(), file_numbers.size()).second)
        paths.push_back((dir / file.get<std::string>()).string());
    }
    if (paths.empty()) throw UsageError(concat(index_path.string(), ": 'weight_map' names no tensor"));
    std::vector<std::unique_ptr<SafetensorsFile>> files;
    for (const std::string& p : paths) {
      if (!fs::exists(p, ec)) throw UsageError(concat(index_path.string(), ": names '", fs::path(p).filename().string(), "', which does not exist"));
      files.push_back(open_one(p));
    }
    for (const auto& item : j["weight_map"].items()) {
      const std::string tensor = item.key();  // (a lambda may not capture a structured binding in C++17)
      const json& file = item.value();
      SafetensorsFile& f = *files[file_numbers.at(file.get<std::string>())];
      if (std::none_of(f.entries.begin(), f.entries.end(), [&](const Entry& e) { return e.name == tensor; }))
        throw UsageError(concat(index_path.string(), ": weight_map['", tensor, "'] names ", file.dump(), ", which holds no such tensor"));
      index[tensor] = &f;
    }
    return files;
  } else {
    throw UsageError(concat(path, ": a directory without model.safetensors or model.safetensors.index.json"));
  }
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  files.push_back(open_one(paths[0]));
  return files;
}

json config_json(const GPTDims& d, int64_t eot_token, const std::string& dtype) {
  const char* torch_dtype = dtype == "bf16" ? "bfloat16" : dtype == "fp16" ? "float16" : "float32";
  if (!d.llama())
    return {
        {"architectures", {"GPT2LMHeadModel"}},
        {"model_type", "gpt2"},
        {"vocab_size", d.classes()},  // the padding rows are not written (write_hf_model)
        {"n_positions", d.seq_len},
        {"n_ctx", d.seq_len},
        {"n_embd", d.n_embd},
        {"n_layer", d.n_layer},
        {"n_head", d.n_head},
        {"n_inner", nullptr},
        {"activation_function", "gelu_new"},
        {"layer_norm_epsilon", d.norm_eps},
        {"initializer_range", 0.02},
        {"resid_pdrop", d.dropout},
        {"embd_pdrop", d.dropout},
        {"attn_pdrop", d.dropout},
        {"scale_attn_weights", true},
        {"tie_word_embeddings", true},
        {"use_cache", true},
        {"bos_token_id", eot_token},
        {"eos_token_id", eot_token},
        {"torch_dtype", torch_dtype},
    };
  // Qwen2's attention has q/k/v biases, Qwen3's q/k norms; Llama's neither (attention_bias would
  // add o_proj's bias too); Mistral is Llama's with an attention window (its row's key).
  const Family& family = d.family_row();
  const std::string type = family.hf_model_type;
  const bool qwen2 = type == "qwen2", qwen3 = type == "qwen3" || type == "qwen3_moe";
  json c = {
      {"architectures", {family.hf_architecture}},
      {"model_type", type},
      {"vocab_size", d.classes()},
      {"hidden_size", d.n_embd},
      {"num_hidden_layers", d.n_layer},
      {"num_attention_heads", d.n_head},
      {"hidden_act", family.mlp_act},
      {"rope_scaling", nullptr},
      {"attention_dropout", d.dropout},
      {"initializer_range", 0.02},
      {"use_cache", true},
      {"bos_token_id", eot_token},
      {"eos_token_id", eot_token},
      {"torch_dtype", torch_dtype},
  };
  for (const ModelField& f : model_fields()) {  // the fields config.json has as they are (null: none)
    if (!*f.hf_key || !field_applies(f, family)) continue;
    const std::string key = hf_key_of(f, type);
    if (f.hf_null && f.get(d) == f.fallback) c[key] = nullptr;
    else std::visit([&](const auto& v) { c[key] = v; }, f.get(d));
  }
  if (family.gemma_norms) {  // Gemma's: its activation under its own key too, each layer's kind
    c["hidden_activation"] = family.mlp_act;
    if (type == "gemma3_text") c["attn_logit_softcapping"] = nullptr;  // no score cap (transformers applies none)
    c["attention_bias"] = false;
    c["cache_implementation"] = "hybrid";
    if (type == "gemma3_text") c["sliding_window_pattern"] = family.window_pattern;
    json layers = json::array();
    for (int64_t i = 0; i < d.n_layer; ++i) layers.push_back(d.local_layer(i) ? "sliding_attention" : "full_attention");
    c["layer_types"] = layers;
  } else if (qwen2 || qwen3) {
    if (qwen3) c["attention_bias"] = false;
    c["use_sliding_window"] = false;  // (their class's window is then none)
    c["max_window_layers"] = d.n_layer;
  } else if (type == "llama") {
    c["attention_bias"] = false;
    c["mlp_bias"] = false;
    c["pretraining_tp"] = 1;
  }
  // transformers' Gemma configs declare query_pre_attn_scalar an int: written as one when it is.
  if (c.contains("query_pre_attn_scalar") && d.query_pre_attn_scalar == std::floor(d.query_pre_attn_scalar))
    c["query_pre_attn_scalar"] = static_cast<int64_t>(d.query_pre_attn_scalar);
  if (d.rope_scaling == "linear") c["rope_scaling"] = {{"rope_type", "linear"}, {"factor", d.rope_factor}};
  if (d.rope_scaling == "llama3")
    c["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", d.rope_factor},
                         {"low_freq_factor", d.rope_low_freq_factor},
                         {"high_freq_factor", d.rope_high_freq_factor},
                         {"original_max_position_embeddings", d.rope_original_max_position}};
  // Every key whose absence would mean the transformers class's default is written (hf_config.h).
  for (const std::string& key : hf_class_default_keys(type))
    MPITRAIN_CHECK(c.contains(key), concat("config.json for ", type, ": ", key, " not written (absent, it would mean ",
                                           family.hf_architecture, "'s default)"));
  return c;
}

// One safetensors file of `tensors` (HF name, bytes in the file's dtype), written durably.
// One safetensors file of the named shapes in `type`, the header first, then each tensor as
// `tensor(i)` gives it (that shape, in `type`, contiguous, on the host), one in memory at a time.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
                       torch::ScalarType type, const char* type_name, const std::function<torch::Tensor(size_t)>& tensor) {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}, {"producer", concat("mpitrain ", MPITRAIN_VERSION)}};
  uint64_t at = 0;
  std::vector<uint64_t> sizes;
  for (const auto& [name, shape] : shapes) {
    uint64_t bytes = c10::elementSize(type);
    for (int64_t e : shape) bytes *= static_cast<uint64_t>(e);
    header[name] = {{"dtype", type_name}, {"shape", shape}, {"data_offsets", {at, at + bytes}}};
    at += bytes;
    sizes.push_back(bytes);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  write_file_durably(path, [&](std::ostream& out) {
    const uint64_t n = text.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << text;
    for (size_t i = 0; i < shapes.size() && out; ++i) {
      const torch::Tensor t = tensor(i);
      MPITRAIN_CHECK(t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu() && t.nbytes() == sizes[i],
                     concat("write_safetensors: tensor ", shapes[i].first, " is not what the header says"));
      out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    }
  });
}

}  // namespace

std::string hf_architecture(const GPTDims& d) { return d.family_row().hf_architecture; }

std::string hf_name(const std::string& name, const GPTDims& d) {
  return d.llama() ? llama_hf_name(name, d.family_row()) : kPrefix + name;
}

bool hf_transposed(const std::string& name, const GPTDims& d) {
  if (d.llama()) return false;
  const bool linear = name.find(".attn.c_") != std::string::npos || name.find(".mlp.c_") != std::string::npos;
  return linear && ends_with(name, ".weight");
}

std::vector<std::string> foreign_model_files(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return {};
  static const char* const kNamed[] = {"config.json", "generation_config.json", "model.safetensors",
                                       "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                                       "vocab.json", "merges.txt"};
  std::vector<std::string> found;
  bool foreign_weights = false, ours = false;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string f = entry.path().filename().string();
    const bool shard = f.rfind("model-", 0) == 0 && ends_with(f, ".safetensors");
    if (!shard && std::find(std::begin(kNamed), std::end(kNamed), f) == std::end(kNamed)) continue;
    found.push_back(f);
    if (!ends_with(f, ".safetensors")) continue;
    // mpitrain's safetensors say so in their header (write_safetensors); a header that cannot be
    // read is not ours.
    bool mpitrain = false;
    std::ifstream in(entry.path(), std::ios::binary);
    uint64_t n = 0;
    if (in.read(reinterpret_cast<char*>(&n), 8) && n <= (uint64_t{100} << 20) && n <= fs::file_size(entry.path(), ec)) {
      std::string text(n, '\0');
      if (in.read(text.data(), static_cast<std::streamsize>(n))) {
        const json header = json::parse(text, nullptr, /*allow_exceptions=*/false);
        mpitrain = header.is_object() && header.contains("__metadata__") && header["__metadata__"].is_object() &&
                   header["__metadata__"].value("producer", std::string()).rfind("mpitrain ", 0) == 0;
      }
    }
    (mpitrain ? ours : foreign_weights) = true;
  }
  std::sort(found.begin(), found.end());
  return foreign_weights || (!found.empty() && !ours) ? found : std::vector<std::string>{};
}

std::string write_hf_model(const std::string& dir, GPT& model, int64_t eot_token, const HfWriteOptions& opts,
                           const std::function<torch::Tensor(size_t)>& values) {
  const GPTDims& d = model->dims();
  MPITRAIN_CHECK(!model->tp().sharded(), "write_hf_model needs a whole (tp = 1) model");
  const torch::ScalarType type = opts.dtype == "bf16" ? torch::kBFloat16 : opts.dtype == "fp16" ? torch::kFloat16 : torch::kFloat32;
  const char* type_name = opts.dtype == "bf16" ? "BF16" : opts.dtype == "fp16" ? "F16" : "F32";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UsageError(concat("cannot create '", dir, "': ", ec.message()));

  // Automatic vocabulary padding (ModelArgs::vocab_live) stays here: its rows are outside mpitrain's
  // loss and logits, and Hugging Face would make each a class with logit 0. The embedding and the
  // output layer go out with their token rows only, and config.json says that many classes;
  // model.init_from: hf: pads them again as the new run's device and tp need.
  auto exported = [&](const std::string& name, const torch::Tensor& p) {
    return vocab_rows(name) && d.vocab_live > 0 ? p.narrow(0, 0, d.vocab_live) : p;
  };
  auto exported_shape = [&](const std::string& name, std::vector<int64_t> shape) {  // as the file holds it
    if (vocab_rows(name) && d.vocab_live > 0) shape[0] = d.vocab_live;
    if (hf_transposed(name, d)) std::reverse(shape.begin(), shape.end());
    return shape;
  };
  // Shards in parameter order, each at most max_shard_bytes (a larger tensor alone).
  const auto params = model->named_params();
  std::vector<std::vector<size_t>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    uint64_t bytes = c10::elementSize(type);
    for (int64_t e : exported_shape(params[i].first, params[i].second.sizes().vec())) bytes *= static_cast<uint64_t>(e);
    if (!shards.back().empty() && in_shard + bytes > opts.max_shard_bytes) shards.emplace_back(), in_shard = 0;
    shards.back().push_back(i);
    in_shard += bytes, total += bytes;
  }
  const size_t n = shards.size();
  auto shard_name = [&](size_t k) {
    if (n == 1) return std::string("model.safetensors");
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, n);
    return std::string(buf);
  };
  json weight_map = json::object();
  std::string written;
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < n; ++k) {  // one tensor in memory at a time
    std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
    for (size_t i : shards[k]) {
      const auto& [name, p] = params[i];
      shapes.emplace_back(hf_name(name, d), exported_shape(name, p.sizes().vec()));
      weight_map[hf_name(name, d)] = shard_name(k);
    }
    write_safetensors((fs::path(dir) / shard_name(k)).string(), shapes, type, type_name, [&](size_t j) {
      const auto& [name, p] = params[shards[k][j]];
      torch::Tensor t = exported(name, values ? values(shards[k][j]) : p.detach()).to(torch::kCPU, type);
      if (hf_transposed(name, d)) t = t.t();
      return t.contiguous();
    });
    written += shard_name(k) + "\n";
  }
  // The other layout's files go: from_pretrained takes model.safetensors before an index.
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string f = entry.path().filename().string();
    const bool other = n == 1 ? f == "model.safetensors.index.json" || (f.rfind("model-", 0) == 0 && ends_with(f, ".safetensors"))
                              : f == "model.safetensors" || (f.rfind("model-", 0) == 0 && ends_with(f, ".safetensors") &&
                                                             !weight_map.contains(f) && written.find(f + "\n") == std::string::npos);
    if (other) fs::remove(entry.path(), ec);
  }
  if (n > 1)
    write_file_durably((fs::path(dir) / "model.safetensors.index.json").string(),
                       json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2) + "\n");
  write_file_durably((fs::path(dir) / "config.json").string(), config_json(d, eot_token, opts.dtype).dump(2) + "\n");
  if (d.llama())
    write_file_durably((fs::path(dir) / "generation_config.json").string(),
                       json{{"bos_token_id", eot_token}, {"eos_token_id", eot_token}}.dump(2) + "\n");
  return written;
}

namespace {

// Hugging Face safetensors files, every header and value checked, read one parameter at a time.
class HfWeights : public InitialWeights {
 public:
  HfWeights(GPT model, std::string key) : InitialWeights(model, std::move(key)) {}
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, std::pair<SafetensorsFile*, const Entry*>> found;  // by HF name
  std::deque<Entry> unpacked;  // transformers 5's packed experts, one entry per expert's tensor

 private:
  torch::Tensor read_values(size_t k) override {
    const std::string& name = names_.at(k);
    const auto& [file, e] = found.at(hf_name(name, model_->dims()));
    return read_part(*file, *e, name, model_);
  }
};

}  // namespace

std::unique_ptr<InitialWeights> open_hf_safetensors(const std::string& path, GPT& model, const std::string& key) {
  try {
    auto weights = std::make_unique<HfWeights>(model, key);
    const GPTDims& d = model->dims();
    std::map<std::string, SafetensorsFile*> index;
    auto& files = weights->files;
    files = open_safetensors(path, index);
    // HF name -> (file, entry); GPT-2's "transformer." is optional (GPT2Model's files lack it).
    const auto params = model->named_params();
    std::map<std::string, std::string> ours;  // HF name -> mpitrain name
    for (const auto& [name, p] : params) ours[hf_name(name, d)] = name;
    // Expert and pipeline parallelism: the files hold every expert and block; those this rank
    // does not hold are its ep peers' and the other stages' (read by them), not unknown tensors.
    std::set<std::string> peers;
    if (d.ep > 1 || d.pp > 1)
      for (const std::string& name : whole_model_names(d))
        if (const std::string hf = hf_name(name, d); !ours.count(hf)) peers.insert(hf);
    auto& found = weights->found;
    const Entry* lm_head = nullptr;
    SafetensorsFile* lm_head_file = nullptr;
    std::vector<std::string> unknown;
    // A file's tensor under its HF name: a parameter's (once in all the files), else unknown.
    auto enter = [&](const std::string& hf, SafetensorsFile* file, const Entry* entry) {
      if (!ours.count(hf)) {
        if (!ignored_buffer(hf, d) && !peers.count(hf)) unknown.push_back(entry->name);
        return;
      }
      if (found.count(hf)) throw UsageError(concat(file->path, ": tensor '", entry->name, "' is also in ", found[hf].first->path));
      found[hf] = {file, entry};
    };
    for (const auto& f : files)
      for (const auto& e : f->entries) {
        if (!index.empty()) {  // the index says which file holds each tensor
          const auto listed = index.find(e.name);
          if (listed == index.end())
            throw UsageError(concat(f->path, ": tensor '", e.name, "' is not in model.safetensors.index.json's weight_map"));
          if (listed->second != f.get()) continue;  // a copy the index does not name: another file holds it
        }
        std::string name = e.name;
        if (!d.llama() && name.rfind(kPrefix, 0) != 0 && name != "lm_head.weight") name = kPrefix + name;
        if (d.llama()) {
          const auto experts = unpack_experts(f->path, e, d.family_row(), weights->unpacked);
          for (const auto& [hf, entry] : experts) enter(hf, f.get(), entry);
          if (!experts.empty()) continue;
          // transformers 5's Mixtral: the router under mlp, as the other families' (4: block_sparse_moe).
          const std::string v5_router = ".mlp.gate.weight";
          if (d.family_row().name == std::string("mixtral") && ends_with(name, v5_router))
            name = name.substr(0, name.size() - v5_router.size()) + ".block_sparse_moe.gate.weight";
        }
        if (name == "lm_head.weight" && !ours.count(name) && !peers.count(name)) {
          lm_head = &e, lm_head_file = f.get();
        } else {
          enter(name, f.get(), &e);
        }
      }
    std::vector<std::string> missing;
    for (const auto& [name, p] : params)
      if (!found.count(hf_name(name, d))) missing.push_back(hf_name(name, d));
    const char* family = d.llama() ? "Llama" : "GPT-2";
    if (!missing.empty() || !unknown.empty())
      throw UsageError(concat(path, ": ", missing.empty() ? "" : concat("missing ", first_few(missing)),
                              !missing.empty() && !unknown.empty() ? "; " : "",
                              unknown.empty() ? "" : concat(first_few(unknown), " match no ", family, " parameter"),
                              d.llama() ? " (Hugging Face Llama names, e.g. model.layers.0.self_attn.q_proj.weight)"
                                        : " (Hugging Face GPT-2 names, e.g. transformer.h.0.attn.c_attn.weight)"));
    for (const auto& [name, p] : params) {
      const auto& [file, e] = found[hf_name(name, d)];
      std::vector<int64_t> want = tp_whole_shape(p.sizes(), model->tp_split(name), model->tp().size);  // the files hold whole tensors
      if (vocab_rows(name)) want[0] = d.classes();  // without automatic padding's rows (write_hf_model)
      if (hf_transposed(name, d)) std::reverse(want.begin(), want.end());
      if (e->shape != want)
        throw UsageError(concat(file->path, ": tensor '", e->name, "' has shape ", shape_text(e->shape), ", the model needs ",
                                shape_text(want),
                                name == "wte.weight" || name == "wpe.weight" || name == "lm_head.weight"
                                    ? " (model.vocab_size and model.seq_len must equal the file's vocab_size and n_positions)"
                                    : concat(" (model.n_layer, n_head, n_kv_head, n_embd, head_dim (", d.head_dim(),
                                             ") and intermediate_size must equal the file's)")));
    }
    // (A pipeline stage without the embedding leaves a tied copy of lm_head to the stages with it.)
    if (!found.count(hf_name("wte.weight", d))) lm_head = nullptr;
    const Entry* wte = lm_head ? found[hf_name("wte.weight", d)].second : nullptr;
    if (lm_head && lm_head->shape != wte->shape)
      throw UsageError(concat(lm_head_file->path, ": lm_head.weight has shape ", shape_text(lm_head->shape), ", not the embedding's"));
    // Every header check passed. The values are read twice, one tensor at a time: once to check
    // them (finite; a tied lm_head equal to the embedding), then to copy them, so that a refused
    // file changes no weight and no second copy of the model is ever held (an 8B model is 16 GB
    // in bf16; the second read mostly comes from the page cache). A tensor-parallel rank reads
    // its shards (read_part), so the ranks of a tp group check the file between them.
    if (lm_head) {
      torch::Tensor head = read_part(*lm_head_file, *lm_head, "wte.weight", model);
      const auto& [file, e] = found[hf_name("wte.weight", d)];
      if (!torch::equal(head, read_part(*file, *e, "wte.weight", model)))
        throw UsageError(concat(lm_head_file->path,
                                ": lm_head.weight differs from the token embedding: mpitrain ties the output layer to it",
                                d.llama() ? " (this model has tie_embeddings true)" : ""));
    }
    for (const auto& [name, p] : params) {
      const auto& [file, e] = found[hf_name(name, d)];
      read_part(*file, *e, name, model);
    }
    return weights;
  } catch (const UsageError& e) {
    throw UsageError(concat(key, ": ", e.what()));
  }
}

int64_t load_hf_safetensors(const std::string& path, GPT& model, const std::string& key) {
  return open_hf_safetensors(path, model, key)->copy_into(model);
}

InitialWeights::InitialWeights(GPT model, std::string key) : model_(std::move(model)), key_(std::move(key)) {
  for (const auto& [name, p] : model_->named_params()) names_.push_back(name);
}

torch::Tensor InitialWeights::read(size_t k) {
  try {
    return read_values(k);
  } catch (const UsageError& e) {
    throw UsageError(concat(key_, ": ", e.what()));
  }
}

int64_t InitialWeights::copy_into(GPT& model) {
  torch::NoGradGuard no_grad;
  const auto params = model->named_params();
  MPITRAIN_CHECK(params.size() == names_.size(), "initial weights: another model");
  for (size_t k = 0; k < params.size(); ++k) params[k].second.copy_(read(k));
  return static_cast<int64_t>(params.size());
}

std::unique_ptr<InitialWeights> open_initial_weights(const std::string& path, GPT& model, const std::string& key) {
  std::error_code ec;
  if (path.rfind("hf:", 0) == 0) return open_hf_safetensors(path.substr(3), model, key);
  if (ends_with(path, ".safetensors")) return open_hf_safetensors(path, model, key);
  if (fs::is_directory(path, ec) && (fs::exists(fs::path(path) / "model.safetensors", ec) ||
                                     fs::exists(fs::path(path) / "model.safetensors.index.json", ec)))
    return open_hf_safetensors(path, model, key);
  return open_npy_weights(path, model, key);
}

int64_t load_initial_weights(const std::string& path, GPT& model, const std::string& key) {
  return open_initial_weights(path, model, key)->copy_into(model);
}

// ---- initial weights from .npy files (model.init_from) -----------------------------------------

namespace {

// Where one parameter's values are in its file, checked against the parameter.
struct NpyWeight {
  std::string path;
  torch::ScalarType dtype;
  uint64_t offset;
};

NpyWeight check_npy_weight(const std::string& path, const std::string& name, const std::vector<int64_t>& shape,
                           const GPTDims& d) {
  const NpyHeader h = read_npy_header(path, "float32 '<f4' or float64 '<f8'");
  static const std::pair<const char*, torch::ScalarType> known[] = {
      {"<f4", torch::kFloat32}, {"<f8", torch::kFloat64}, {"<f2", torch::kFloat16}};
  const auto* type =
      std::find_if(std::begin(known), std::end(known), [&](const auto& k) { return h.descr == k.first; });
  if (type == std::end(known))
    throw UsageError(concat(path, ": dtype '", h.descr, "', expected little-endian float32 '<f4' or float64 '<f8'"));
  if (h.fortran_order)
    throw UsageError(concat(path, ": fortran_order is True, expected False (C order: np.ascontiguousarray)"));
  const std::vector<uint64_t> want(shape.begin(), shape.end());
  uint64_t numel = 1;
  for (uint64_t e : want) numel *= e;
  if (h.shape != want) {
    const bool transposed = want.size() == 2 && h.shape == std::vector<uint64_t>{want[1], want[0]};
    const bool conv1d = hf_transposed(name, d);
    throw UsageError(concat(path, ": shape ", npy_shape_text(h.shape), ", but parameter '", name, "' has shape ",
                            npy_shape_text(want),
                            !transposed ? "" : conv1d ? " (transposed? Hugging Face GPT-2's Conv1D weights need .T)"
                                                      : " (transposed?)"));
  }
  const uint64_t need = h.data_offset + numel * c10::elementSize(type->second);
  if (h.file_size != need)
    throw UsageError(concat(path, ": size ", h.file_size, " bytes, but shape ", npy_shape_text(h.shape), " of '",
                            h.descr, "' needs ", need, " (", h.file_size < need ? "truncated" : "trailing data", ")"));
  return {path, type->second, h.data_offset};
}

// The file's values as fp32, of the checked `shape`.
torch::Tensor read_npy_weight(const NpyWeight& w, const std::vector<int64_t>& shape) {
  torch::Tensor buf = torch::empty(shape, w.dtype);
  std::ifstream in(w.path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(w.offset));
  in.read(static_cast<char*>(buf.data_ptr()), static_cast<std::streamsize>(buf.nbytes()));
  if (!in) throw UsageError(concat(w.path, ": read error (did the file change while loading?)"));
  if (!torch::isfinite(buf).all().item<bool>()) throw UsageError(concat(w.path, ": holds NaN or infinite values"));
  return buf.to(torch::kFloat32);
}

}  // namespace

namespace {

// A directory of .npy files, every header checked, read one parameter at a time (the values are
// checked as they are read).
class NpyWeights : public InitialWeights {
 public:
  NpyWeights(GPT model, std::string key) : InitialWeights(model, std::move(key)) {}
  std::vector<NpyWeight> files;
  std::vector<std::vector<int64_t>> shapes;  // the whole parameters'

 private:
  torch::Tensor read_values(size_t k) override {
    return tp_shard(read_npy_weight(files.at(k), shapes.at(k)), model_->tp_split(names_.at(k)), model_->tp().rank,
                    model_->tp().size);
  }
};

}  // namespace

std::unique_ptr<InitialWeights> open_npy_weights(const std::string& dir, GPT& model, const std::string& key) {
  namespace fs = std::filesystem;
  try {
    auto weights = std::make_unique<NpyWeights>(model, key);
    std::error_code ec;
    if (!fs::is_directory(dir, ec))
      throw UsageError(fs::exists(dir, ec) ? concat("'", dir, "' is not a directory")
                                           : concat("no such directory '", dir, "'"));
    const auto params = model->named_params();
    std::set<std::string> wanted, found;
    for (const auto& [name, p] : params) wanted.insert(name + ".npy");
    std::vector<std::string> extra, missing;
    fs::directory_iterator it(dir, ec), end;
    for (; !ec && it != end; it.increment(ec)) {
      const std::string file = it->path().filename().string();
      if (file.size() < 4 || file.compare(file.size() - 4, 4, ".npy") != 0) continue;
      if (wanted.count(file)) found.insert(file);
      else extra.push_back(it->path().string());
    }
    if (ec) throw UsageError(concat(dir, ": cannot list directory: ", ec.message()));
    for (const auto& [name, p] : params)
      if (!found.count(name + ".npy")) missing.push_back((fs::path(dir) / (name + ".npy")).string());
    std::sort(extra.begin(), extra.end());
    if (!missing.empty() || !extra.empty()) {
      std::string msg;
      if (!missing.empty())
        msg = concat("missing ", first_few(missing), " (one <parameter name>.npy per model parameter)");
      const bool lm_head = std::any_of(extra.begin(), extra.end(), [](const std::string& f) {
        return fs::path(f).filename() == "lm_head.weight.npy";
      });
      if (!extra.empty())
        msg += concat(msg.empty() ? "" : "; ", first_few(extra), extra.size() == 1 ? " matches" : " match",
                      " no model parameter (a naming mistake? the parameters are wte.weight, wpe.weight, ",
                      "h.<layer>.attn.c_attn.weight, ..., ln_f.bias; docs/formats.md",
                      lm_head ? "; lm_head.weight is tied to wte.weight: leave it out)" : ")");
      throw UsageError(msg);
    }
    // Every header and size checked before any weight changes; the files hold whole parameters,
    // of which a tensor-parallel rank keeps its shard.
    const GPTDims& d = model->dims();
    for (const auto& [name, p] : params) {
      weights->shapes.push_back(tp_whole_shape(p.sizes(), model->tp_split(name), model->tp().size));
      weights->files.push_back(
          check_npy_weight((fs::path(dir) / (name + ".npy")).string(), name, weights->shapes.back(), d));
    }
    return weights;
  } catch (const UsageError& e) {
    throw UsageError(concat(key, ": ", e.what()));
  }
}

int64_t load_npy_weights(const std::string& dir, GPT& model, const std::string& key) {
  return open_npy_weights(dir, model, key)->copy_into(model);
}

}  // namespace mpitrain
