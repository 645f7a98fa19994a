// The run configuration: YAML text and --set overrides into Config, model presets, strict
// validation, world-size resolution of the batch sizes, and the resolved config back as YAML.
#include "mpitrain/config.h"

#include <sys/stat.h>

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>
#include <type_traits>
#include <utility>

#include "mpitrain/error.h"
#include "mpitrain/hf_config.h"
#include "mpitrain/model_fields.h"

namespace mpitrain {
namespace {

// ---- the key table ------------------------------------------------------------------------------
// One row per YAML key, in struct order. Parsing, to_yaml and "did you mean" all walk this list,
// so adding a field to config.h means adding one row here (plus its check in validate()).

enum class Kind { integer, unsigned_integer, number, boolean, string, string_list };

template <class T>
constexpr Kind kind_of() {
  if constexpr (std::is_same_v<T, int64_t>) return Kind::integer;
  else if constexpr (std::is_same_v<T, uint64_t>) return Kind::unsigned_integer;
  else if constexpr (std::is_same_v<T, double>) return Kind::number;
  else if constexpr (std::is_same_v<T, bool>) return Kind::boolean;
  else if constexpr (std::is_same_v<T, std::string>) return Kind::string;
  else if constexpr (std::is_same_v<T, std::vector<std::string>>) return Kind::string_list;
  else static_assert(sizeof(T) == 0, "config field of a type the YAML reader does not know");
}

struct Field {
  const char* section;
  const char* key;
  const char* name;  // "section.key"
  Kind kind;
  void* (*get)(Config&);  // the member; its real type is the one `kind` names
};

// The kind is deduced from the member's declared type, so a row can never disagree with it.
#define MPITRAIN_FIELD(sec, member)                                                  \
  Field{#sec, #member, #sec "." #member,                                             \
        kind_of<std::decay_t<decltype(std::declval<Config&>().sec.member)>>(),       \
        [](Config& c) -> void* { return &c.sec.member; }}

const Field kFields[] = {
    MPITRAIN_FIELD(model, preset),       MPITRAIN_FIELD(model, n_layer),
    MPITRAIN_FIELD(model, n_head),       MPITRAIN_FIELD(model, n_embd),
    MPITRAIN_FIELD(model, seq_len),      MPITRAIN_FIELD(model, vocab_size),
    MPITRAIN_FIELD(model, vocab_multiple), MPITRAIN_FIELD(model, family),
    MPITRAIN_FIELD(model, arch),         MPITRAIN_FIELD(model, n_kv_head),
    MPITRAIN_FIELD(model, intermediate_size), MPITRAIN_FIELD(model, rope_theta),
    MPITRAIN_FIELD(model, rope_scaling), MPITRAIN_FIELD(model, rope_factor),
    MPITRAIN_FIELD(model, rope_low_freq_factor), MPITRAIN_FIELD(model, rope_high_freq_factor),
    MPITRAIN_FIELD(model, rope_original_max_position), MPITRAIN_FIELD(model, max_position),
    MPITRAIN_FIELD(model, qkv_bias),     MPITRAIN_FIELD(model, tie_embeddings),
    MPITRAIN_FIELD(model, head_dim),     MPITRAIN_FIELD(model, qk_norm),
    MPITRAIN_FIELD(model, attn_softcap),
    MPITRAIN_FIELD(model, final_softcap), MPITRAIN_FIELD(model, query_pre_attn_scalar),
    MPITRAIN_FIELD(model, rope_local_theta),
    MPITRAIN_FIELD(model, norm_eps),
    MPITRAIN_FIELD(model, dropout),      MPITRAIN_FIELD(model, fused_loss),
    MPITRAIN_FIELD(model, fused_kernels), MPITRAIN_FIELD(model, attention),
    MPITRAIN_FIELD(model, init_from),    MPITRAIN_FIELD(data, train),
    MPITRAIN_FIELD(data, val),           MPITRAIN_FIELD(data, seed),
    MPITRAIN_FIELD(data, shuffle),       MPITRAIN_FIELD(data, weights),
    MPITRAIN_FIELD(data, stages),        MPITRAIN_FIELD(train, micro_batch),
    MPITRAIN_FIELD(train, grad_accum),   MPITRAIN_FIELD(train, global_batch),
    MPITRAIN_FIELD(train, steps),        MPITRAIN_FIELD(train, seed),
    MPITRAIN_FIELD(train, threads),      MPITRAIN_FIELD(train, out_dir),
    MPITRAIN_FIELD(train, device),       MPITRAIN_FIELD(train, precision),
    MPITRAIN_FIELD(train, activation_checkpointing), MPITRAIN_FIELD(train, ac_every),
    MPITRAIN_FIELD(train, moe_capacity_factor), MPITRAIN_FIELD(train, moe_z_loss_coef),
    MPITRAIN_FIELD(train, moe_bias_update_rate),
    MPITRAIN_FIELD(optim, lr),           MPITRAIN_FIELD(optim, min_lr),
    MPITRAIN_FIELD(optim, warmup_steps), MPITRAIN_FIELD(optim, weight_decay),
    MPITRAIN_FIELD(optim, beta1),        MPITRAIN_FIELD(optim, beta2),
    MPITRAIN_FIELD(optim, eps),          MPITRAIN_FIELD(optim, grad_clip),
    MPITRAIN_FIELD(optim, name),
    MPITRAIN_FIELD(optim, fused),        MPITRAIN_FIELD(optim, state_dtype),
    MPITRAIN_FIELD(optim, zero),
    MPITRAIN_FIELD(optim, reshard_after_forward),
    MPITRAIN_FIELD(eval, every),         MPITRAIN_FIELD(eval, batches),
    MPITRAIN_FIELD(eval, tasks),         MPITRAIN_FIELD(eval, tasks_every),  MPITRAIN_FIELD(eval, tokenizer),
    MPITRAIN_FIELD(log, every),          MPITRAIN_FIELD(log, level),
    MPITRAIN_FIELD(log, metrics),        MPITRAIN_FIELD(log, tensorboard),
    MPITRAIN_FIELD(log, peak_tflops),    MPITRAIN_FIELD(log, rank_files),
    MPITRAIN_FIELD(log, profile_start),  MPITRAIN_FIELD(log, profile_steps),
    MPITRAIN_FIELD(checkpoint, dir),
    MPITRAIN_FIELD(checkpoint, every),   MPITRAIN_FIELD(checkpoint, keep),
    MPITRAIN_FIELD(checkpoint, resume),  MPITRAIN_FIELD(checkpoint, async),
    MPITRAIN_FIELD(checkpoint, writers),   MPITRAIN_FIELD(checkpoint, at_end),
    MPITRAIN_FIELD(comm, backend),
    MPITRAIN_FIELD(comm, bucket_mb),     MPITRAIN_FIELD(comm, overlap),
    MPITRAIN_FIELD(comm, grad_dtype),    MPITRAIN_FIELD(comm, param_dtype), MPITRAIN_FIELD(comm, compress),
    MPITRAIN_FIELD(comm, powersgd_rank), MPITRAIN_FIELD(comm, powersgd_start),
    MPITRAIN_FIELD(parallel, tp),        MPITRAIN_FIELD(parallel, ep),        MPITRAIN_FIELD(parallel, islands),
    MPITRAIN_FIELD(parallel, slow_link_gbit), MPITRAIN_FIELD(parallel, pp),     MPITRAIN_FIELD(parallel, pp_schedule),
    MPITRAIN_FIELD(parallel, pp_virtual),  MPITRAIN_FIELD(parallel, pp_microbatches),
    MPITRAIN_FIELD(parallel, pp_first_stage_blocks), MPITRAIN_FIELD(parallel, pp_last_stage_blocks),
    MPITRAIN_FIELD(diloco, inner_steps), MPITRAIN_FIELD(diloco, outer_lr),
    MPITRAIN_FIELD(diloco, outer_momentum), MPITRAIN_FIELD(diloco, dtype),
    MPITRAIN_FIELD(diloco, fragments),   MPITRAIN_FIELD(diloco, overlap),
    MPITRAIN_FIELD(diloco, mix),
    MPITRAIN_FIELD(fault, collective_timeout_s),
    MPITRAIN_FIELD(fault, first_collective_timeout_s),
    MPITRAIN_FIELD(sample, tokens),
    MPITRAIN_FIELD(sample, prompt),      MPITRAIN_FIELD(sample, temperature),
    MPITRAIN_FIELD(sample, top_k),
};
#undef MPITRAIN_FIELD

template <class T>
T& member(const Field& f, Config& c) {
  return *static_cast<T*>(f.get(c));
}

const Field* find_field(const std::string& name) {
  for (const Field& f : kFields)
    if (name == f.name) return &f;
  return nullptr;
}

bool is_section(const std::string& name) {
  return std::any_of(std::begin(kFields), std::end(kFields),
                     [&](const Field& f) { return name == f.section; });
}

// ---- messages -----------------------------------------------------------------------------------

// The shortest decimal that reads back as the same double: "0.0006", not "0.00059999999999999995".
std::string format_double(double v) { return field_value_text(ModelField::Value(v)); }  // (model_fields.h)

// A YAML value as the user wrote it, for the "got X" part of a message.
std::string describe(const YAML::Node& node) {
  if (node.IsScalar()) return "'" + node.Scalar() + "'";
  if (!node.IsSequence() && !node.IsMap()) return "null";
  YAML::Emitter out;
  out << YAML::Flow << node;
  return out.c_str();
}

std::string show(int64_t v) { return std::to_string(v); }
std::string show(double v) { return format_double(v); }
std::string show(const std::string& s) { return "'" + s + "'"; }
std::string show(const std::vector<std::string>& list) {
  YAML::Emitter out;
  out << YAML::Flow << list;
  return out.c_str();
}

// "unknown key 'train.micro_bach' (did you mean 'train.micro_batch'?)". `name` is a bare
// section or section.key; it is compared with the known names of the same shape.
UsageError unknown_key(const std::string& where, const std::string& name) {
  const bool is_key = name.find('.') != std::string::npos;
  std::string best;
  size_t best_distance = 4;  // suggest only within 3 edits: further off is a guess, not a typo
  for (const Field& f : kFields) {
    const char* candidate = is_key ? f.name : f.section;
    size_t d = edit_distance(name, candidate);
    if (d < best_distance) best = candidate, best_distance = d;
  }
  // A key put in the wrong section ("train.lr") is no typo but still worth pointing at.
  if (best.empty() && is_key) {
    const std::string key = name.substr(name.find('.') + 1);
    int matches = 0;
    for (const Field& f : kFields)
      if (key == f.key) best = f.name, ++matches;
    if (matches != 1) best.clear();
  }
  std::string msg = concat(where, ": unknown key '", name, "'");
  if (!best.empty()) msg += concat(" (did you mean '", best, "'?)");
  return UsageError(msg);
}

// ---- reading values -----------------------------------------------------------------------------

YAML::Node load_yaml(const std::string& text, const std::string& where) {
  try {
    return YAML::Load(text);
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null()) throw UsageError(concat(where, ": YAML syntax error: ", e.msg));
    throw UsageError(concat(where, ": YAML syntax error at line ", e.mark.line + 1, ", column ",
                         e.mark.column + 1, ": ", e.msg));
  }
}

// Integers are parsed by hand rather than by yaml-cpp's as<>, which would take "8.0" or wrap an
// overflowing value: both must be type errors.
bool parse_integer(const std::string& s, int64_t& out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno == ERANGE || *end != '\0') return false;
  out = v;
  return true;
}

