// GPT-2 in Hugging Face's format: safetensors + config.json (see hf_format.h).
#include "mpitrain/hf_format.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "mpitrain/checkpoint.h"
#include "mpitrain/durable.h"
#include "mpitrain/error.h"

namespace mpitrain {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kPrefix = "transformer.";

struct DtypeName {
  const char* safetensors;
  torch::ScalarType torch;
};
const DtypeName kDtypes[] = {
    {"F32", torch::kFloat32}, {"F16", torch::kFloat16}, {"BF16", torch::kBFloat16}, {"F64", torch::kFloat64}};

// Replaces `path` atomically by `bytes` (written to path.tmp, then renamed).

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

torch::Tensor read_tensor(const std::string& path, std::ifstream& in, uint64_t data_start, const Entry& e) {
  torch::Tensor t = torch::empty(e.shape, e.dtype);
  in.seekg(static_cast<std::streamoff>(data_start + e.begin));
  in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin));
  if (!in) throw UsageError(concat(path, ": tensor '", e.name, "': read error"));
  t = t.to(torch::kFloat32);
  if (!torch::isfinite(t).all().item<bool>()) throw UsageError(concat(path, ": tensor '", e.name, "' holds NaN or infinite values"));
  return t;
}

}  // namespace

std::string hf_name(const std::string& name) { return kPrefix + name; }

bool hf_transposed(const std::string& name) {
  const bool linear = name.find(".attn.c_") != std::string::npos || name.find(".mlp.c_") != std::string::npos;
  return linear && name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
}

void write_hf_model(const std::string& dir, GPT& model, int64_t eot_token, const std::string& dtype) {
  const GPTDims& d = model->dims();
  MPITRAIN_CHECK(d.tp == 1, "write_hf_model needs a whole (tp = 1) model");
  const torch::ScalarType type = dtype == "bf16" ? torch::kBFloat16 : dtype == "fp16" ? torch::kFloat16 : torch::kFloat32;
  const char* type_name = dtype == "bf16" ? "BF16" : dtype == "fp16" ? "F16" : "F32";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UsageError(concat("cannot create '", dir, "': ", ec.message()));

  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}, {"producer", concat("mpitrain ", MPITRAIN_VERSION)}};
  std::vector<torch::Tensor> data;
  uint64_t at = 0;
  torch::NoGradGuard no_grad;
  for (const auto& [name, p] : model->named_params()) {
    torch::Tensor t = p.detach().to(torch::kCPU, type);
    if (hf_transposed(name)) t = t.t();
    t = t.contiguous();
    const uint64_t bytes = t.nbytes();
    header[hf_name(name)] = {{"dtype", type_name}, {"shape", t.sizes().vec()}, {"data_offsets", {at, at + bytes}}};
    at += bytes;
    data.push_back(t);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::string bytes;
  bytes.reserve(8 + text.size() + at);
  const uint64_t n = text.size();
  bytes.append(reinterpret_cast<const char*>(&n), 8);
  bytes += text;
  for (const auto& t : data) bytes.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
  write_file_durably((fs::path(dir) / "model.safetensors").string(), bytes);

  const json config = {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"vocab_size", d.vocab_size},
      {"n_positions", d.seq_len},
      {"n_ctx", d.seq_len},
      {"n_embd", d.n_embd},
      {"n_layer", d.n_layer},
      {"n_head", d.n_head},
      {"n_inner", nullptr},
      {"activation_function", "gelu_new"},
      {"layer_norm_epsilon", 1e-5},
      {"initializer_range", 0.02},
      {"resid_pdrop", d.dropout},
      {"embd_pdrop", d.dropout},
      {"attn_pdrop", d.dropout},
      {"scale_attn_weights", true},
      {"tie_word_embeddings", true},
      {"use_cache", true},
      {"bos_token_id", eot_token},
      {"eos_token_id", eot_token},
      {"torch_dtype", dtype == "bf16" ? "bfloat16" : dtype == "fp16" ? "float16" : "float32"},
  };
  write_file_durably((fs::path(dir) / "config.json").string(), config.dump(2) + "\n");
}

