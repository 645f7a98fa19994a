// The family rows and the architecture fields' table (model_fields.h).
#include "mpitrain/model_fields.h"

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cctype>
#include <type_traits>

#include "mpitrain/error.h"

namespace mpitrain {

// ---- families ------------------------------------------------------------------------------------

const std::vector<Family>& families() {
  static const std::vector<Family> kFamilies = {
      // name, block, HF class, model_type, qkv_bias, qk_norm, windowed layers, MLP gate, Gemma norms, q/k norms
      // over the whole projection
      {"gpt2", "gpt2", "GPT2LMHeadModel", "gpt2", true, false, 0, "", false, false,
       "LayerNorm, learned positions, GELU MLP, biases everywhere, tied output"},
      {"llama", "llama", "LlamaForCausalLM", "llama", false, false, 0, "silu", false, false,
       "RMSNorm, rotary, SwiGLU, grouped-query attention (Llama 3.x)"},
      {"qwen2", "llama", "Qwen2ForCausalLM", "qwen2", true, false, 0, "silu", false, false,
       "llama's block with q/k/v biases (Qwen2, Qwen2.5)"},
      {"qwen3", "llama", "Qwen3ForCausalLM", "qwen3", false, true, 0, "silu", false, false,
       "llama's block with an RMSNorm over each head's q and k (Qwen3)"},
      {"mistral", "llama", "MistralForCausalLM", "mistral", false, false, 1, "silu", false, false,
       "llama's block with an attention window on every layer (Mistral 7B)"},
      {"gemma2", "llama", "Gemma2ForCausalLM", "gemma2", false, false, 2, "gelu_pytorch_tanh", true, false,
       "llama's block with GeGLU, RMSNorm x (1 + w) before and after each sublayer, the embedding x sqrt(n_embd), "
       "soft-capped attention scores and logits, a window on every other layer (Gemma 2)"},
      {"gemma3", "llama", "Gemma3ForCausalLM", "gemma3_text", false, true, 6, "gelu_pytorch_tanh", true, false,
       "Gemma 2's block with q/k norms x (1 + w), five windowed layers with a rotary base of their own to one "
       "global layer, no soft caps (Gemma 3, text)"},
      {"qwen3_moe", "llama", "Qwen3MoeForCausalLM", "qwen3_moe", false, true, 0, "silu", false, false,
       "Qwen3's block whose MLPs are mixtures of SwiGLU experts chosen per token by a router (Qwen3-MoE)"},
      {"mixtral", "llama", "MixtralForCausalLM", "mixtral", false, false, 1, "silu", false, false,
       "Mistral's block (a window on every layer when set) whose MLPs are all mixtures of SwiGLU experts (Mixtral)"},
      {"olmoe", "llama", "OlmoeForCausalLM", "olmoe", false, true, 0, "silu", false, true,
       "llama's block with an RMSNorm over the whole q and k projections, its MLPs all mixtures of SwiGLU experts (OLMoE)"},
  };
  return kFamilies;
}

const Family* find_family(const std::string& name) {
  for (const Family& f : families())
    if (name == f.name) return &f;
  return nullptr;
}

const Family* family_by_model_type(const std::string& hf_model_type) {
  for (const Family& f : families())
    if (hf_model_type == f.hf_model_type) return &f;
  return nullptr;
}

std::string family_names(const char* sep) {
  std::string names;
  for (const Family& f : families()) names += names.empty() ? f.name : concat(sep, f.name);
  return names;
}

const Family& family_of_parts(const std::string& block, bool qkv_bias, bool qk_norm, int64_t window) {
  // (Gemma 2 and 3 have parts no flag here says: a model is gemma2 or gemma3 only by name.)
  const char* name = block != "llama" ? "gpt2"
                     : window > 0        ? "mistral"
                     : qkv_bias          ? "qwen2"
                     : qk_norm           ? "qwen3"
                                         : "llama";
  return *find_family(name);
}

const char* family_conflict(const Family& f, const std::string& block, bool qkv_bias, bool qk_norm, int64_t window) {
  if (block != f.block) return "arch";
  if (block != "llama") return nullptr;
  if (qkv_bias != f.qkv_bias) return "qkv_bias";
  if (qk_norm != f.qk_norm) return "qk_norm";
  if (window > 0 && f.window_pattern == 0) return window_key();
  return nullptr;
}

const char* family_conflict(const Family& f, const ModelArgs& a) {
  return family_conflict(f, a.arch, a.qkv_bias, a.qk_norm, a.sliding_window);
}

const char* window_key() { return "sliding_window"; }

std::string ModelArgs::local_layers() const {
  const int p = family_row().window_pattern;
  return p == 1 ? "every layer" : p == 2 ? "every other layer" : concat(p - 1, " of every ", p, " layers");
}

bool ModelArgs::local_layer(int64_t layer) const {
  const int p = family_row().window_pattern;
  return p == 1 || (p >= 2 && (layer + 1) % p != 0);
}

int64_t ModelArgs::window_of_layer(int64_t layer) const { return local_layer(layer) ? sliding_window : 0; }

const Family& ModelArgs::family_row() const {
  if (family.empty()) return family_of_parts(arch, qkv_bias, qk_norm, sliding_window);
  const Family* f = find_family(family);
  MPITRAIN_CHECK(f, concat("ModelArgs: unknown family '", family, "'"));
  return *f;
}

// ---- the architecture fields ----------------------------------------------------------------------

namespace {

using Type = ModelField::Type;
using Value = ModelField::Value;

// The config's value into the dims': as it is, or a flag's "true".
int64_t same_int(int64_t v) { return v; }
double same_number(double v) { return v; }
bool is_true(const std::string& flag) { return flag == "true"; }
std::string nothing(const ModelArgs&) { return std::string(); }  // a field the start-up line does not describe

// A value into the config's member: as it is, a flag as "true"/"false".
void to_config_member(int64_t& m, const ModelField::Value& v) { m = std::get<int64_t>(v); }
void to_config_member(double& m, const ModelField::Value& v) { m = std::get<double>(v); }
void to_config_member(std::string& m, const ModelField::Value& v) {
  m = std::holds_alternative<bool>(v) ? (std::get<bool>(v) ? "true" : "false") : std::get<std::string>(v);
}

}  // namespace

namespace {
// A generic row's value in a config: its text in args, else the row's fallback (a text the YAML
// reader accepted, so it parses).
ModelField::Value args_value(const ModelConfig& c, const char* key) {
  const ModelField& f = *find_model_field(key);
  const auto it = c.args.find(key);
  ModelField::Value v = f.fallback;
  if (const char* fixed = fixed_value_of(f, c.family); fixed && it == c.args.end())
    MPITRAIN_CHECK(field_from_text(f, fixed, v), concat("model.", key, ": fixed '", fixed, "'"));
  if (it != c.args.end()) MPITRAIN_CHECK(field_from_text(f, it->second, v), concat("model.", key, ": '", it->second, "'"));
  return v;
}
}  // namespace

int64_t window_of_config(const ModelConfig& c) { return std::get<int64_t>(args_value(c, window_key())); }

bool field_from_text(const ModelField& f, const std::string& text, ModelField::Value& out) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  char* end = nullptr;
  errno = 0;
  switch (f.type) {
    case Type::integer: {
      const long long v = std::strtoll(text.c_str(), &end, 10);
      if (errno == ERANGE || *end != '\0') return false;
      out = int64_t{v};
      return true;
    }
    case Type::number: {
      const double v = std::strtod(text.c_str(), &end);
      if (*end != '\0' || !std::isfinite(v)) return false;
      out = v;
      return true;
    }
    case Type::flag:
      if (text != "true" && text != "false") return false;
      out = text == "true";
      return true;
    case Type::text: out = text; return true;
  }
  return false;
}