bool parse_unsigned(const std::string& s, uint64_t& out) {
  // strtoull accepts "-1" and wraps it around to 2^64-1.
  if (s.empty() || s[0] == '-' || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (errno == ERANGE || *end != '\0') return false;
  out = v;
  return true;
}

// Infinities and NaN are refused so that every range check below is a plain comparison.
bool parse_number(const std::string& s, double& out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (*end != '\0' || !std::isfinite(v)) return false;
  out = v;
  return true;
}

// Stores `node` into the field, or throws "<where>: train.steps must be an integer, got 'x'".
void set_field(const Field& f, const YAML::Node& node, Config& cfg, const std::string& where) {
  static const char* const expected[] = {"an integer", "a non-negative integer",
                                         "a number",   "a boolean",
                                         "a string",   "a list of strings"};
  auto type_error = [&] {
    return UsageError(concat(where, ": ", f.name, " must be ", expected[static_cast<int>(f.kind)],
                          ", got ", describe(node)));
  };
  const bool scalar = node.IsScalar();
  const std::string text = scalar ? node.Scalar() : "";
  bool ok = scalar;
  switch (f.kind) {
    case Kind::integer: ok = ok && parse_integer(text, member<int64_t>(f, cfg)); break;
    case Kind::unsigned_integer: ok = ok && parse_unsigned(text, member<uint64_t>(f, cfg)); break;
    case Kind::number: ok = ok && parse_number(text, member<double>(f, cfg)); break;
    case Kind::boolean: ok = ok && YAML::convert<bool>::decode(node, member<bool>(f, cfg)); break;
    case Kind::string: if (ok) member<std::string>(f, cfg) = text; break;
    case Kind::string_list: {
      // A single path is accepted as a one-element list: `train: data/train.h5`.
      std::vector<std::string> list;
      if (scalar) {
        list.push_back(text);
      } else if (node.IsSequence()) {
        for (const YAML::Node& item : node) {
          if (item.IsMap() && std::string(f.name) == "data.train") {  // {path, weight}: the entry, and its weight
            std::string path, weight;
            for (const auto& kv : item) {
              const std::string k = kv.first.Scalar();
              if (!kv.second.IsScalar() || (k != "path" && k != "weight"))
                throw UsageError(concat(where, ": data.train entries take path and weight, got ", describe(item)));
              (k == "path" ? path : weight) = kv.second.Scalar();
            }
            if (path.empty() || weight.empty())
              throw UsageError(concat(where, ": a data.train entry as a map needs both path and weight, got ", describe(item)));
            list.push_back(path);
            cfg.data.weights.resize(list.size() - 1);  // (entries before it without weights: refused by validate)
            cfg.data.weights.push_back(weight);
            continue;
          }
          if (item.IsMap() && std::string(f.name) == "data.stages") {  // {step, weights: [...]}: "STEP:W0/W1"
            const YAML::Node step = item["step"], weights = item["weights"];
            if (item.size() != 2 || !step || !step.IsScalar() || !weights || !weights.IsSequence())
              throw UsageError(concat(where, ": data.stages entries take step and weights (a list), got ", describe(item)));
            std::string text = step.Scalar() + ":";
            for (size_t w = 0; w < weights.size(); ++w) text += (w ? "/" : "") + weights[w].Scalar();
            list.push_back(text);
            continue;
          }
          if (item.IsMap() && std::string(f.name) == "eval.tasks") {  // {name, file, limit}: "NAME=FILE@LIMIT"
            std::string name, file, limit;
            for (const auto& kv : item) {
              const std::string k = kv.first.Scalar();
              if (!kv.second.IsScalar() || (k != "name" && k != "file" && k != "limit"))
                throw UsageError(concat(where, ": eval.tasks entries take name, file and limit, got ", describe(item)));
              (k == "name" ? name : k == "file" ? file : limit) = kv.second.Scalar();
            }
            list.push_back(concat(name.empty() ? "" : name + "=", file, limit.empty() ? "" : "@" + limit));
            continue;
          }
          if (!item.IsScalar()) throw type_error();
          list.push_back(item.Scalar());
        }
      } else {
        throw type_error();
      }
      member<std::vector<std::string>>(f, cfg) = std::move(list);
      ok = true;
      break;
    }
  }
  if (!ok) throw type_error();
}

// A model.* key kept by key (model_fields.h's generic rows), or nullptr.
const ModelField* generic_field(const std::string& name) {
  if (name.rfind("model.", 0) != 0) return nullptr;
  const ModelField* f = find_model_field(name.substr(6));
  return f && f->generic ? f : nullptr;
}

// Stores `node` as generic field `f`'s text, or throws as set_field does.
void set_generic(const ModelField& f, const YAML::Node& node, ModelConfig& m, const std::string& where) {
  static const char* const expected[] = {"an integer", "a number", "a boolean", "a string"};
  ModelField::Value v;
  bool ok = node.IsScalar();
  if (ok && f.type == ModelField::Type::flag) {
    bool b = false;
    ok = YAML::convert<bool>::decode(node, b);
    v = b;
  } else if (ok) {
    ok = field_from_text(f, node.Scalar(), v);
  }
  if (!ok)
    throw UsageError(concat(where, ": model.", f.key, " must be ", expected[static_cast<int>(f.type)], ", got ",
                            describe(node)));
  m.args[f.key] = field_value_text(v);
}

std::string key_text(const YAML::Node& key) {
  return key.IsScalar() ? key.Scalar() : describe(key);
}

// The document: a map of sections, each a map of keys. Duplicates are errors, because yaml-cpp
// keeps both and the silent winner would depend on the order of the reads.
void apply_document(const YAML::Node& root, Config& cfg, const std::string& where) {
  if (root.IsNull()) return;  // an empty file: all defaults
  if (!root.IsMap())
    throw UsageError(concat(where,
                         ": the top level must be a map of sections (model:, data:, ...), got ",
                         describe(root)));
  std::set<std::string> seen;
  for (const auto& section : root) {
    const std::string name = key_text(section.first);
    if (!is_section(name)) throw unknown_key(where, name);
    if (!seen.insert(name).second) throw UsageError(concat(where, ": duplicate key '", name, "'"));
    const YAML::Node& body = section.second;
    if (body.IsNull()) continue;  // "sample:" with every key commented out
    if (!body.IsMap())
      throw UsageError(concat(where, ": ", name, " must be a map of keys, got ", describe(body)));
    for (const auto& item : body) {
      const std::string full = name + "." + key_text(item.first);
      const Field* f = find_field(full);
      const ModelField* g = f ? nullptr : generic_field(full);
      if (!f && !g) throw unknown_key(where, full);
      if (!seen.insert(full).second) throw UsageError(concat(where, ": duplicate key '", full, "'"));
      if (g) set_generic(*g, item.second, cfg.model, where);
      else set_field(*f, item.second, cfg, where);
    }
  }
}

// "section.key=value", the value parsed as YAML so that lists work: data.train=[a.h5,b.h5].
void apply_override(const std::string& spec, Config& cfg) {
  const std::string where = "--set";
  const size_t eq = spec.find('=');
  const std::string name = spec.substr(0, eq);
  const size_t dot = name.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot == 0 || dot + 1 == name.size())
    throw UsageError(concat(where, ": expected section.key=value, got '", spec, "'"));
  const Field* f = find_field(name);
  const ModelField* g = f ? nullptr : generic_field(name);
  if (!f && !g) throw unknown_key(where, name);
  const YAML::Node value = load_yaml(spec.substr(eq + 1), concat("--set '", spec, "': the value of ", name));
  if (g) set_generic(*g, value, cfg.model, where);
  else set_field(*f, value, cfg, where);
}

