// Hugging Face config.json -> ModelConfig (see hf_config.h).
#include "mpitrain/hf_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "mpitrain/error.h"
#include "mpitrain/files.h"
#include "mpitrain/model_fields.h"

namespace mpitrain {
namespace {

using nlohmann::json;

json parse_json(const std::string& text, const std::string& path, const std::string& where) {
  if (text.size() > (1u << 20)) throw UsageError(concat(where, ": model.init_from: ", path, ": more than 1 MiB, not a config.json"));
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw UsageError(concat(where, ": model.init_from: ", path, ": not JSON: ", e.what()));
  }
  if (!j.is_object()) throw UsageError(concat(where, ": model.init_from: ", path, ": not a JSON object"));
  return j;
}

void apply_parsed(ModelConfig& m, const json& c, const std::string& path, const std::string& at, const std::string& where);

// What a key absent from config.json means: its transformers config class's default (the
// __init__ argument from_pretrained then uses; null where that is None), per model_type, for
// every key mpitrain reads. The exporter writes each of them (hf_format.cpp checks it), so a
// file mpitrain wrote never depends on this table.
const json& class_defaults(const std::string& model_type) {
  static const json table = json::parse(R"({
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": null, "head_dim": null,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": false},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": null,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": false},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": false},
    "qwen3_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": null,
                  "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "tie_word_embeddings": false},
    "mixtral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": null,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
                "tie_word_embeddings": false},
    "olmoe": {"vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 16,
              "num_attention_heads": 16, "num_key_value_heads": null, "head_dim": null,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": false},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": null,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "tie_word_embeddings": false},
    "gemma2": {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "tie_word_embeddings": true, "query_pre_attn_scalar": 256,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                    "rope_local_base_freq": 10000.0, "tie_word_embeddings": true,
                    "query_pre_attn_scalar": 256, "attn_logit_softcapping": null, "final_logit_softcapping": null}
  })");
  static const json none = json::object();
  return table.contains(model_type) ? table[model_type] : none;
}

}  // namespace

std::vector<std::string> hf_class_default_keys(const std::string& model_type) {
  std::vector<std::string> keys;
  for (const auto& [key, value] : class_defaults(model_type).items()) keys.push_back(key);
  return keys;
}

std::string hf_model_dir(const std::string& init_from) {
  return init_from.rfind("hf:", 0) == 0 ? init_from.substr(3) : std::string();
}

void apply_hf_config(ModelConfig& m, const std::string& dir, const std::string& where) {
  const std::string path = dir + "/config.json";
  std::string text;
  try {
    text = read_bounded_file(path, kMaxHfConfigBytes, "a config.json");
  } catch (const UsageError& e) {
    throw UsageError(concat(where, ": model.init_from: ", e.what(), " (a Hugging Face model directory holds config.json)"));
  }
  apply_hf_config_text(m, text, path, where);
}

void apply_hf_config_text(ModelConfig& m, const std::string& text, const std::string& path, const std::string& where) {
  const json c = parse_json(text, path, where);
  const std::string at = concat(where, ": model.init_from: ", path);
  try {
    apply_parsed(m, c, path, at, where);
  } catch (const json::exception& e) {  // a key of the wrong JSON type
    throw UsageError(concat(at, ": ", e.what()));
  }
}

