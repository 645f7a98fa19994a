// The family rows and the architecture fields' table (model_fields.h).
#include "mpitrain/model_fields.h"

#include <climits>
#include <type_traits>

#include "mpitrain/error.h"

namespace mpitrain {

// ---- families ------------------------------------------------------------------------------------

const std::vector<Family>& families() {
  static const std::vector<Family> kFamilies = {
      // name, block, HF class, model_type, qkv_bias, qk_norm, windowed layers, MLP gate, Gemma norms
      {"gpt2", "gpt2", "GPT2LMHeadModel", "gpt2", true, false, 0, "", false,
       "LayerNorm, learned positions, GELU MLP, biases everywhere, tied output"},
      {"llama", "llama", "LlamaForCausalLM", "llama", false, false, 0, "silu", false,
       "RMSNorm, rotary, SwiGLU, grouped-query attention (Llama 3.x)"},
      {"qwen2", "llama", "Qwen2ForCausalLM", "qwen2", true, false, 0, "silu", false,
       "llama's block with q/k/v biases (Qwen2, Qwen2.5)"},
      {"qwen3", "llama", "Qwen3ForCausalLM", "qwen3", false, true, 0, "silu", false,
       "llama's block with an RMSNorm over each head's q and k (Qwen3)"},
      {"mistral", "llama", "MistralForCausalLM", "mistral", false, false, 1, "silu", false,
       "llama's block with an attention window on every layer (Mistral 7B)"},
      {"gemma2", "llama", "Gemma2ForCausalLM", "gemma2", false, false, 2, "gelu_pytorch_tanh", true,
       "llama's block with GeGLU, RMSNorm x (1 + w) before and after each sublayer, the embedding x sqrt(n_embd), "
       "soft-capped attention scores and logits, a window on every other layer (Gemma 2)"},
      {"gemma3", "llama", "Gemma3ForCausalLM", "gemma3_text", false, true, 6, "gelu_pytorch_tanh", true,
       "Gemma 2's block with q/k norms x (1 + w), five windowed layers with a rotary base of their own to one "
       "global layer, no soft caps (Gemma 3, text)"},
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

const Family& family_of_parts(const std::string& block, bool qkv_bias, bool qk_norm, int64_t sliding_window) {
  // (Gemma 2 and 3 have parts no flag here says: a model is gemma2 or gemma3 only by name.)
  const char* name = block != "llama" ? "gpt2"
                     : sliding_window > 0 ? "mistral"
                     : qkv_bias          ? "qwen2"
                     : qk_norm           ? "qwen3"
                                         : "llama";
  return *find_family(name);
}

const char* family_conflict(const Family& f, const std::string& block, bool qkv_bias, bool qk_norm,
                            int64_t sliding_window) {
  if (block != f.block) return "arch";
  if (block != "llama") return nullptr;
  if (qkv_bias != f.qkv_bias) return "qkv_bias";
  if (qk_norm != f.qk_norm) return "qk_norm";
  if (sliding_window > 0 && f.window_pattern == 0) return "sliding_window";
  return nullptr;
}

const char* family_conflict(const Family& f, const ModelArgs& a) {
  return family_conflict(f, a.arch, a.qkv_bias, a.qk_norm, a.sliding_window);
}

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
        [](ModelConfig& c, const Value& v) { to_config_member(c.key, v); }, describe                              \
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
                   [](ModelConfig& c, const Value& v) { c.head_dim = std::get<int64_t>(v); }, nothing},
        MPITRAIN_DIMS_FIELD(qk_norm, Type::flag, llama, "", optional, false, 0, 1, "", "", false, fixed, is_true,
                            [](const ModelArgs& d) {  // with the family's norms (Gemma's)
                              return concat(d.qk_norm ? ", q/k norms" : "", d.family_row().gemma_norms
                                                                                ? ", norms x (1 + w) before and after each sublayer"
                                                                                : "");
                            }),
        // The window of the family's windowed layers (0: none; files before it have none): the
        // families with windowed layers (Family::window_pattern) only.
        MPITRAIN_DIMS_FIELD(sliding_window, Type::integer, llama, "mistral|gemma2|gemma3", optional, int64_t{0}, 0, kInt32,
                            "", "sliding_window", true, fixed, same_int,
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
        // Last: what the flags above make is its fallback (files before model.family), and a resume
        // names the differing flag before the family it makes.
        ModelField{"family", Type::text, any, "", optional, Value(std::string()), 0, 0, "", "", false, fixed,
                   [](const ModelArgs& d) { return Value(std::string(d.family_row().name)); },
                   [](ModelArgs& d, const Value& v) { d.family = std::get<std::string>(v); },
                   [](ModelArgs& d, const ModelConfig& c) { d.family = c.family; },
                   [](ModelConfig& c, const Value& v) { c.family = std::get<std::string>(v); }, nothing},
    };
    // clang-format on
    return rows;
  }();
  return kFields;
}
#undef MPITRAIN_DIMS_FIELD

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