// ---- presets and validation ---------------------------------------------------------------------

// A preset is one row of model_presets() (model_fields.h): its fields by name, as the model.* keys
// of a config (the key table above reads them, so a row is typed like a config).
using Preset = ModelPreset;

// The preset's row as a Config's model section.
Config preset_config(const Preset& p) {
  Config c;
  const std::string where = concat("model.preset ", p.name);
  for (const auto& item : load_yaml(concat("{", p.fields, "}"), where)) {
    const Field* f = find_field("model." + item.first.Scalar());
    const ModelField* g = f ? nullptr : generic_field("model." + item.first.Scalar());
    MPITRAIN_CHECK(f || g, concat(where, ": no key model.", item.first.Scalar()));
    if (g) set_generic(*g, item.second, c.model, where);
    else set_field(*f, item.second, c, where);
  }
  return c;
}

// Whether field `f` holds the same value in `a` and `b`, and the copy of it from `from`.
bool same_value(const Field& f, Config& a, Config& b) {
  switch (f.kind) {
    case Kind::integer: return member<int64_t>(f, a) == member<int64_t>(f, b);
    case Kind::unsigned_integer: return member<uint64_t>(f, a) == member<uint64_t>(f, b);
    case Kind::number: return member<double>(f, a) == member<double>(f, b);
    case Kind::boolean: return member<bool>(f, a) == member<bool>(f, b);
    case Kind::string: return member<std::string>(f, a) == member<std::string>(f, b);
    case Kind::string_list: return member<std::vector<std::string>>(f, a) == member<std::vector<std::string>>(f, b);
  }
  return false;
}

void copy_value(const Field& f, Config& from, Config& to) {
  switch (f.kind) {
    case Kind::integer: member<int64_t>(f, to) = member<int64_t>(f, from); break;
    case Kind::unsigned_integer: member<uint64_t>(f, to) = member<uint64_t>(f, from); break;
    case Kind::number: member<double>(f, to) = member<double>(f, from); break;
    case Kind::boolean: member<bool>(f, to) = member<bool>(f, from); break;
    case Kind::string: member<std::string>(f, to) = member<std::string>(f, from); break;
    case Kind::string_list: member<std::vector<std::string>>(f, to) = member<std::vector<std::string>>(f, from); break;
  }
}