int64_t load_hf_safetensors(const std::string& path, GPT& model, const std::string& key) {
  try {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw UsageError(concat(path, ": cannot open: ", std::strerror(errno)));
    uint64_t data_start = 0;
    const std::vector<Entry> entries = read_header(path, in, data_start);
    // mpitrain's name of each file entry: "transformer." is optional (GPT2Model's files lack it)
    std::map<std::string, const Entry*> by_name;
    const Entry* lm_head = nullptr;
    std::vector<std::string> unknown;
    const auto params = model->named_params();
    std::map<std::string, torch::Tensor> wanted;
    for (const auto& [name, p] : params) wanted[name] = p;
    for (const auto& e : entries) {
      std::string name = e.name.rfind(kPrefix, 0) == 0 ? e.name.substr(std::strlen(kPrefix)) : e.name;
      if (name == "lm_head.weight") lm_head = &e;
      else if (wanted.count(name)) by_name[name] = &e;
      else if (name.size() > 10 && (name.compare(name.size() - 10, 10, ".attn.bias") == 0 ||
                                    name.find(".attn.masked_bias") != std::string::npos))
        continue;  // the causal-mask buffers older files carry
      else unknown.push_back(e.name);
    }
    std::vector<std::string> missing;
    for (const auto& [name, p] : params)
      if (!by_name.count(name)) missing.push_back(hf_name(name));
    if (!missing.empty() || !unknown.empty())
      throw UsageError(concat(path, ": ", missing.empty() ? "" : concat("missing ", first_few(missing)),
                              !missing.empty() && !unknown.empty() ? "; " : "",
                              unknown.empty() ? "" : concat(first_few(unknown), " match no GPT-2 parameter"),
                              " (Hugging Face GPT-2 names, e.g. transformer.h.0.attn.c_attn.weight)"));
    for (const auto& [name, p] : params) {
      const Entry& e = *by_name[name];
      std::vector<int64_t> want = p.sizes().vec();
      if (hf_transposed(name)) std::reverse(want.begin(), want.end());
      if (e.shape != want)
        throw UsageError(concat(path, ": tensor '", e.name, "' has shape ", shape_text(e.shape), ", the model needs ",
                                shape_text(want),
                                name == "wte.weight" || name == "wpe.weight"
                                    ? " (model.vocab_size and model.seq_len must equal the file's vocab_size and n_positions)"
                                    : " (model.n_layer, n_head and n_embd must equal the file's)"));
    }
    if (lm_head && lm_head->shape != by_name["wte.weight"]->shape)
      throw UsageError(concat(path, ": lm_head.weight has shape ", shape_text(lm_head->shape), ", not wte's"));
    // Every check passed: read, convert and check the values, then change the weights.
    std::vector<torch::Tensor> values;
    for (const auto& [name, p] : params) {
      torch::Tensor t = read_tensor(path, in, data_start, *by_name[name]);
      values.push_back(hf_transposed(name) ? t.t().contiguous() : t);
    }
    const auto wte = std::find_if(params.begin(), params.end(), [](const auto& p) { return p.first == "wte.weight"; });
    if (lm_head && !torch::equal(read_tensor(path, in, data_start, *lm_head), values[wte - params.begin()]))
      throw UsageError(concat(path, ": lm_head.weight differs from the token embedding: mpitrain ties the output layer to it"));
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].second.copy_(values[i]);
    return static_cast<int64_t>(params.size());
  } catch (const UsageError& e) {
    throw UsageError(concat(key, ": ", e.what()));
  }
}

int64_t load_initial_weights(const std::string& path, GPT& model, const std::string& key) {
  std::error_code ec;
  if (path.size() > 12 && path.compare(path.size() - 12, 12, ".safetensors") == 0)
    return load_hf_safetensors(path, model, key);
  if (fs::is_directory(path, ec) && fs::exists(fs::path(path) / "model.safetensors", ec))
    return load_hf_safetensors((fs::path(path) / "model.safetensors").string(), model, key);
  return load_npy_weights(path, model, key);
}

}  // namespace mpitrain