std::string field_value_text(const ModelField::Value& v) {
  if (const bool* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (const double* d = std::get_if<double>(&v)) {  // the shortest text that reads back the same
    char buf[32];
    for (int precision = 1; precision <= 17; ++precision) {
      std::snprintf(buf, sizeof buf, "%.*g", precision, *d);
      if (std::strtod(buf, nullptr) == *d) break;
    }
    return buf;
  }
  if (const int64_t* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  return std::get<std::string>(v);
}

namespace {
// The value after " name=" in the space-separated list `list`, or nullptr (kept until the next call).
const char* listed(const char* list, const std::string& name) {
  static thread_local std::string found;
  const std::string all = concat(" ", list, " "), key = concat(" ", name, "=");
  const size_t at = all.find(key);
  if (at == std::string::npos) return nullptr;
  const size_t from = at + key.size();
  found = all.substr(from, all.find(' ', from) - from);
  return found.c_str();
}
}  // namespace

const char* hf_default_of(const ModelField& f, const std::string& hf_model_type) { return listed(f.hf_defaults, hf_model_type); }

const char* fixed_value_of(const ModelField& f, const std::string& family) { return listed(f.fixed_by_family, family); }

std::string hf_key_of(const ModelField& f, const std::string& hf_model_type) {
  if (const char* other = listed(f.hf_key, hf_model_type)) return other;
  const std::string all = f.hf_key;
  return all.substr(0, all.find(' '));
}

// A row whose ModelArgs member and ModelConfig member are both named `key` (flags: "true"/"false"
// in the config), with `convert` from the config's value, and `describe` its part of the start-up
// line.
#define MPITRAIN_DIMS_FIELD(key, type, llama_block, families, required, fallback, lo, hi, values, hf_key, hf_null,  \
                            resume_may_change, convert, describe)                                                  \
  ModelField {                                                                                                     \
    #key, type, llama_block, families, required, Value(fallback), lo, hi, values, hf_key, hf_null,                 \
        resume_may_change, [](const ModelArgs& d) { return Value(d.key); },                                        \
        [](ModelArgs& d, const Value& v) { d.key = std::get<std::decay_t<decltype(d.key)>>(v); },                  \
        [](ModelArgs& d, const ModelConfig& c) { d.key = convert(c.key); },                                        \
        [](ModelConfig& c, const Value& v) { to_config_member(c.key, v); }, describe, "", "", false               \
  }

// A generic row (ModelField::generic): a llama-block field of `families` kept by key in
// ModelConfig::args, optional in files (before it: `fallback`), fixed on resume, config.json's key
// `hf_key` with the class defaults `hf_defaults`, fixed by some families to `fixed`.
#define MPITRAIN_ARGS_FIELD(key, type, families, fallback, lo, hi, hf_key, hf_defaults, fixed, describe)            \
  MPITRAIN_ARGS_FIELD_NULL(key, type, families, fallback, lo, hi, hf_key, false, hf_defaults, fixed, describe)
// The same with `hf_null`: config.json's null (and its absence where the class has no default) is
// the fallback, which the export writes as null (a window of 0: none).
#define MPITRAIN_ARGS_FIELD_NULL(key, type, families, fallback, lo, hi, hf_key, hf_null, hf_defaults, fixed, describe) \
  ModelField {                                                                                                     \
    #key, type, true, families, false, Value(fallback), lo, hi, "", hf_key, hf_null, false,                        \
        [](const ModelArgs& d) { return Value(d.key); },                                                           \
        [](ModelArgs& d, const Value& v) { d.key = std::get<std::decay_t<decltype(d.key)>>(v); },                  \
        [](ModelArgs& d, const ModelConfig& c) { d.key = std::get<std::decay_t<decltype(d.key)>>(args_value(c, #key)); }, \
        [](ModelConfig& c, const Value& v) { c.args[#key] = field_value_text(v); }, describe, hf_defaults, fixed,  \
        true                                                                                                       \
  }

const std::vector<ModelField>& model_fields() {
  static const std::vector<ModelField> kFields = [] {
    constexpr int64_t kBig = INT64_MAX, kInt32 = INT32_MAX;
    constexpr bool llama = true, any = false, required = true, optional = false, may_change = true, fixed = false;
    // clang-format off
    std::vector<ModelField> rows = {
        // key, type, block, families, in every file?, absent means, range, text values, config.json key, its null
        // = none?, resume, from config, start-up description
        // The block (gpt2 | llama) comes first: whether the llama rows apply depends on it.
        MPITRAIN_DIMS_FIELD(arch, Type::text, any, "", optional, std::string("gpt2"), 0, 0, "gpt2|llama", "", false, fixed,
                            [](const std::string& a) { return a.empty() ? std::string("gpt2") : a; }, nothing),
        MPITRAIN_DIMS_FIELD(norm_eps, Type::number, any, "", optional, 1e-5, 0, 0, "", "rms_norm_eps", false, fixed,
                            [](double e) { return e > 0 ? e : 1e-5; }, nothing),
        MPITRAIN_DIMS_FIELD(n_kv_head, Type::integer, llama, "", required, int64_t{0}, 1, kInt32, "", "num_key_value_heads", false,
                            fixed, same_int, nothing),
        MPITRAIN_DIMS_FIELD(intermediate_size, Type::integer, llama, "", required, int64_t{0}, 1, kBig, "",
                            "intermediate_size", false, fixed, same_int,
                            [](const ModelArgs& d) {
                              return concat(std::string(d.family_row().mlp_act) == "silu" ? ", SwiGLU " : ", GeGLU ",
                                            d.intermediate_size);
                            }),
        // config.json's max_position_embeddings: metadata, not the weights' shape.
        MPITRAIN_DIMS_FIELD(max_position, Type::integer, llama, "", required, int64_t{0}, 1, kBig, "",
                            "max_position_embeddings", false, may_change, same_int, nothing),
        MPITRAIN_DIMS_FIELD(rope_theta, Type::number, llama, "", required, 0.0, 0, 0, "", "rope_theta", false, fixed, same_number,
                            [](const ModelArgs& d) { return concat(", rope theta ", d.rope_theta); }),
        // Llama 3.1's scaling: config.json's rope_scaling object (hf_format.cpp, hf_config.cpp).
        MPITRAIN_DIMS_FIELD(rope_scaling, Type::text, llama, "", optional, std::string("none"), 0, 0, "none|llama3|linear", "", false,
                            fixed, [](const std::string& v) { return v.empty() ? std::string("none") : v; },
                            [](const ModelArgs& d) {
                              return d.rope_scaling == "llama3"   ? std::string(" (llama3 scaling)")
                                     : d.rope_scaling == "linear" ? concat(", global rope / ", d.rope_factor)
                                                                  : std::string();
                            }),
        MPITRAIN_DIMS_FIELD(rope_factor, Type::number, llama, "", required, 0.0, 0, 0, "", "", false, fixed, same_number, nothing),
        MPITRAIN_DIMS_FIELD(rope_low_freq_factor, Type::number, llama, "", required, 0.0, 0, 0, "", "", false, fixed, same_number,
                            nothing),
        MPITRAIN_DIMS_FIELD(rope_high_freq_factor, Type::number, llama, "", required, 0.0, 0, 0, "", "", false, fixed,
                            same_number, nothing),
        MPITRAIN_DIMS_FIELD(rope_original_max_position, Type::integer, llama, "", required, int64_t{0}, 0, kBig, "", "", false,
                            fixed, same_int, nothing),
        // The family's flag (family_conflict): config.json says it by model_type.
        MPITRAIN_DIMS_FIELD(qkv_bias, Type::flag, llama, "", required, false, 0, 1, "", "", false, fixed, is_true,
                            [](const ModelArgs& d) { return std::string(d.qkv_bias ? ", qkv bias" : ""); }),
        MPITRAIN_DIMS_FIELD(tie_embeddings, Type::flag, llama, "", required, true, 0, 1, "", "tie_word_embeddings", false, fixed,
                            is_true,
                            [](const ModelArgs& d) { return std::string(d.tie_embeddings ? ", tied output" : ", untied output"); }),
        // The head size: files since Qwen3 record it; older files (and gpt2) have n_embd / n_head.
        ModelField{"head_dim", Type::integer, llama, "", optional, Value(int64_t{0}), 2, 1 << 16, "", "head_dim", false,
                   fixed, [](const ModelArgs& d) { return Value(d.head_dim()); },
                   [](ModelArgs& d, const Value& v) { d.head_size = std::get<int64_t>(v); },
                   [](ModelArgs& d, const ModelConfig& c) { d.head_size = c.head_dim; },
                   [](ModelConfig& c, const Value& v) { c.head_dim = std::get<int64_t>(v); }, nothing, "", "", false},
        MPITRAIN_DIMS_FIELD(qk_norm, Type::flag, llama, "", optional, false, 0, 1, "", "", false, fixed, is_true,
                            [](const ModelArgs& d) {  // with the family's norms (Gemma's)
                              return concat(d.qk_norm ? ", q/k norms" : "", d.family_row().gemma_norms
                                                                                ? ", norms x (1 + w) before and after each sublayer"
                                                                                : "");
                            }),
        // The window of the family's windowed layers (0: none; files before it have none): the
        // families with windowed layers (Family::window_pattern) only.
        // Kept by key (generic): named only here, in ModelArgs and where the attention uses it.
        MPITRAIN_ARGS_FIELD_NULL(sliding_window, Type::integer, "mistral|gemma2|gemma3|mixtral", int64_t{0}, 0, kInt32,
                                 "sliding_window", true, "mistral=4096 gemma2=4096 gemma3_text=4096", "",
                            [](const ModelArgs& d) {
                              if (d.sliding_window == 0) return std::string();
                              return concat(", attention window ", d.sliding_window,
                                            d.family_row().window_pattern >= 2 ? concat(" on ", d.local_layers())
                                            : d.sliding_window >= d.seq_len     ? std::string(" (>= seq_len: causal)")
                                                                                : std::string(" (cuts the context)"));
                            }),
        // Gemma's soft-capping (0: none; config.json null; Gemma 3's attention has no score cap, as
        // in transformers) and query scale (resolved: the head size where the config leaves it 0);
        // Gemma 3's local layers' rotary base.
        MPITRAIN_DIMS_FIELD(attn_softcap, Type::number, llama, "gemma2", optional, 0.0, 0, 0, "", "attn_logit_softcapping",
                            true, fixed, same_number, [](const ModelArgs& d) {
                              return d.attn_softcap > 0 ? concat(", scores capped at ", d.attn_softcap) : std::string();
                            }),
        MPITRAIN_DIMS_FIELD(final_softcap, Type::number, llama, "gemma2|gemma3", optional, 0.0, 0, 0, "",
                            "final_logit_softcapping", true, fixed, same_number, [](const ModelArgs& d) {
                              return d.final_softcap > 0 ? concat(", logits capped at ", d.final_softcap) : std::string();
                            }),
        MPITRAIN_DIMS_FIELD(query_pre_attn_scalar, Type::number, llama, "gemma2|gemma3", optional, 0.0, 0, 0, "",
                            "query_pre_attn_scalar", false, fixed, same_number, nothing),
        MPITRAIN_DIMS_FIELD(rope_local_theta, Type::number, llama, "gemma3", optional, 0.0, 0, 0, "",
                            "rope_local_base_freq", false, fixed, same_number, [](const ModelArgs& d) {
                              return d.rope_local_theta > 0 ? concat(", local layers' rope theta ", d.rope_local_theta)
                                                            : std::string();
                            }),
        // The experts (model.h's MoE; ModelArgs' comment) of Qwen3-MoE and Mixtral: the count and the
        // per-token choice must be set (a preset or the config.json read sets them); the rest have
        // the transformers classes' defaults. Mixtral's experts are its MLPs (intermediate_size in
        // its config.json), all its layers sparse, its top-k weights always renormalised.
        MPITRAIN_ARGS_FIELD(num_experts, Type::integer, "qwen3_moe|mixtral|olmoe", int64_t{0}, 1, 1 << 16,
                            "num_experts mixtral=num_local_experts", "qwen3_moe=128 mixtral=8 olmoe=64", "", [](const ModelArgs& d) {
                              return d.num_experts > 0 ? concat(", ", d.num_experts, " experts (", d.num_experts_per_tok,
                                                                " per token, ", d.moe_intermediate_size, " units each",
                                                                d.norm_topk_prob ? ", weights renormalised" : "",
                                                                d.decoder_sparse_step > 1
                                                                    ? concat(", every ", d.decoder_sparse_step, "th layer")
                                                                    : std::string(),
                                                                ", aux loss x ", d.router_aux_loss_coef, ")")
                                                       : std::string();
                            }),
        MPITRAIN_ARGS_FIELD(num_experts_per_tok, Type::integer, "qwen3_moe|mixtral|olmoe", int64_t{0}, 1, 1 << 16,
                            "num_experts_per_tok", "qwen3_moe=8 mixtral=2 olmoe=8", "", nothing),
        MPITRAIN_ARGS_FIELD(moe_intermediate_size, Type::integer, "qwen3_moe|mixtral|olmoe", int64_t{0}, 1, kBig,
                            "moe_intermediate_size mixtral=intermediate_size olmoe=intermediate_size",
                            "qwen3_moe=768 mixtral=14336 olmoe=2048", "", nothing),
        MPITRAIN_ARGS_FIELD(decoder_sparse_step, Type::integer, "qwen3_moe", int64_t{1}, 1, kInt32, "decoder_sparse_step",
                            "qwen3_moe=1", "", nothing),
        MPITRAIN_ARGS_FIELD(norm_topk_prob, Type::flag, "qwen3_moe|mixtral|olmoe", false, 0, 1, "norm_topk_prob",
                            "qwen3_moe=false mixtral=true olmoe=false", "mixtral=true", nothing),
        MPITRAIN_ARGS_FIELD(router_aux_loss_coef, Type::number, "qwen3_moe|mixtral|olmoe", 0.001, 0, 0, "router_aux_loss_coef",
                            "qwen3_moe=0.001 mixtral=0.001 olmoe=0.01", "", nothing),
        // Last: what the flags above make is its fallback (files before model.family), and a resume
        // names the differing flag before the family it makes.
        ModelField{"family", Type::text, any, "", optional, Value(std::string()), 0, 0, "", "", false, fixed,
                   [](const ModelArgs& d) { return Value(std::string(d.family_row().name)); },
                   [](ModelArgs& d, const Value& v) { d.family = std::get<std::string>(v); },
                   [](ModelArgs& d, const ModelConfig& c) { d.family = c.family; },
                   [](ModelConfig& c, const Value& v) { c.family = std::get<std::string>(v); }, nothing, "", "", false},
    };
    // clang-format on
    return rows;
  }();
  return kFields;
}
#undef MPITRAIN_DIMS_FIELD
#undef MPITRAIN_ARGS_FIELD

const ModelField* find_model_field(const std::string& key) {
  for (const ModelField& f : model_fields())
    if (key == f.key) return &f;
  return nullptr;
}

bool field_applies(const ModelField& f, const Family& fam) {
  if (f.llama_block && std::string(fam.block) != "llama") return false;
  return !*f.families || (concat("|", f.families, "|").find(concat("|", fam.name, "|")) != std::string::npos);
}

const ModelField* field_conflict(const Family& fam, const ModelArgs& d) {
  for (const ModelField& f : model_fields())
    if (*f.families && !field_applies(f, fam) && f.get(d) != f.fallback) return &f;
  return nullptr;
}

std::string field_text(const ModelField& f, const ModelArgs& d) {
  return std::visit(
      [](const auto& v) -> std::string {
        return concat(v);  // flags as 1 and 0, as the checkpoint stores them
      },
      f.get(d));
}

std::string describe_model(const ModelArgs& d, int64_t whole_params) {
  const std::string family = d.family_row().name;
  std::string parts;
  for (const ModelField& f : model_fields())
    if (!f.llama_block || d.llama()) parts += f.describe(d);
  return concat("model: ", family, family != d.arch ? concat(" (", d.arch, " block)") : std::string(), ", ",
                whole_params, " parameters (", d.n_layer, " layers, ", d.n_head, " heads",
                d.llama() ? concat(" / ", d.n_kv_head, " kv heads") : std::string(), ", width ", d.n_embd,
                d.attn_width() != d.n_embd ? concat(", head_dim ", d.head_dim()) : std::string(), parts, ", seq_len ",
                d.seq_len, ", vocab ", d.vocab_size,
                d.vocab_live > 0 ? concat(" = ", d.vocab_live, " tokens + ", d.vocab_size - d.vocab_live,
                                          " padding rows outside the loss")
                                 : std::string(),
                ")");
}

// ---- presets ---------------------------------------------------------------------------------------
// A preset is one row: its fields by name, as the model.* keys of a config (config.cpp's key table
// and the generic rows above read them, so a row is typed like a config). The family gives the
// block and its flags. The
// Llama-block shapes are those of the published config.json files (Meta's Llama 3.2 1B/3B and 3.1
// 8B, Qwen2.5 0.5B, Qwen3 0.6B/1.7B/4B/8B, Mistral 7B v0.1); seq_len is a training context,
// max_position what config.json declares.
#define MPITRAIN_LLAMA3_ROPE "rope_theta: 500000, norm_eps: 1e-5, rope_scaling: llama3, rope_low_freq_factor: 1, " \
                             "rope_high_freq_factor: 4, rope_original_max_position: 8192, max_position: 131072"
#define MPITRAIN_QWEN_ROPE "rope_theta: 1000000, norm_eps: 1e-6, rope_scaling: none"
const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> kPresets = {
    {"tiny", "family: gpt2, n_layer: 6, n_head: 6, n_embd: 192, seq_len: 256"},  // vocab: the shards'
    {"gpt2", "family: gpt2, n_layer: 12, n_head: 12, n_embd: 768, seq_len: 1024, vocab_size: 50257"},
    {"gpt2-medium", "family: gpt2, n_layer: 24, n_head: 16, n_embd: 1024, seq_len: 1024, vocab_size: 50257"},
    {"gpt2-large", "family: gpt2, n_layer: 36, n_head: 20, n_embd: 1280, seq_len: 1024, vocab_size: 50257"},
    {"gpt2-xl", "family: gpt2, n_layer: 48, n_head: 25, n_embd: 1600, seq_len: 1024, vocab_size: 50257"},
    {"llama-debug", "family: llama, n_layer: 6, n_head: 16, n_kv_head: 4, n_embd: 256, intermediate_size: 768, "
                    "seq_len: 256, vocab_size: 2048, max_position: 256, rope_theta: 500000, norm_eps: 1e-5, "
                    "rope_scaling: none, tie_embeddings: true"},
    {"llama3.2-1b", "family: llama, n_layer: 16, n_head: 32, n_kv_head: 8, n_embd: 2048, intermediate_size: 8192, "
                    "seq_len: 2048, vocab_size: 128256, rope_factor: 32, tie_embeddings: true, " MPITRAIN_LLAMA3_ROPE},
    {"llama3.2-3b", "family: llama, n_layer: 28, n_head: 24, n_kv_head: 8, n_embd: 3072, intermediate_size: 8192, "
                    "seq_len: 2048, vocab_size: 128256, rope_factor: 32, tie_embeddings: true, " MPITRAIN_LLAMA3_ROPE},
    {"llama3.1-8b", "family: llama, n_layer: 32, n_head: 32, n_kv_head: 8, n_embd: 4096, intermediate_size: 14336, "
                    "seq_len: 2048, vocab_size: 128256, rope_factor: 8, tie_embeddings: false, " MPITRAIN_LLAMA3_ROPE},
    {"qwen2.5-0.5b", "family: qwen2, n_layer: 24, n_head: 14, n_kv_head: 2, n_embd: 896, intermediate_size: 4864, "
                     "seq_len: 2048, vocab_size: 151936, max_position: 32768, tie_embeddings: true, " MPITRAIN_QWEN_ROPE},
    // Qwen3: 128-wide heads whatever the width (16 x 128 = 2048 > 1024).
    {"qwen3-0.6b", "family: qwen3, n_layer: 28, n_head: 16, n_kv_head: 8, n_embd: 1024, intermediate_size: 3072, "
                   "head_dim: 128, seq_len: 2048, vocab_size: 151936, max_position: 40960, tie_embeddings: true, "
                   MPITRAIN_QWEN_ROPE},
    {"qwen3-1.7b", "family: qwen3, n_layer: 28, n_head: 16, n_kv_head: 8, n_embd: 2048, intermediate_size: 6144, "
                   "head_dim: 128, seq_len: 2048, vocab_size: 151936, max_position: 40960, tie_embeddings: true, "
                   MPITRAIN_QWEN_ROPE},
    {"qwen3-4b", "family: qwen3, n_layer: 36, n_head: 32, n_kv_head: 8, n_embd: 2560, intermediate_size: 9728, "
                 "head_dim: 128, seq_len: 2048, vocab_size: 151936, max_position: 40960, tie_embeddings: true, "
                 MPITRAIN_QWEN_ROPE},
    {"qwen3-8b", "family: qwen3, n_layer: 36, n_head: 32, n_kv_head: 8, n_embd: 4096, intermediate_size: 12288, "
                 "head_dim: 128, seq_len: 2048, vocab_size: 151936, max_position: 40960, tie_embeddings: false, "
                 MPITRAIN_QWEN_ROPE},
    // Mistral 7B v0.1: a 4096-token attention window (seq_len must stay within it), untied.
    {"mistral-7b-v0.1", "family: mistral, n_layer: 32, n_head: 32, n_kv_head: 8, n_embd: 4096, "
                        "intermediate_size: 14336, head_dim: 128, seq_len: 2048, vocab_size: 32000, "
                        "max_position: 32768, rope_theta: 10000, norm_eps: 1e-5, rope_scaling: none, "
                        "tie_embeddings: false, sliding_window: 4096"},
    // Gemma 2 2B: 256-wide heads (8 x 256 = 2048 < 2304), a 4096-token window on every other layer,
    // scores capped at 50 and logits at 30.
    {"gemma2-2b", "family: gemma2, n_layer: 26, n_head: 8, n_kv_head: 4, n_embd: 2304, intermediate_size: 9216, "
                  "head_dim: 256, seq_len: 2048, vocab_size: 256000, max_position: 8192, rope_theta: 10000, "
                  "norm_eps: 1e-6, rope_scaling: none, tie_embeddings: true, sliding_window: 4096, "
                  "attn_softcap: 50, final_softcap: 30, query_pre_attn_scalar: 256"},
    // Gemma 3 1B (text only): 4 heads of 256 over 1 kv head at width 1152, windows of 512 on five
    // layers of six with a rotary base of 10000, the global layers' 1000000.
    {"gemma3-1b", "family: gemma3, n_layer: 26, n_head: 4, n_kv_head: 1, n_embd: 1152, intermediate_size: 6912, "
                  "head_dim: 256, seq_len: 2048, vocab_size: 262144, max_position: 32768, rope_theta: 1000000, "
                  "rope_local_theta: 10000, norm_eps: 1e-6, rope_scaling: none, tie_embeddings: true, "
                  "sliding_window: 512, query_pre_attn_scalar: 256"},
    // Qwen3-30B-A3B: 48 layers whose MLPs are 128 experts of 768 units, 8 chosen per token and
    // renormalised; 30.5B parameters, 3.3B active per token.
    // Mixtral 8x7B v0.1: every layer 8 experts of 14336 units, 2 per token; no window (null);
    // 46.7B parameters, 12.9B active per token.
    {"mixtral-8x7b", "family: mixtral, n_layer: 32, n_head: 32, n_kv_head: 8, n_embd: 4096, intermediate_size: 14336, "
                     "head_dim: 128, seq_len: 2048, vocab_size: 32000, max_position: 32768, rope_theta: 1000000, "
                     "norm_eps: 1e-5, rope_scaling: none, tie_embeddings: false, num_experts: 8, num_experts_per_tok: 2, "
                     "moe_intermediate_size: 14336, router_aux_loss_coef: 0.02"},
    // OLMoE 1B-7B (0924): 64 experts of 1024 units on every layer, 8 per token, not renormalised;
    // 6.9B parameters, 1.3B active per token.
    {"olmoe-1b-7b", "family: olmoe, n_layer: 16, n_head: 16, n_kv_head: 16, n_embd: 2048, intermediate_size: 1024, "
                    "seq_len: 2048, vocab_size: 50304, max_position: 4096, rope_theta: 10000, norm_eps: 1e-5, "
                    "rope_scaling: none, tie_embeddings: false, num_experts: 64, num_experts_per_tok: 8, "
                    "moe_intermediate_size: 1024, norm_topk_prob: false, router_aux_loss_coef: 0.01"},
    {"qwen3-30b-a3b", "family: qwen3_moe, n_layer: 48, n_head: 32, n_kv_head: 4, n_embd: 2048, intermediate_size: 6144, "
                      "head_dim: 128, seq_len: 2048, vocab_size: 151936, max_position: 40960, tie_embeddings: false, "
                      "num_experts: 128, num_experts_per_tok: 8, moe_intermediate_size: 768, norm_topk_prob: true, "
                      "decoder_sparse_step: 1, router_aux_loss_coef: 0.001, " MPITRAIN_QWEN_ROPE},
  };
  return kPresets;
}
#undef MPITRAIN_LLAMA3_ROPE
#undef MPITRAIN_QWEN_ROPE

std::string args_conflict(const ModelArgs& a, int64_t tp, int64_t ep) {
  if (tp > 1 && a.qk_norm && a.family_row().qk_norm_whole)
    return concat("parallel.tp: ", tp, ": ", a.family_row().name,
                  "'s q/k norms are over the whole projections (every head at once), which tensor parallelism would "
                  "split (1)");
  if (a.num_experts == 0)
    return ep > 1 ? concat("parallel.ep: ", ep, ": a model without experts has none to split (1)") : std::string();
  if (ep > 1 && a.num_experts % ep != 0)
    return concat("parallel.ep: ", ep, " does not divide model.num_experts (", a.num_experts, ")");
  // Mixtral's and OLMoE's experts are their MLPs: config.json's intermediate_size is their size.
  if (hf_key_of(*find_model_field("moe_intermediate_size"), a.family_row().hf_model_type) == "intermediate_size" &&
      a.moe_intermediate_size != a.intermediate_size)
    return concat("model.moe_intermediate_size: ", a.moe_intermediate_size, " differs from model.intermediate_size (",
                  a.intermediate_size, "): ", a.family_row().name, "'s experts are its MLPs, of one size");
  if (a.num_experts_per_tok > a.num_experts)
    return concat("model.num_experts_per_tok: ", a.num_experts_per_tok, " is more than model.num_experts (", a.num_experts, ")");
  if (tp > 1 && a.moe_intermediate_size % tp != 0)
    return concat("parallel.tp: ", tp, " does not divide model.moe_intermediate_size (", a.moe_intermediate_size,
                  "): each expert's units are split over the tp group");
  return std::string();
}

GPTDims dims_of_config(const ModelConfig& cfg) {
  GPTDims d;
  d.n_layer = cfg.n_layer;
  d.n_head = cfg.n_head;
  d.n_embd = cfg.n_embd;
  d.seq_len = cfg.seq_len;
  d.dropout = cfg.dropout;
  for (const ModelField& f : model_fields())  // arch first: it says whether the llama rows apply
    if (!f.llama_block || d.llama()) f.from_config(d, cfg);
  complete_dims(d);  // a config parse_config did not resolve names no family
  return d;
}

void complete_dims(ModelArgs& d) {
  if (!d.llama()) {
    d.n_kv_head = d.n_head;
    d.intermediate_size = 4 * d.n_embd;
    d.max_position = d.seq_len;
  }
  d.family = d.family_row().name;
}

}  // namespace mpitrain