// Fills the unset fields (0, "" or auto) from the preset's row, then from the family's and the
// block's defaults; an explicit value wins. GPT-2 has none of Llama's keys: setting one is an
// error naming it. A named model.family fixes its flags; without one (configs that say only
// model.arch) the family is what the parts make (family_of_parts).
void apply_preset(ModelConfig& m, const std::string& where) {
  const Preset* p = nullptr;
  for (const Preset& q : model_presets())
    if (m.preset == q.name) p = &q;
  if (!p && m.preset != "custom") {
    std::string names;
    for (const Preset& q : model_presets()) names += concat(q.name, "|");
    throw UsageError(concat(where, ": model.preset must be one of ", names, "custom, got ", show(m.preset)));
  }
  Config preset;  // the row (a default Config when custom)
  if (p) preset = preset_config(*p);
  const Family* from_preset = p ? find_family(preset.model.family) : nullptr;
  const bool named = !m.family.empty();
  const Family* family = named ? find_family(m.family) : from_preset;
  // A preset's family that no flag says (gemma2, gemma3: family_of_parts never makes them) fixes its parts
  // as a named one does; the others' family is what the parts make, as before model.family.
  const bool fixed = named || (from_preset && &family_of_parts(from_preset->block, from_preset->qkv_bias,
                                                                from_preset->qk_norm, from_preset->window_pattern) != from_preset);
  if (named && !family)
    throw UsageError(concat(where, ": model.family must be one of ", family_names(), ", got ", show(m.family)));
  if (m.arch.empty()) m.arch = family ? family->block : "gpt2";
  if (m.arch != "gpt2" && m.arch != "llama")
    throw UsageError(concat(where, ": model.arch must be one of gpt2|llama, got ", show(m.arch)));
  if (from_preset && m.arch != from_preset->block)
    throw UsageError(concat(where, ": model.", named ? "family" : "arch", " must be ",
                            named ? concat("one of the ", from_preset->block, " families") : std::string(from_preset->block),
                            " with model.preset ", p->name, " (or use model.preset: custom), got ",
                            show(named ? m.family : m.arch)));
  if (named && m.arch != family->block)
    throw UsageError(concat(where, ": model.arch must be ", family->block, " with model.family ", family->name,
                            " (or leave it unset), got ", show(m.arch)));
  if (!p) {
    for (const auto& [key, value] : {std::pair{"n_layer", m.n_layer}, std::pair{"n_head", m.n_head},
                                     std::pair{"n_embd", m.n_embd}, std::pair{"seq_len", m.seq_len}})
      if (value == 0)
        throw UsageError(concat(where, ": model.", key, " must be set (> 0) when model.preset is 'custom', got 0"));
    if (m.arch == "llama" && m.intermediate_size == 0)
      throw UsageError(concat(where, ": model.intermediate_size must be set (> 0) for a custom llama model, got 0"));
  }
  // The row's fields where this config leaves them unset. Llama 3's rope parameters come only with
  // the row's rope_scaling (a config that sets another scaling sets its own).
  Config here, unset;
  here.model = m;
  const bool own_scaling = !m.rope_scaling.empty() && m.rope_scaling != preset.model.rope_scaling;
  for (const Field& f : kFields) {
    const std::string key = f.key;
    if (std::string(f.section) != "model" || key == "preset" || key == "family" || key == "arch") continue;
    if (own_scaling && key.rfind("rope_", 0) == 0 && key != "rope_scaling" && key != "rope_theta") continue;
    if (same_value(f, here, unset) && !same_value(f, preset, unset)) copy_value(f, preset, here);
  }
  for (const auto& [key, text] : preset.model.args) here.model.args.emplace(key, text);  // (kept where set)
  m = here.model;
  auto fill = [](auto& field, auto value) {
    if (field == decltype(value){}) field = value;
  };
  {  // the fields of some families only (Gemma's): none set for another family
    GPTDims set;
    const Family& fam = family ? *family  // unnamed: what the parts make
                               : family_of_parts(m.arch, m.qkv_bias == "true", m.qk_norm == "true", window_of_config(m));
    for (const ModelField& f : model_fields()) {
      if (!*f.families) continue;
      f.from_config(set, m);
      if (!field_applies(f, fam) && f.get(set) != f.fallback)
        throw UsageError(concat(where, ": model.", f.key, " applies to model.family ", f.families, " only (this model is ",
                                fam.name, "), got ", field_text(f, set)));
    }
  }
  if (m.arch == "gpt2") {
    const std::pair<const char*, bool> llama_only[] = {
        {"n_kv_head", m.n_kv_head != 0 && m.n_kv_head != m.n_head},
        {"intermediate_size", m.intermediate_size != 0 && m.intermediate_size != 4 * m.n_embd},
        {"rope_theta", m.rope_theta != 0},
        {"rope_scaling", !m.rope_scaling.empty() && m.rope_scaling != "none"},
        {"rope_factor", m.rope_factor != 0},
        {"rope_low_freq_factor", m.rope_low_freq_factor != 0},
        {"rope_high_freq_factor", m.rope_high_freq_factor != 0},
        {"rope_original_max_position", m.rope_original_max_position != 0},
        {"max_position", m.max_position != 0 && m.max_position != m.seq_len},
        {"qkv_bias", m.qkv_bias == "false"},
        {"tie_embeddings", m.tie_embeddings == "false"},
        {"head_dim", m.head_dim != 0 && m.head_dim * m.n_head != m.n_embd},
        {"qk_norm", m.qk_norm == "true"}};
    for (const auto& [key, set] : llama_only)
      if (set)
        throw UsageError(concat(where, ": model.", key, " applies to model.arch: llama only (this model is gpt2, ",
                                "whose value is fixed)"));
    fill(m.norm_eps, 1e-5);
    m.family = "gpt2";
    return;
  }
  if (family) {  // the family's flags where unset
    if (m.qkv_bias == "auto") m.qkv_bias = family->qkv_bias ? "true" : "false";
    if (m.qk_norm == "auto") m.qk_norm = family->qk_norm ? "true" : "false";
  }
  fill(m.n_kv_head, m.n_head);
  fill(m.max_position, m.seq_len);
  fill(m.rope_theta, 10000.0);
  fill(m.norm_eps, 1e-5);
  fill(m.rope_scaling, std::string("none"));
  if (m.qkv_bias == "auto") m.qkv_bias = "false";
  if (m.tie_embeddings == "auto") m.tie_embeddings = "true";
  if (m.qk_norm == "auto") m.qk_norm = "false";
  // The fields of some families: their defaults where the family has them.
  auto has = [&](const char* key) { return family && field_applies(*find_model_field(key), *family); };
  if (has("query_pre_attn_scalar"))
    fill(m.query_pre_attn_scalar, static_cast<double>(m.head_dim > 0 ? m.head_dim : m.n_embd / m.n_head));
  if (has("rope_local_theta")) fill(m.rope_local_theta, 10000.0);
  if (!fixed) {  // as before model.family: the parts say it (validate refuses parts no family has)
    m.family = family_of_parts(m.arch, m.qkv_bias == "true", m.qk_norm == "true", window_of_config(m)).name;
    return;
  }
  m.family = family->name;
  if (const char* conflict = family_conflict(*family, m.arch, m.qkv_bias == "true", m.qk_norm == "true", window_of_config(m))) {
    const std::string key = conflict;
    const bool window = key == window_key();
    const bool fixed = key == "qkv_bias" ? family->qkv_bias : family->qk_norm;
    throw UsageError(concat(where, ": model.", key, " must be ", window ? "0" : fixed ? "true" : "false",
                            " with model.family ", family->name, " (", family->about, "), got ",
                            window ? show(window_of_config(m)) : show(key == "qkv_bias" ? m.qkv_bias : m.qk_norm)));
  }
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool one_of(const std::string& s, std::initializer_list<const char*> allowed) {
  return std::any_of(allowed.begin(), allowed.end(), [&](const char* a) { return s == a; });
}

bool has_empty(const std::vector<std::string>& list) {
  return std::any_of(list.begin(), list.end(), [](const std::string& s) { return s.empty(); });
}

// Everything that does not depend on the world size; the first failure throws.
void validate(const Config& c, const std::string& where) {
  auto check = [&](bool ok, const char* key, const std::string& what, const std::string& got) {
    if (!ok) throw UsageError(concat(where, ": ", key, " must be ", what, ", got ", got));
  };
  const ModelConfig& m = c.model;
  check(m.n_layer > 0, "model.n_layer", "> 0", show(m.n_layer));
  check(m.n_head > 0, "model.n_head", "> 0", show(m.n_head));
  check(m.n_embd > 0, "model.n_embd", "> 0", show(m.n_embd));
  check(m.seq_len > 0, "model.seq_len", "> 0", show(m.seq_len));
  check(m.vocab_size >= 0, "model.vocab_size", ">= 0 (0 = from the shards)", show(m.vocab_size));
  check(m.vocab_multiple >= 0 && m.vocab_multiple <= 65536, "model.vocab_multiple", "in [0, 65536] (0 = automatic)",
        show(m.vocab_multiple));
  // The head size: model.head_dim (llama), else n_embd / n_head, which must then divide evenly.
  check(m.head_dim >= 0, "model.head_dim", ">= 0 (0 = model.n_embd / model.n_head)", show(m.head_dim));
  if (m.head_dim == 0)
    check(m.n_embd % m.n_head == 0, "model.n_embd", concat("divisible by model.n_head (", m.n_head, ")"),
          show(m.n_embd));
  check(m.dropout >= 0 && m.dropout < 1, "model.dropout", "in [0, 1)", show(m.dropout));
  check(m.norm_eps > 0, "model.norm_eps", "> 0", show(m.norm_eps));
  if (m.arch == "llama") {
    check(m.n_kv_head > 0 && m.n_head % m.n_kv_head == 0, "model.n_kv_head",
          concat("> 0 and dividing model.n_head (", m.n_head, ")"), show(m.n_kv_head));
    check(m.intermediate_size > 0, "model.intermediate_size", "> 0", show(m.intermediate_size));
    if (m.head_dim > 0)
      check(m.head_dim % 2 == 0, "model.head_dim", "even (rotary pairs)", show(m.head_dim));
    else
      check((m.n_embd / m.n_head) % 2 == 0, "model.n_embd",
            concat("n_head x an even head size (rotary pairs; n_head ", m.n_head, ")"), show(m.n_embd));
    check(m.rope_theta > 0, "model.rope_theta", "> 0", show(m.rope_theta));
    check(one_of(m.rope_scaling, {"none", "llama3", "linear"}), "model.rope_scaling", "one of none|llama3|linear",
          show(m.rope_scaling));
    check(m.max_position > 0, "model.max_position", "> 0", show(m.max_position));
    check(one_of(m.qkv_bias, {"true", "false"}), "model.qkv_bias", "true or false", show(m.qkv_bias));
    check(one_of(m.tie_embeddings, {"true", "false"}), "model.tie_embeddings", "true or false",
          show(m.tie_embeddings));
    check(one_of(m.qk_norm, {"true", "false"}), "model.qk_norm", "true or false", show(m.qk_norm));
    // Qwen3 (q/k norms) has no q/k/v biases; its attention_bias would put one on o_proj too.
    check(m.qk_norm == "false" || m.qkv_bias == "false", "model.qk_norm",
          "false with model.qkv_bias: true (no Hugging Face model has both: Qwen2 has the biases, Qwen3 the norms)",
          show(m.qk_norm));
    // The window (Mistral's, Gemma's) of any length: shorter than seq_len it cuts. (Gemma 3's q/k
    // norms are its family's; a window with Qwen's flags is none of the families.)
    // (Its range: the row's.)
    const Family* fam = find_family(m.family);
    const bool gemma = fam && fam->gemma_norms;
    if (window_of_config(m) > 0 && !gemma)
      check(m.qkv_bias == "false" && m.qk_norm == "false", concat("model.", window_key()).c_str(),
            "0 with model.qkv_bias or model.qk_norm (the window is Mistral's and Gemma's; Qwen's sliding windows are "
            "not supported)",
            show(window_of_config(m)));
    check(m.attn_softcap >= 0, "model.attn_softcap", ">= 0 (0 = none)", show(m.attn_softcap));
    check(m.final_softcap >= 0, "model.final_softcap", ">= 0 (0 = none)", show(m.final_softcap));
    check(m.query_pre_attn_scalar >= 0, "model.query_pre_attn_scalar", ">= 0 (0 = the head size)",
          show(m.query_pre_attn_scalar));
    check(m.rope_local_theta >= 0, "model.rope_local_theta", ">= 0", show(m.rope_local_theta));
    // Gemma's norms (x (1 + w), one after each sublayer too) have no fused op; nor has the fused
    // loss a soft cap on the logits.
    if (gemma)
      check(m.fused_kernels != "on", "model.fused_kernels", concat("auto or off with model.family ", m.family,
            " (its norms have no fused op)"), show(m.fused_kernels));
    if (m.final_softcap > 0)
      check(m.fused_loss != "on", "model.fused_loss", "auto or off with model.final_softcap (the fused loss has no soft cap)",
            show(m.fused_loss));
    // The generic rows of the family (model_fields.h): in range; a fallback outside the range set.
    for (const ModelField& f : model_fields()) {
      if (!f.generic) continue;
      GPTDims v;
      f.from_config(v, m);
      const ModelField::Value value = f.get(v);
      const bool whole = f.type == ModelField::Type::integer, number = f.type == ModelField::Type::number;
      const bool in_range = whole    ? std::get<int64_t>(value) >= f.lo && std::get<int64_t>(value) <= f.hi
                            : number ? std::get<double>(value) >= static_cast<double>(f.lo)
                                     : true;
      const std::string range = whole ? concat("in [", f.lo, ", ", f.hi, "]") : concat(">= ", f.lo);
      // A value set is in range whatever the family (a negative window would make a llama of a
      // model without a family); one unset is the fallback, which must be in range.
      if (m.args.count(f.key)) check(in_range, concat("model.", f.key).c_str(), range, field_text(f, v));
      if (!fam || !field_applies(f, *fam)) continue;
      if (!m.args.count(f.key) && !in_range)
        throw UsageError(concat(where, ": model.", f.key, " must be set (", range, ") with model.family ", fam->name));
      if (const char* fixed = fixed_value_of(f, fam->name))
        check(field_value_text(value) == fixed, concat("model.", f.key).c_str(), concat(fixed, " with model.family ", fam->name),
              field_text(f, v));
    }
    // llama3's four parameters; linear's factor alone.
    const bool llama3 = m.rope_scaling == "llama3", linear = m.rope_scaling == "linear";
    auto scaling_key = [&](const char* key, bool ok, const std::string& range, const std::string& got) {
      check(llama3 ? ok : got == "0", key, llama3 ? range : "unset (0) unless model.rope_scaling is llama3", got);
    };
    check(llama3 || linear ? m.rope_factor >= 1 : m.rope_factor == 0, "model.rope_factor",
          llama3 || linear ? ">= 1" : "unset (0) unless model.rope_scaling is llama3 or linear", show(m.rope_factor));
    scaling_key("model.rope_low_freq_factor", m.rope_low_freq_factor > 0, "> 0", show(m.rope_low_freq_factor));
    scaling_key("model.rope_high_freq_factor", m.rope_high_freq_factor > m.rope_low_freq_factor,
                concat("> model.rope_low_freq_factor (", show(m.rope_low_freq_factor), ")"),
                show(m.rope_high_freq_factor));
    scaling_key("model.rope_original_max_position", m.rope_original_max_position > 0, "> 0",
                show(m.rope_original_max_position));
  }

  const DataConfig& d = c.data;
  check(!d.train.empty() && !has_empty(d.train), "data.train",
        "a non-empty list of shard files, directories or globs", show(d.train));
  check(!has_empty(d.val), "data.val", "a list of non-empty paths", show(d.val));
  check(d.weights.empty() || d.weights.size() == d.train.size(), "data.weights",
        concat("one weight per data.train entry (", d.train.size(), "), or none"), show(d.weights));
  for (const std::string& w : d.weights) {
    double v = 0;
    check(parse_number(w, v) && v > 0, "data.weights", "numbers > 0 (each data.train entry's share)", show(d.weights));
  }
  check(d.stages.empty() || !d.weights.empty(), "data.stages", "empty without data.weights (the stages change a mixture)",
        show(d.stages));
  for (size_t i = 0, last = 0; i < d.stages.size(); ++i) {
    const auto [step, w] = parse_stage_spec(d.stages[i], d.weights.size(), concat(where, ": data.stages"));
    check(step > static_cast<int64_t>(last) && step < c.train.steps, "data.stages",
          concat("steps increasing, each in [1, train.steps); entry ", i, " is step ", step), show(d.stages));
    last = static_cast<size_t>(step);
  }

  check(c.eval.every >= 0, "eval.every", ">= 0 (0 = never)", show(c.eval.every));
  check(c.eval.every == 0 || !d.val.empty(), "data.val",
        concat("non-empty when eval.every > 0 (eval.every is ", c.eval.every,
            "; set it to 0 to skip validation)"),
        show(d.val));
  check(c.eval.batches > 0, "eval.batches", "> 0", show(c.eval.batches));
  check(c.eval.tasks_every >= 0, "eval.tasks_every", ">= 0 (0 = with each validation pass)", show(c.eval.tasks_every));
  {
    std::set<std::string> names;
    for (const std::string& spec : c.eval.tasks) {
      const TaskSpec t = parse_task_spec(spec, concat(where, ": eval.tasks"));
      check(names.insert(t.name).second, "eval.tasks", "a list of tasks with different names", show(c.eval.tasks));
    }
  }

  const TrainConfig& t = c.train;
  check(t.micro_batch > 0, "train.micro_batch", "> 0", show(t.micro_batch));
  check(t.grad_accum >= 0, "train.grad_accum", ">= 0 (0 = derived)", show(t.grad_accum));
  check(t.global_batch >= 0, "train.global_batch", ">= 0 (0 = derived)", show(t.global_batch));
  check(t.steps > 0, "train.steps", "> 0", show(t.steps));
  check(t.threads >= 0, "train.threads", ">= 0 (0 = automatic)", show(t.threads));
  check(!t.out_dir.empty(), "train.out_dir", "non-empty", show(t.out_dir));
  check(one_of(c.model.fused_loss, {"auto", "on", "off"}), "model.fused_loss", "one of auto|on|off",
        show(c.model.fused_loss));
  check(one_of(c.model.fused_kernels, {"auto", "on", "off"}), "model.fused_kernels", "one of auto|on|off",
        show(c.model.fused_kernels));
  check(one_of(c.model.attention, {"auto", "flash", "cudnn", "efficient", "math"}), "model.attention",
        "one of auto|flash|cudnn|efficient|math", show(c.model.attention));
  check(one_of(t.device, {"auto", "cpu", "cuda"}), "train.device", "one of auto|cpu|cuda", show(t.device));
  check(one_of(t.activation_checkpointing, {"none", "full", "selective"}), "train.activation_checkpointing",
        "one of none|full|selective", show(t.activation_checkpointing));
  check(t.ac_every >= 1, "train.ac_every", ">= 1", show(t.ac_every));
  check(capacity_factor_of(t.moe_capacity_factor) >= 0, "train.moe_capacity_factor",
        "none (dropless) or a number > 0", show(t.moe_capacity_factor));
  const auto experts = [&] { return m.arch == "llama" && dims_of_config(m).has_experts(); };
  check(t.moe_capacity_factor == "none" || experts(), "train.moe_capacity_factor",
        "none for a model without experts", show(t.moe_capacity_factor));
  check(std::isfinite(t.moe_z_loss_coef) && t.moe_z_loss_coef >= 0, "train.moe_z_loss_coef", ">= 0",
        show(t.moe_z_loss_coef));
  check(t.moe_z_loss_coef == 0 || experts(), "train.moe_z_loss_coef", "0 for a model without experts",
        show(t.moe_z_loss_coef));
  check(std::isfinite(t.moe_bias_update_rate) && t.moe_bias_update_rate >= 0, "train.moe_bias_update_rate", ">= 0",
        show(t.moe_bias_update_rate));
  check(t.moe_bias_update_rate == 0 || experts(), "train.moe_bias_update_rate", "0 for a model without experts",
        show(t.moe_bias_update_rate));
  check(one_of(t.precision, {"fp32", "bf16", "fp16"}), "train.precision", "one of fp32|bf16|fp16",
        show(t.precision));

  const OptimConfig& o = c.optim;
  check(o.lr > 0, "optim.lr", "> 0", show(o.lr));
  check(o.min_lr >= 0 && o.min_lr <= o.lr, "optim.min_lr",
        concat("in [0, optim.lr] = [0, ", show(o.lr), "]"), show(o.min_lr));
  check(o.warmup_steps >= 0 && o.warmup_steps <= t.steps, "optim.warmup_steps",
        concat("in [0, train.steps] = [0, ", t.steps, "]"), show(o.warmup_steps));
  check(o.weight_decay >= 0, "optim.weight_decay", ">= 0", show(o.weight_decay));
  check(o.beta1 >= 0 && o.beta1 < 1, "optim.beta1", "in [0, 1)", show(o.beta1));
  check(o.beta2 >= 0 && o.beta2 < 1, "optim.beta2", "in [0, 1)", show(o.beta2));
  check(o.eps > 0, "optim.eps", "> 0", show(o.eps));
  check(one_of(o.fused, {"auto", "on", "off"}), "optim.fused", "one of auto|on|off", show(o.fused));
  check(o.grad_clip >= 0, "optim.grad_clip", ">= 0 (0 = off)", show(o.grad_clip));
  check(one_of(o.name, {"adamw", "sgd"}), "optim.name", "one of adamw|sgd", show(o.name));
  check(o.name == "adamw" || o.fused != "on", "optim.fused", "auto or off with optim.name: sgd (the fused kernel is AdamW's)",
        show(o.fused));
  check(one_of(o.state_dtype, {"fp32", "bf16"}), "optim.state_dtype", "one of fp32|bf16", show(o.state_dtype));
  check(o.state_dtype == "fp32" || o.fused != "on", "optim.fused",
        "auto or off with optim.state_dtype: bf16 (the fused kernel keeps fp32 moments)", show(o.fused));
  check(o.zero >= 0 && o.zero <= 3, "optim.zero",
        "0 (off), 1 (ZeRO-1: optimizer state sharded), 2 (ZeRO-2: gradients too) or 3 (ZeRO-3: parameters too)",
        show(o.zero));

  check(c.log.every > 0, "log.every", "> 0", show(c.log.every));
  check(one_of(c.log.level, {"debug", "info", "warn", "error"}), "log.level",
        "one of debug|info|warn|error", show(c.log.level));
  check(c.log.profile_start >= 0, "log.profile_start", ">= 0 (0 = no profile)", show(c.log.profile_start));
  check(c.log.profile_steps > 0, "log.profile_steps", "> 0", show(c.log.profile_steps));
  check(c.log.peak_tflops >= 0, "log.peak_tflops", ">= 0 (0 = the known GPU's peak)", show(c.log.peak_tflops));

  const CheckpointConfig& k = c.checkpoint;
  check(!k.dir.empty(), "checkpoint.dir", "non-empty", show(k.dir));
  check(k.every >= 0, "checkpoint.every", ">= 0 (0 = only at the end)", show(k.every));
  check(k.keep >= 1, "checkpoint.keep", ">= 1", show(k.keep));
  check(one_of(k.resume, {"auto", "none"}) || (ends_with(k.resume, ".h5") && k.resume.size() > 3),
        "checkpoint.resume", "'auto', 'none' or the path of a .h5 checkpoint", show(k.resume));
  check(one_of(k.writers, {"auto", "rank0"}), "checkpoint.writers", "one of auto|rank0", show(k.writers));

  check(one_of(c.comm.backend, {"auto", "mpi", "nccl"}), "comm.backend", "one of auto|mpi|nccl",
        show(c.comm.backend));
  check(c.comm.bucket_mb > 0, "comm.bucket_mb", "> 0", show(c.comm.bucket_mb));
  check(one_of(c.comm.grad_dtype, {"fp32", "bf16", "fp16"}), "comm.grad_dtype", "one of fp32|bf16|fp16",
        show(c.comm.grad_dtype));
  check(one_of(c.comm.param_dtype, {"fp32", "bf16", "fp16"}), "comm.param_dtype", "one of fp32|bf16|fp16",
        show(c.comm.param_dtype));
  check(c.comm.param_dtype == "fp32" || c.optim.zero == 3, "comm.param_dtype",
        concat("fp32 with optim.zero: ", c.optim.zero, " (it casts ZeRO-3's parameter all-gathers; other stages gather none)"),
        show(c.comm.param_dtype));
  check(one_of(c.comm.compress, {"none", "powersgd"}), "comm.compress", "one of none|powersgd", show(c.comm.compress));
  check(c.comm.powersgd_rank >= 1, "comm.powersgd_rank", ">= 1", show(c.comm.powersgd_rank));
  check(c.comm.powersgd_start >= 0, "comm.powersgd_start", ">= 0", show(c.comm.powersgd_start));
  if (c.comm.compress == "powersgd") {  // the layouts PowerSGD does not cover, named with both keys
    check(c.optim.zero == 0, "comm.compress",
          concat("none with optim.zero: ", c.optim.zero,
                 " (ZeRO reduce-scatters whole gradients; PowerSGD all-reduces low-rank factors)"),
          show(c.comm.compress));
    check(c.parallel.tp == 1, "comm.compress", "none with parallel.tp > 1 (PowerSGD covers data parallelism only)",
          show(c.comm.compress));
    check(c.train.precision != "fp16", "comm.compress",
          "none with train.precision: fp16 (the error feedback would carry loss-scaled and overflowed gradients "
          "from step to step; use bf16)",
          show(c.comm.compress));
    check(c.comm.grad_dtype == "fp32", "comm.compress",
          "none with comm.grad_dtype " + c.comm.grad_dtype + " (PowerSGD's factors travel in fp32)",
          show(c.comm.compress));
  }
  check(c.parallel.tp >= 1, "parallel.tp", ">= 1", show(c.parallel.tp));
  if (m.arch == "llama")
    if (const std::string conflict = args_conflict(dims_of_config(m), c.parallel.tp, c.parallel.ep); !conflict.empty())
      throw UsageError(concat(where, ": ", conflict));
  check(c.parallel.ep >= 1, "parallel.ep", ">= 1", show(c.parallel.ep));
  if (c.parallel.ep > 1) {  // a mixture of experts' experts (args_conflict), at optim.zero 0-2
    check(m.arch == "llama", "parallel.ep", "1 for a model without experts (it splits a mixture of experts' experts)",
          show(c.parallel.ep));
  }
  check(c.parallel.pp >= 1, "parallel.pp", ">= 1", show(c.parallel.pp));
  check(one_of(c.parallel.pp_schedule, {"1f1b", "gpipe", "interleaved"}), "parallel.pp_schedule",
        "one of 1f1b|gpipe|interleaved", show(c.parallel.pp_schedule));
  check(c.parallel.pp_virtual >= 1, "parallel.pp_virtual", ">= 1", show(c.parallel.pp_virtual));
  check(c.parallel.pp_microbatches >= 0, "parallel.pp_microbatches", ">= 0 (0: train.grad_accum micro-batches)",
        show(c.parallel.pp_microbatches));
  check(c.parallel.pp_microbatches == 0 || c.parallel.pp > 1, "parallel.pp_microbatches",
        "0 without parallel.pp > 1 (the pipeline's micro-batches; train.grad_accum splits a step otherwise)",
        show(c.parallel.pp_microbatches));
  const bool interleaved = c.parallel.pp_schedule == "interleaved";
  check(!interleaved || c.parallel.pp_virtual >= 2, "parallel.pp_virtual",
        ">= 2 with parallel.pp_schedule: interleaved (the chunks of blocks each rank holds)", show(c.parallel.pp_virtual));
  check(interleaved || c.parallel.pp_virtual == 1, "parallel.pp_virtual",
        concat("1 with parallel.pp_schedule: ", c.parallel.pp_schedule, " (virtual stages are the interleaved schedule's)"),
        show(c.parallel.pp_virtual));
  if (c.parallel.pp > 1) {  // the stages (pipeline.h)
    check(m.n_layer == 0 || c.parallel.pp <= m.n_layer, "parallel.pp",
          concat("at most model.n_layer = ", m.n_layer, " (each stage holds at least one block)"), show(c.parallel.pp));
    const int64_t first = c.parallel.pp_first_stage_blocks, last = c.parallel.pp_last_stage_blocks, pp = c.parallel.pp;
    for (const auto& [key, n] : {std::pair<const char*, int64_t>{"parallel.pp_first_stage_blocks", first},
                                 {"parallel.pp_last_stage_blocks", last}}) {
      check(n >= 0, key, ">= 0 (0: as even as the blocks allow)", show(n));
      check(n == 0 || !interleaved, key, "0 with parallel.pp_schedule: interleaved", show(n));
    }
    if (m.n_layer > 0 && (first > 0 || last > 0)) {
      const int64_t others = pp - (first > 0) - (last > 0);  // stages sharing the rest
      const int64_t rest = m.n_layer - first - last;
      check(others == 0 ? rest == 0 : rest >= others, first > 0 ? "parallel.pp_first_stage_blocks" : "parallel.pp_last_stage_blocks",
            concat(others == 0 ? "with parallel.pp_last_stage_blocks exactly model.n_layer = " : "small enough to leave at least a block to each of the other ",
                   others == 0 ? m.n_layer : others, others == 0 ? " blocks between them" : concat(" stages (model.n_layer ", m.n_layer, ")")),
            show(first > 0 ? first : last));
    }
    const int64_t chunks = c.parallel.pp * c.parallel.pp_virtual;
    check(!interleaved || m.n_layer == 0 || m.n_layer % chunks == 0, "parallel.pp_virtual",
          concat("a number whose product with parallel.pp (", c.parallel.pp, ") divides model.n_layer = ", m.n_layer,
                 " (the interleaved schedule's chunks hold equal runs of blocks)"),
          show(c.parallel.pp_virtual));
  }
  const int64_t islands = islands_count(c.parallel.islands);
  check(islands != 0, "parallel.islands",
        "1 (none), host (one island per host), auto (from the links' bandwidth) or a number of islands >= 1",
        show(c.parallel.islands));
  check(c.parallel.slow_link_gbit > 0, "parallel.slow_link_gbit", "> 0", show(c.parallel.slow_link_gbit));
  const DilocoConfig& dl = c.diloco;
  check(dl.inner_steps >= 1, "diloco.inner_steps", ">= 1 (optimizer steps between outer steps)", show(dl.inner_steps));
  check(dl.outer_lr > 0, "diloco.outer_lr", "> 0", show(dl.outer_lr));
  check(dl.outer_momentum >= 0 && dl.outer_momentum < 1, "diloco.outer_momentum", "in [0, 1)", show(dl.outer_momentum));
  check(one_of(dl.dtype, {"fp32", "bf16", "int8"}), "diloco.dtype", "one of fp32|bf16|int8", show(dl.dtype));
  check(dl.fragments >= 1 && dl.fragments <= std::max<int64_t>(dl.inner_steps, 1), "diloco.fragments",
        concat("in [1, diloco.inner_steps = ", dl.inner_steps, "] (each fragment syncs at its own step of a round)"),
        show(dl.fragments));
  check(dl.overlap >= 0 && dl.overlap < std::max<int64_t>(dl.inner_steps, 1), "diloco.overlap",
        concat("in [0, diloco.inner_steps = ", dl.inner_steps, ") (an exchange completes before its fragment's next)"),
        show(dl.overlap));
  check(dl.mix >= 0 && dl.mix < 1, "diloco.mix", "in [0, 1)", show(dl.mix));
  check(c.fault.collective_timeout_s > 0, "fault.collective_timeout_s", "> 0",
        show(c.fault.collective_timeout_s));
  check(c.fault.first_collective_timeout_s > 0, "fault.first_collective_timeout_s", "> 0",
        show(c.fault.first_collective_timeout_s));

  const SampleConfig& s = c.sample;
  check(s.tokens >= 0, "sample.tokens", ">= 0 (0 = none)", show(s.tokens));
  check(s.temperature > 0, "sample.temperature", "> 0", show(s.temperature));
  check(s.top_k >= 0, "sample.top_k", ">= 0 (0 = no filtering)", show(s.top_k));
}

}  // namespace