namespace {

void apply_parsed(ModelConfig& m, const json& c, const std::string& path, const std::string& at, const std::string& where) {
  auto bad = [&](const std::string& key, const std::string& what) { return UsageError(concat(at, ": ", key, ": ", what)); };
  // The family is the row whose model_type this is (model_fields.h); GPT-2's config.json is read
  // by the safetensors importer, not here.
  const std::string type = c.value("model_type", std::string());
  // A key's value: the file's (null included), else the class's default (class_defaults), else
  // none (nullptr).
  const json& defaults = class_defaults(type);
  auto value_of = [&](const json& obj, const char* key, const char* default_key) -> const json* {
    if (obj.contains(key)) return &obj[key];
    return default_key && defaults.contains(default_key) ? &defaults[default_key] : nullptr;
  };
  auto integer = [&](const char* key, bool required, int64_t fallback) -> int64_t {
    const json* v = value_of(c, key, key);
    if (!v || v->is_null()) {
      if (required) throw bad(key, "missing");
      return fallback;
    }
    if (!v->is_number_integer() || v->get<int64_t>() <= 0) throw bad(key, concat("must be a positive integer, got ", v->dump()));
    return v->get<int64_t>();
  };
  // A positive number; null (and absent without a default) is `fallback`. `default_key`: the key
  // whose class default an absent one takes (the same key, or none inside a rope object).
  auto number_in = [&](const json& obj, const char* key, const char* default_key, double fallback) -> double {
    const json* v = value_of(obj, key, default_key);
    if (!v || v->is_null()) return fallback;
    if (!v->is_number() || !(v->get<double>() > 0) || !std::isfinite(v->get<double>()))
      throw bad(key, concat("must be a positive number, got ", v->dump()));
    return v->get<double>();
  };
  auto number = [&](const char* key, double fallback) { return number_in(c, key, key, fallback); };
  auto flag = [&](const char* key, bool fallback) -> bool {
    const json* v = value_of(c, key, key);
    if (!v || v->is_null()) return fallback;
    if (!v->is_boolean()) throw bad(key, concat("must be true or false, got ", v->dump()));
    return v->get<bool>();
  };

  const Family* family = family_by_model_type(type);
  if (!family || std::string(family->block) != "llama") {
    std::string known;
    for (const Family& f : families())
      if (std::string(f.block) == "llama") known += concat(known.empty() ? "" : ", ", f.hf_model_type, " (", f.hf_architecture, ")");
    throw bad("model_type", concat("'", type, "': mpitrain reads ", known));
  }
  // The gated MLP's activation is the family's (Gemma's configs name it hidden_activation).
  for (const char* act : {"hidden_act", "hidden_activation"})
    if (c.contains(act) && !c[act].is_null() && c[act] != family->mlp_act)
      throw bad(act, concat(c[act].dump(), ": mpitrain's ", type, " MLP is ", family->mlp_act));
  // Qwen2's q/k/v biases are qkv_bias; llama's and qwen3's attention_bias (o_proj too) and mlp_bias are not supported.
  if (!family->qkv_bias && (flag("attention_bias", false) || flag("mlp_bias", false)))
    throw bad(flag("attention_bias", false) ? "attention_bias" : "mlp_bias",
              concat("true: mpitrain's ", type, " has no such biases"));
  // (Qwen's configs carry a window too, unused without use_sliding_window: not read.)
  if (type.rfind("qwen", 0) == 0 && flag("use_sliding_window", false))
    throw bad("use_sliding_window", "true: Qwen's sliding-window attention is not supported");
  // The generic fields (model_fields.h; the experts') of other families are not this one's, under
  // any family's key for them that is not a key of this family's own (Mixtral's experts' size is
  // its intermediate_size).
  for (const ModelField& f : model_fields()) {
    // (A field config.json may hold as null, the window, is another family's unused key: Qwen's
    // configs carry a window too, unused without use_sliding_window. Not read, not refused.)
    if (!f.generic || f.hf_null || field_applies(f, *family)) continue;
    std::istringstream keys(f.hf_key);
    for (std::string key; keys >> key;) {
      key = key.substr(key.find('=') + 1);
      if (c.contains(key) && !c[key].is_null() && !defaults.contains(key))
        throw bad(key, concat(c[key].dump(), ": mpitrain's ", type, " has no such field (", f.families, " have)"));
    }
  }
  // OLMoE's clip_qkv (the q/k/v projections clamped) is not supported.
  if (c.contains("clip_qkv") && !c["clip_qkv"].is_null())
    throw bad("clip_qkv", concat(c["clip_qkv"].dump(), ": not supported (null: no clamp)"));
  // Qwen3-MoE's dense layers are those its sparse-layer step leaves; a list of its own is not supported.
  if (c.contains("mlp_only_layers") && !c["mlp_only_layers"].is_null() && c["mlp_only_layers"] != json::array())
    throw bad("mlp_only_layers", concat(c["mlp_only_layers"].dump(), ": not supported (the dense layers are those the sparse-layer step leaves)"));

  // The head size: head_dim where given (Qwen3: 128 at any width), else hidden_size / num_attention_heads.
  const int64_t n_embd = integer("hidden_size", true, 0), n_head = integer("num_attention_heads", true, 0);
  // Absent: transformers' Qwen3Config has head_dim 128, Gemma's 256 (class_defaults); Llama's,
  // Qwen2's and Mistral's None: hidden_size / num_attention_heads.
  const int64_t head_dim = integer("head_dim", false, 0);
  if (head_dim == 0 && n_embd % n_head != 0)
    throw bad("hidden_size",
              concat(n_embd, " is not a multiple of num_attention_heads ", n_head, " (and no head_dim)"));
  if (head_dim % 2 != 0) throw bad("head_dim", concat(head_dim, ": rotary needs an even head size"));

  // rope: rope_theta + rope_scaling (transformers < 4.56) or rope_parameters (newer), which
  // transformers 5 nests per layer type where the layers differ (Gemma 3: {full_attention: {...},
  // sliding_attention: {...}}): full_attention is the global layers' rotary; sliding_attention
  // gemma3's local layers' base (no scaling there), and any other family's must be the same.
  const json* rope = nullptr;
  const json* local_rope = nullptr;
  const char* rope_key = "rope_scaling";
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) rope = &c["rope_parameters"], rope_key = "rope_parameters";
  else if (c.contains("rope_scaling") && c["rope_scaling"].is_object()) rope = &c["rope_scaling"];
  if (rope && (rope->contains("full_attention") || rope->contains("sliding_attention"))) {
    for (const auto& [kind, params] : rope->items())
      if ((kind != "full_attention" && kind != "sliding_attention") || !params.is_object())
        throw bad(concat(rope_key, ".", kind), concat(params.dump(), ": mpitrain reads one object per layer type, full_attention and sliding_attention"));
    if (!rope->contains("full_attention")) throw bad(rope_key, "per layer type without full_attention");
    if (rope->contains("sliding_attention")) local_rope = &(*rope)["sliding_attention"];
    rope = &(*rope)["full_attention"];
    if (local_rope && type != "gemma3_text" && *local_rope != *rope)
      throw bad(concat(rope_key, ".sliding_attention"),
                concat(local_rope->dump(), " differs from full_attention's ", rope->dump(), ": mpitrain's ", type,
                       " has one rotary for every layer"));
  }
  const double class_theta = defaults.value("rope_theta", 10000.0);
  const double theta = rope && rope->contains("rope_theta") ? number_in(*rope, "rope_theta", nullptr, class_theta)
                                                            : number("rope_theta", class_theta);
  std::string scaling = "none";
  double factor = 0, low = 0, high = 0;
  int64_t original = 0;
  if (rope) {
    const json& r = *rope;
    const std::string kind = r.contains("rope_type") ? r.value("rope_type", std::string()) : r.value("type", std::string());
    if (kind == "llama3") {
      scaling = "llama3";
      factor = number_in(r, "factor", nullptr, 0), low = number_in(r, "low_freq_factor", nullptr, 0),
      high = number_in(r, "high_freq_factor", nullptr, 0);
      if (!r.contains("original_max_position_embeddings") || !r["original_max_position_embeddings"].is_number_integer())
        throw bad("rope_scaling.original_max_position_embeddings", "missing");
      original = r["original_max_position_embeddings"].get<int64_t>();
      if (factor == 0 || low == 0 || high == 0) throw bad("rope_scaling", "llama3 needs factor, low_freq_factor and high_freq_factor");
    } else if (kind == "linear") {  // Gemma 3 4B and larger: every frequency / factor
      scaling = "linear";
      factor = number_in(r, "factor", nullptr, 0);
      if (factor < 1) throw bad("rope_scaling.factor", concat(r.value("factor", json()).dump(), ": linear needs a factor >= 1"));
    } else if (kind != "default" && !kind.empty()) {
      throw bad("rope_scaling", concat("type '", kind, "': mpitrain knows llama3 and linear (and none)"));
    }
  }