// ---- public API ---------------------------------------------------------------------------------

std::pair<int64_t, std::vector<double>> parse_stage_spec(const std::string& spec, size_t sources, const std::string& key) {
  const size_t colon = spec.find(':');
  const auto bad = [&](const std::string& why) {
    return UsageError(concat(key, ": '", spec, "': ", why, " (STEP:W0/W1/... with one weight per data.train entry)"));
  };
  int64_t step = 0;
  if (colon == std::string::npos || !parse_integer(spec.substr(0, colon), step)) throw bad("no step before ':'");
  std::vector<double> weights;
  std::stringstream list(spec.substr(colon + 1));
  std::string item;
  double total = 0;
  while (std::getline(list, item, '/')) {
    double v = 0;
    if (!parse_number(item, v) || v < 0) throw bad(concat("'", item, "' is not a weight >= 0"));
    weights.push_back(v), total += v;
  }
  if (weights.size() != sources) throw bad(concat(weights.size(), " weights for ", sources, " sources"));
  if (total <= 0) throw bad("no weight > 0");
  return {step, weights};
}

TaskSpec parse_task_spec(const std::string& spec, const std::string& key) {
  TaskSpec t;
  std::string rest = spec;
  if (const size_t eq = rest.find('='); eq != std::string::npos) t.name = rest.substr(0, eq), rest = rest.substr(eq + 1);
  if (const size_t at = rest.rfind('@'); at != std::string::npos) {
    const std::string n = rest.substr(at + 1);
    if (n.empty() || n.size() > 12 || n.find_first_not_of("0123456789") != std::string::npos)
      throw UsageError(concat(key, ": '", spec, "': the limit after @ must be a number of examples (0 = all)"));
    t.limit = std::stoll(n);
    rest = rest.substr(0, at);
  }
  t.file = rest;
  if (t.file.empty()) throw UsageError(concat(key, ": '", spec, "' names no file (NAME=FILE@LIMIT)"));
  if (t.name.empty()) t.name = std::filesystem::path(t.file).stem().string();
  if (t.name.empty() || t.name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") !=
                            std::string::npos)
    throw UsageError(concat(key, ": '", spec, "': a task's name is letters, digits, _ . and - (got '", t.name, "')"));
  return t;
}

double capacity_factor_of(const std::string& spec) {
  if (spec == "none") return 0;
  char* end = nullptr;
  const double f = std::strtod(spec.c_str(), &end);
  return !spec.empty() && end == spec.c_str() + spec.size() && std::isfinite(f) && f > 0 ? f : -1;
}

int64_t islands_count(const std::string& spec) {
  if (spec == "host") return -1;
  if (spec == "auto") return -2;
  if (spec.empty() || spec.size() > 7 || !std::all_of(spec.begin(), spec.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
    return 0;
  return std::stoll(spec);
}

Config parse_config(const std::string& yaml_text, const std::string& source,
                    const std::vector<std::string>& overrides, bool read_hf_config) {
  Config cfg;
  cfg.source = source;
  apply_document(load_yaml(yaml_text, source), cfg, source);
  for (const std::string& spec : overrides) apply_override(spec, cfg);
  if (const std::string dir = hf_model_dir(cfg.model.init_from); read_hf_config && !dir.empty())
    apply_hf_config(cfg.model, dir, source);
  apply_preset(cfg.model, source);
  validate(cfg, source);
  return cfg;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  // A regular file, checked before opening (a FIFO would block the open), read up to a bound
  // (below: /dev/zero would never end, and /proc files report size 0).
  constexpr size_t kMaxConfigBytes = 1 << 20;
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw UsageError(concat(path, ": cannot read config file (not a regular file)"));
  // stdio rather than ifstream: reading a directory must fail here, and ferror says so.
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (!file) throw UsageError(concat(path, ": cannot read config file (", std::strerror(errno), ")"));
  std::string text;
  char buf[8192];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, file)) > 0 && text.size() <= kMaxConfigBytes) text.append(buf, n);
  if (text.size() > kMaxConfigBytes) {
    std::fclose(file);
    throw UsageError(concat(path, ": config file of more than the 1 MiB a config may have"));
  }
  const bool failed = std::ferror(file) != 0;
  const int err = errno;
  std::fclose(file);
  if (failed) throw UsageError(concat(path, ": cannot read config file (", std::strerror(err), ")"));
  return parse_config(text, path, overrides, /*read_hf_config=*/true);
}