  struct Int { const char* key; int64_t* field; int64_t value; };
  const int64_t max_position = integer("max_position_embeddings", true, 0);
  const Int ints[] = {
      {"n_layer", &m.n_layer, integer("num_hidden_layers", true, 0)},
      {"n_head", &m.n_head, n_head},
      {"n_embd", &m.n_embd, n_embd},
      {"n_kv_head", &m.n_kv_head, integer("num_key_value_heads", false, n_head)},
      {"intermediate_size", &m.intermediate_size, integer("intermediate_size", true, 0)},
      {"max_position", &m.max_position, max_position},
      {"rope_original_max_position", &m.rope_original_max_position, original},
      {"head_dim", &m.head_dim, head_dim > 0 ? head_dim : n_embd / n_head},
  };
  auto disagree = [&](const char* key, const std::string& have, const std::string& file) {
    return UsageError(concat(where, ": model.", key, ": ", have, " disagrees with ", path, "'s ", file,
                             " (leave model.", key, " unset to take the file's)"));
  };
  for (const Int& f : ints) {
    if (*f.field != 0 && *f.field != f.value) throw disagree(f.key, concat(*f.field), concat(f.value));
    *f.field = f.value;
  }
  // The vocabulary: the weights' classes. An explicit model.vocab_size must equal them (every row a
  // class); unset, automatic padding pads them (model_dims), as it pads the data's vocabulary.
  const int64_t vocab = integer("vocab_size", true, 0);
  if (m.vocab_size != 0 && m.vocab_size != vocab) throw disagree("vocab_size", concat(m.vocab_size), concat(vocab));
  m.init_vocab = vocab;
  m.init_vocab_source = concat(path, "'s vocab_size");
  struct Num { const char* key; double* field; double value; };
  // Gemma's soft caps (null: none) and query scale (Gemma2Config's and Gemma3TextConfig's defaults
  // where absent); Gemma 3's local rotary base (default 10000) and its layers: five windowed to
  // one global, said by sliding_window_pattern or layer_types, which must be the family's.
  // A field of some families only (model_fields.h) is read for those; the others' stay 0.
  auto of_family = [&](const char* key, const char* hf_key, double fallback) {
    return field_applies(*find_model_field(key), *family) ? number(hf_key, fallback) : 0.0;
  };
  // transformers' Gemma 3 attention applies no score cap, whatever attn_logit_softcapping says;
  // mpitrain's gemma3 has none either (model.attn_softcap is gemma2's): refused, not ignored.
  if (type == "gemma3_text" && c.contains("attn_logit_softcapping") && !c["attn_logit_softcapping"].is_null())
    throw bad("attn_logit_softcapping", concat(c["attn_logit_softcapping"].dump(),
                                               ": transformers' Gemma 3 attention applies no score cap, nor does "
                                               "mpitrain's gemma3 (null: none)"));
  // Gemma 3's local rotary base: the nested form's sliding_attention (its rope_type must be plain),
  // else rope_local_base_freq; both given, they must agree.
  double local_theta = of_family("rope_local_theta", "rope_local_base_freq", 10000);
  if (local_rope && type == "gemma3_text") {
    const std::string kind = local_rope->value("rope_type", std::string("default"));
    if (kind != "default")
      throw bad(concat(rope_key, ".sliding_attention.rope_type"),
                concat("'", kind, "': mpitrain's gemma3 scales the global layers' rotary only"));
    const double nested = number_in(*local_rope, "rope_theta", nullptr, defaults.value("rope_local_base_freq", 10000.0));
    if (c.contains("rope_local_base_freq") && !c["rope_local_base_freq"].is_null() && nested != local_theta)
      throw bad("rope_local_base_freq", concat(local_theta, " disagrees with ", rope_key, ".sliding_attention.rope_theta ", nested));
    local_theta = nested;
  }
  if (family->window_pattern >= 2 && c.contains("sliding_window_pattern") && !c["sliding_window_pattern"].is_null() &&
      c["sliding_window_pattern"] != family->window_pattern)
    throw bad("sliding_window_pattern", concat(c["sliding_window_pattern"].dump(), ": mpitrain's ", type, " has ",
                                               family->window_pattern));
  if (family->window_pattern >= 2 && c.contains("layer_types") && c["layer_types"].is_array()) {
    GPTDims layers;
    layers.family = family->name;
    for (size_t i = 0; i < c["layer_types"].size(); ++i)
      if (c["layer_types"][i] != (layers.local_layer(static_cast<int64_t>(i)) ? "sliding_attention" : "full_attention"))
        throw bad(concat("layer_types[", i, "]"),
                  concat(c["layer_types"][i].dump(), ": mpitrain's ", type, " has a global layer every ",
                         family->window_pattern, " (layers ", family->window_pattern - 1, ", ",
                         2 * family->window_pattern - 1, ", ...), the others sliding"));
  }
  const Num nums[] = {{"query_pre_attn_scalar", &m.query_pre_attn_scalar,
                       of_family("query_pre_attn_scalar", "query_pre_attn_scalar", 256)},
                      {"rope_local_theta", &m.rope_local_theta, local_theta},
                      {"rope_theta", &m.rope_theta, theta},
                      {"norm_eps", &m.norm_eps, number("rms_norm_eps", 1e-6)},
                      {"rope_factor", &m.rope_factor, factor},
                      {"rope_low_freq_factor", &m.rope_low_freq_factor, low},
                      {"rope_high_freq_factor", &m.rope_high_freq_factor, high}};
  for (const Num& f : nums) {
    if (*f.field != 0 && *f.field != f.value) throw disagree(f.key, concat(*f.field), concat(f.value));
    *f.field = f.value;
  }
  // The fields config.json holds as they are with null for none (ModelField::hf_null: Mistral's and
  // Gemma's windows, Gemma's caps), for the families that have them; absent, the class's default.
  for (const ModelField& f : model_fields()) {
    if (!f.hf_null || f.generic || !field_applies(f, *family)) continue;
    ModelArgs file, have;
    const bool whole = f.type == ModelField::Type::integer;
    f.set(file, whole ? ModelField::Value(integer(f.hf_key, false, std::get<int64_t>(f.fallback)))
                      : ModelField::Value(number(f.hf_key, std::get<double>(f.fallback))));
    f.from_config(have, m);
    if (f.get(have) != f.fallback && f.get(have) != f.get(file))
      throw disagree(f.key, field_text(f, have), field_text(f, file));
    f.to_config(m, f.get(file));
  }
  // The generic fields of this family (model_fields.h): the file's value, absent the class's
  // default (ModelField::hf_defaults), null or neither the row's fallback.
  for (const ModelField& f : model_fields()) {
    if (!f.generic || !field_applies(f, *family)) continue;
    ModelField::Value value = f.fallback;
    const std::string key = hf_key_of(f, type);
    if (c.contains(key) && !c[key].is_null()) {
      const json& v = c[key];
      const bool ok = f.type == ModelField::Type::integer  ? v.is_number_integer() && v.get<int64_t>() >= f.lo && v.get<int64_t>() <= f.hi
                      : f.type == ModelField::Type::number ? v.is_number() && v.get<double>() >= static_cast<double>(f.lo)
                      : f.type == ModelField::Type::flag   ? v.is_boolean()
                                                           : v.is_string();
      if (!ok)
        throw bad(key, concat("must be ",
                                   f.type == ModelField::Type::integer  ? concat("an integer in [", f.lo, ", ", f.hi, "]")
                                   : f.type == ModelField::Type::number ? concat("a number >= ", f.lo)
                                   : f.type == ModelField::Type::flag   ? std::string("true or false")
                                                                        : std::string("a string"),
                                   ", got ", v.dump()));
      if (f.type == ModelField::Type::integer) value = v.get<int64_t>();
      else if (f.type == ModelField::Type::number) value = v.get<double>();
      else if (f.type == ModelField::Type::flag) value = v.get<bool>();
      else value = v.get<std::string>();
    } else if (const char* d = hf_default_of(f, type); d && !c.contains(key)) {
      MPITRAIN_CHECK(field_from_text(f, d, value), concat(f.key, "'s class default '", d, "'"));
    }
    if (m.args.count(f.key) && m.args[f.key] != field_value_text(value))
      throw disagree(f.key, m.args[f.key], field_value_text(value));
    f.to_config(m, value);
  }
  struct Str { const char* key; std::string* field; std::string value; const char* unset; };
  const Str strs[] = {{"family", &m.family, family->name, ""},
                      {"arch", &m.arch, family->block, ""},
                      {"rope_scaling", &m.rope_scaling, scaling, ""},
                      {"qkv_bias", &m.qkv_bias, family->qkv_bias ? "true" : "false", "auto"},
                      // (absent: transformers' default, untied for Llama, Qwen and Mistral, tied for Gemma)
                      {"tie_embeddings", &m.tie_embeddings, flag("tie_word_embeddings", family->gemma_norms) ? "true" : "false",
                       "auto"},
                      {"qk_norm", &m.qk_norm, family->qk_norm ? "true" : "false", "auto"}};
  for (const Str& f : strs) {
    if (*f.field != f.unset && *f.field != f.value) throw disagree(f.key, *f.field, f.value);
    *f.field = f.value;
  }
  if (m.seq_len == 0) m.seq_len = std::min<int64_t>(max_position, 2048);
  // The shape is the file's: no preset adds to it (an explicit preset other than the default
  // would have filled nothing anyway, every field being set now).
  m.preset = "custom";
}

}  // namespace
}  // namespace mpitrain