void resolve_for_world(Config& cfg, int world_size) {
  TrainConfig& t = cfg.train;
  MPITRAIN_CHECK(world_size > 0 && t.micro_batch > 0 && t.grad_accum >= 0,
                 concat("resolve_for_world on an unvalidated config (world size ", world_size, ")"));
  const std::string& where = cfg.source;
  // Products of user numbers: refuse rather than overflow.
  auto times = [&](int64_t a, int64_t b) {
    int64_t r = 0;
    if (__builtin_mul_overflow(a, b, &r))
      throw UsageError(
          concat(where, ": train.micro_batch x world size x train.grad_accum is too large"));
    return r;
  };
  const int64_t per_micro_step = times(t.micro_batch, world_size);
  if (t.grad_accum == 0) {
    if (t.global_batch == 0) {
      t.grad_accum = 1;
    } else if (t.global_batch % per_micro_step != 0) {
      throw UsageError(concat(where, ": train.global_batch must be a multiple of train.micro_batch x ",
                           "world size (", t.micro_batch, " x ", world_size, " = ", per_micro_step,
                           "), got ", t.global_batch));
    } else {
      t.grad_accum = t.global_batch / per_micro_step;
    }
  } else if (t.global_batch != 0 && t.global_batch != times(per_micro_step, t.grad_accum)) {
    throw UsageError(concat(where, ": train.global_batch must equal train.micro_batch x world size x ",
                         "train.grad_accum (", t.micro_batch, " x ", world_size, " x ",
                         t.grad_accum, " = ", times(per_micro_step, t.grad_accum), "), got ",
                         t.global_batch));
  }
  t.global_batch = times(per_micro_step, t.grad_accum);
  // The pipeline's micro-batches: the same rows per replica and step, split another way.
  if (const int64_t split = cfg.parallel.pp_microbatches; split > 0) {
    const int64_t rows = t.micro_batch * t.grad_accum;
    if (rows % split != 0)
      throw UsageError(concat(where, ": parallel.pp_microbatches must divide the rows each replica trains per step, ",
                              "train.micro_batch x train.grad_accum = ", t.micro_batch, " x ", t.grad_accum, " = ", rows,
                              ", got ", split));
    t.micro_batch = rows / split;
    t.grad_accum = split;
  }
}

std::string to_yaml(const Config& cfg) {
  Config c = cfg;  // the table's accessors take a mutable Config
  YAML::Emitter out;
  out << YAML::BeginMap;
  const char* section = nullptr;
  for (const Field& f : kFields) {
    if (!section || std::strcmp(section, f.section) != 0) {
      if (section) out << YAML::EndMap;
      section = f.section;
      out << YAML::Key << section << YAML::Value << YAML::BeginMap;
    }
    if (std::strcmp(f.section, "model") == 0 && std::strcmp(f.key, "init_from") == 0)
      for (const auto& [key, text] : c.model.args) out << YAML::Key << key << YAML::Value << text;
    out << YAML::Key << f.key << YAML::Value;
    switch (f.kind) {
      case Kind::integer: out << member<int64_t>(f, c); break;
      case Kind::unsigned_integer: out << member<uint64_t>(f, c); break;
      case Kind::number: out << format_double(member<double>(f, c)); break;
      case Kind::boolean: out << member<bool>(f, c); break;
      case Kind::string: out << member<std::string>(f, c); break;
      case Kind::string_list: out << YAML::Flow << member<std::vector<std::string>>(f, c); break;
    }
  }
  out << YAML::EndMap << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace mpitrain
