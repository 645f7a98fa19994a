// Tests of the configuration: parsing, presets, overrides, every validation message,
// world-size resolution of the batch sizes and the to_yaml round trip.
#include "temp_dir.h"
#include "test_data.h"
#include "mpitrain/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "mpitrain/error.h"
#include "mpitrain/model_fields.h"

namespace mpitrain {
namespace {

// ---- helpers ------------------------------------------------------------------------------------

// The smallest file that validates: the defaults need training and validation shards.
const char* const kMinimal = "data:\n  train: train.h5\n  val: val.h5\n";

// The message of the UsageError that `f` throws, or a marker that makes every substring check
// fail with a readable diff.
std::string usage_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not a UsageError: ") + e.what() + ">";
  }
  return "<no error>";
}

std::string parse_error(const std::string& yaml, const std::vector<std::string>& sets = {}) {
  return usage_error([&] { parse_config(yaml, "run.yaml", sets); });
}

void expect_contains(const std::string& message, const std::vector<std::string>& pieces) {
  for (const std::string& piece : pieces)
    EXPECT_NE(message.find(piece), std::string::npos)
        << "message: " << message << "\nexpected to contain: " << piece;
}

// Field-by-field equality (Config has no operator==; `source` is deliberately not compared).
void expect_same(const Config& a, const Config& b) {
  EXPECT_EQ(a.model.preset, b.model.preset);
  EXPECT_EQ(a.model.n_layer, b.model.n_layer);
  EXPECT_EQ(a.model.n_head, b.model.n_head);
  EXPECT_EQ(a.model.n_embd, b.model.n_embd);
  EXPECT_EQ(a.model.seq_len, b.model.seq_len);
  EXPECT_EQ(a.model.vocab_size, b.model.vocab_size);
  EXPECT_EQ(a.model.dropout, b.model.dropout);
  EXPECT_EQ(a.model.fused_loss, b.model.fused_loss);
  EXPECT_EQ(a.model.fused_kernels, b.model.fused_kernels);
  EXPECT_EQ(a.model.init_from, b.model.init_from);
  EXPECT_EQ(a.model.arch, b.model.arch);
  EXPECT_EQ(a.model.args, b.model.args);
  EXPECT_EQ(a.model.family, b.model.family);
  EXPECT_EQ(a.model.n_kv_head, b.model.n_kv_head);
  EXPECT_EQ(a.model.intermediate_size, b.model.intermediate_size);
  EXPECT_EQ(a.model.rope_theta, b.model.rope_theta);
  EXPECT_EQ(a.model.rope_scaling, b.model.rope_scaling);
  EXPECT_EQ(a.model.rope_factor, b.model.rope_factor);
  EXPECT_EQ(a.model.rope_low_freq_factor, b.model.rope_low_freq_factor);
  EXPECT_EQ(a.model.rope_high_freq_factor, b.model.rope_high_freq_factor);
  EXPECT_EQ(a.model.rope_original_max_position, b.model.rope_original_max_position);
  EXPECT_EQ(a.model.max_position, b.model.max_position);
  EXPECT_EQ(a.model.qkv_bias, b.model.qkv_bias);
  EXPECT_EQ(a.model.tie_embeddings, b.model.tie_embeddings);
  EXPECT_EQ(a.model.attn_softcap, b.model.attn_softcap);
  EXPECT_EQ(a.model.final_softcap, b.model.final_softcap);
  EXPECT_EQ(a.model.query_pre_attn_scalar, b.model.query_pre_attn_scalar);
  EXPECT_EQ(a.model.rope_local_theta, b.model.rope_local_theta);
  EXPECT_EQ(a.model.head_dim, b.model.head_dim);
  EXPECT_EQ(a.model.qk_norm, b.model.qk_norm);
  EXPECT_EQ(window_of_config(a.model), window_of_config(b.model));
  EXPECT_EQ(a.model.norm_eps, b.model.norm_eps);
  EXPECT_EQ(a.data.train, b.data.train);
  EXPECT_EQ(a.data.val, b.data.val);
  EXPECT_EQ(a.data.seed, b.data.seed);
  EXPECT_EQ(a.data.shuffle, b.data.shuffle);
  EXPECT_EQ(a.train.micro_batch, b.train.micro_batch);
  EXPECT_EQ(a.train.grad_accum, b.train.grad_accum);
  EXPECT_EQ(a.train.global_batch, b.train.global_batch);
  EXPECT_EQ(a.train.steps, b.train.steps);
  EXPECT_EQ(a.train.seed, b.train.seed);
  EXPECT_EQ(a.train.threads, b.train.threads);
  EXPECT_EQ(a.train.out_dir, b.train.out_dir);
  EXPECT_EQ(a.optim.lr, b.optim.lr);
  EXPECT_EQ(a.optim.min_lr, b.optim.min_lr);
  EXPECT_EQ(a.optim.warmup_steps, b.optim.warmup_steps);
  EXPECT_EQ(a.optim.weight_decay, b.optim.weight_decay);
  EXPECT_EQ(a.optim.beta1, b.optim.beta1);
  EXPECT_EQ(a.optim.beta2, b.optim.beta2);
  EXPECT_EQ(a.optim.eps, b.optim.eps);
  EXPECT_EQ(a.optim.grad_clip, b.optim.grad_clip);
  EXPECT_EQ(a.eval.every, b.eval.every);
  EXPECT_EQ(a.eval.batches, b.eval.batches);
  EXPECT_EQ(a.log.every, b.log.every);
  EXPECT_EQ(a.log.level, b.log.level);
  EXPECT_EQ(a.log.metrics, b.log.metrics);
  EXPECT_EQ(a.checkpoint.dir, b.checkpoint.dir);
  EXPECT_EQ(a.checkpoint.every, b.checkpoint.every);
  EXPECT_EQ(a.checkpoint.keep, b.checkpoint.keep);
  EXPECT_EQ(a.checkpoint.resume, b.checkpoint.resume);
  EXPECT_EQ(a.comm.backend, b.comm.backend);
  EXPECT_EQ(a.comm.bucket_mb, b.comm.bucket_mb);
  EXPECT_EQ(a.sample.tokens, b.sample.tokens);
  EXPECT_EQ(a.sample.prompt, b.sample.prompt);
  EXPECT_EQ(a.sample.temperature, b.sample.temperature);
  EXPECT_EQ(a.sample.top_k, b.sample.top_k);
}

// ---- parsing ------------------------------------------------------------------------------------

TEST(Config, MinimalFileKeepsEveryDefault) {
  Config c = parse_config(kMinimal, "run.yaml");
  Config d;
  d.data.train = {"train.h5"};
  d.data.val = {"val.h5"};
  d.model.n_layer = 6, d.model.n_head = 6, d.model.n_embd = 192, d.model.seq_len = 256;
  d.model.family = "gpt2", d.model.arch = "gpt2", d.model.norm_eps = 1e-5;  // the tiny preset resolves these too
  expect_same(c, d);
  EXPECT_EQ(c.source, "run.yaml");
}

TEST(Config, EmptyDocumentIsAllDefaultsSoOnlyTheRequiredKeysAreMissing) {
  // Syntactically fine; validation then asks for the one key without a usable default.
  for (const char* empty : {"", "\n", "# nothing but a comment\n"})
    expect_contains(parse_error(empty), {"run.yaml: data.train must be a non-empty list"});
  Config c = parse_config("", "run.yaml", {"data.train=a.h5", "data.val=b.h5"});
  EXPECT_EQ(c.train.micro_batch, 8);
  EXPECT_EQ(c.optim.lr, 6e-4);
  EXPECT_EQ(c.model.preset, "tiny");
}

TEST(Config, EmptySectionIsAllowed) {
  Config c = parse_config(std::string(kMinimal) + "sample:\n  # tokens: 100\n", "run.yaml");
  EXPECT_EQ(c.sample.tokens, 0);
}

TEST(Config, DuplicateKeysAreErrors) {
  expect_contains(parse_error(std::string(kMinimal) + "data:\n  shuffle: false\n"),
                  {"run.yaml: duplicate key 'data'"});
  expect_contains(parse_error("data:\n  train: a.h5\n  train: b.h5\n"),
                  {"run.yaml: duplicate key 'data.train'"});
}

TEST(Config, ReadsScalarsListsAndBooleans) {
  Config c = parse_config(
      "data:\n  train: [a.h5, 'dir/b*.h5']\n  val: v.h5\n  shuffle: false\n"
      "  seed: 18446744073709551615\n"
      "train:\n  micro_batch: 4\n  out_dir: runs/x\n"
      "optim:\n  lr: 3e-4\n  min_lr: 0\n  eps: 1\n",
      "run.yaml");
  EXPECT_EQ(c.data.train, (std::vector<std::string>{"a.h5", "dir/b*.h5"}));
  EXPECT_EQ(c.data.val, std::vector<std::string>{"v.h5"});
  EXPECT_FALSE(c.data.shuffle);
  EXPECT_EQ(c.data.seed, 18446744073709551615ull);
  EXPECT_EQ(c.train.micro_batch, 4);
  EXPECT_EQ(c.train.out_dir, "runs/x");
  EXPECT_EQ(c.optim.lr, 3e-4);
  EXPECT_EQ(c.optim.min_lr, 0.0);
  EXPECT_EQ(c.optim.eps, 1.0);
}

// YAML 1.1 reads on/off as booleans; these keys take the words as written.
TEST(Config, FusedSwitchesTakeAutoOnOff) {
  EXPECT_EQ(parse_config(kMinimal, "run.yaml").model.fused_kernels, "auto");
  for (const char* v : {"auto", "on", "off"}) {
    Config c = parse_config(kMinimal, "run.yaml", {std::string("model.fused_kernels=") + v});
    EXPECT_EQ(c.model.fused_kernels, v);
  }
  // Both architectures have the fused block ops (llama: RMSNorm, SwiGLU, rotary).
  EXPECT_EQ(parse_config(kMinimal, "run.yaml", {"model.preset=llama-debug", "model.fused_kernels=on"})
                .model.fused_kernels,
            "on");
}

// model.init_from: a directory of .npy weights (read at start-up, not here); "" = random init.
TEST(Config, InitFromDefaultsToEmptyAndRoundTrips) {
  EXPECT_EQ(parse_config(kMinimal, "run.yaml").model.init_from, "");
  Config c = parse_config(kMinimal, "run.yaml", {"model.init_from=weights/gpt2"});
  EXPECT_EQ(c.model.init_from, "weights/gpt2");
  expect_same(c, parse_config(to_yaml(c), "resolved.yaml"));
  EXPECT_EQ(parse_error(std::string(kMinimal) + "model:\n  init_form: w\n"),
            "run.yaml: unknown key 'model.init_form' (did you mean 'model.init_from'?)");
}

// ---- strictness ---------------------------------------------------------------------------------

TEST(Config, UnknownKeySuggestsTheClosest) {
  EXPECT_EQ(parse_error(std::string(kMinimal) + "train:\n  micro_bach: 4\n"),
            "run.yaml: unknown key 'train.micro_bach' (did you mean 'train.micro_batch'?)");
  EXPECT_EQ(parse_error(std::string(kMinimal) + "trian:\n  steps: 4\n"),
            "run.yaml: unknown key 'trian' (did you mean 'train'?)");
  // A key in the wrong section is pointed at its own.
  EXPECT_EQ(parse_error(std::string(kMinimal) + "train:\n  lr: 0.1\n"),
            "run.yaml: unknown key 'train.lr' (did you mean 'optim.lr'?)");
  // Nothing close: no guess.
  EXPECT_EQ(parse_error(std::string(kMinimal) + "train:\n  completely_else: 1\n"),
            "run.yaml: unknown key 'train.completely_else'");
  EXPECT_EQ(parse_error("wandb:\n  project: x\n"), "run.yaml: unknown key 'wandb'");
}

TEST(Config, WrongTypesNameTheKeyAndTheValue) {
  struct Case {
    std::string yaml, message;
  };
  const std::vector<Case> cases = {
      {"train:\n  micro_batch: abc\n", "run.yaml: train.micro_batch must be an integer, got 'abc'"},
      {"train:\n  micro_batch: 8.0\n", "train.micro_batch must be an integer, got '8.0'"},
      {"train:\n  steps: 1e3\n", "train.steps must be an integer, got '1e3'"},
      {"train:\n  steps: 99999999999999999999\n",
       "train.steps must be an integer, got '99999999999999999999'"},
      {"train:\n  steps: [1]\n", "train.steps must be an integer, got [1]"},
      {"train:\n  steps:\n", "train.steps must be an integer, got null"},
      {"train:\n  seed: -1\n", "train.seed must be a non-negative integer, got '-1'"},
      {"data:\n  seed: 18446744073709551616\n", "data.seed must be a non-negative integer"},
      {"optim:\n  lr: fast\n", "run.yaml: optim.lr must be a number, got 'fast'"},
      {"optim:\n  lr: .inf\n", "optim.lr must be a number, got '.inf'"},
      {"data:\n  shuffle: maybe\n", "run.yaml: data.shuffle must be a boolean, got 'maybe'"},
      {"log:\n  level: {a: 1}\n", "run.yaml: log.level must be a string, got {a: 1}"},
      {"data:\n  train: {a: 1}\n", "run.yaml: data.train must be a list of strings, got {a: 1}"},
      {"data:\n  train: [a.h5, [b.h5]]\n",
       "data.train must be a list of strings, got [a.h5, [b.h5]]"},
      {"train: 5\n", "run.yaml: train must be a map of keys, got '5'"},
      {"model:\n  vocab_multiple: -64\n", "run.yaml: model.vocab_multiple must be in [0, 65536] (0 = automatic), got -64"},
      {"- train\n", "run.yaml: the top level must be a map of sections"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.yaml);
    expect_contains(parse_error(c.yaml), {c.message});
  }
}

TEST(Config, YamlSyntaxErrorGivesLineAndColumn) {
  expect_contains(parse_error("data:\n  train: [a.h5, b.h5\nval: x\n"),
                  {"run.yaml: YAML syntax error at line ", ", column ", "end of sequence flow"});
  expect_contains(parse_error("train:\n  steps: a: b\n"),
                  {"run.yaml: YAML syntax error at line 2, column 11: illegal map value"});
}

// ---- presets ------------------------------------------------------------------------------------

TEST(Config, TinyPresetLeavesVocabToTheData) {
  Config c = parse_config(kMinimal, "run.yaml");
  EXPECT_EQ(c.model.preset, "tiny");
  EXPECT_EQ(c.model.n_layer, 6);
  EXPECT_EQ(c.model.n_head, 6);
  EXPECT_EQ(c.model.n_embd, 192);
  EXPECT_EQ(c.model.seq_len, 256);
  EXPECT_EQ(c.model.vocab_size, 0);
}

TEST(Config, Gpt2PresetsHaveTheirDimensions) {
  struct Dims {
    const char* preset;
    int64_t n_layer, n_head, n_embd;
  };
  for (const Dims& d : {Dims{"gpt2", 12, 12, 768}, Dims{"gpt2-medium", 24, 16, 1024},
                        Dims{"gpt2-large", 36, 20, 1280}, Dims{"gpt2-xl", 48, 25, 1600}}) {
    SCOPED_TRACE(d.preset);
    Config c = parse_config(kMinimal, "run.yaml", {std::string("model.preset=") + d.preset});
    EXPECT_EQ(c.model.n_layer, d.n_layer);
    EXPECT_EQ(c.model.n_head, d.n_head);
    EXPECT_EQ(c.model.n_embd, d.n_embd);
    EXPECT_EQ(c.model.seq_len, 1024);
    EXPECT_EQ(c.model.vocab_size, 50257);
  }
}

TEST(Config, ExplicitFieldOverridesThePreset) {
  Config c = parse_config(std::string(kMinimal) + "model:\n  preset: gpt2\n  seq_len: 256\n",
                          "run.yaml");
  EXPECT_EQ(c.model.seq_len, 256);
  EXPECT_EQ(c.model.n_layer, 12);
  EXPECT_EQ(c.model.vocab_size, 50257);
}

TEST(Config, CustomPresetNeedsEveryDimension) {
  const std::string custom = std::string(kMinimal) + "model:\n  preset: custom\n";
  EXPECT_EQ(parse_error(custom + "  n_layer: 2\n  n_head: 2\n  n_embd: 64\n"),
            "run.yaml: model.seq_len must be set (> 0) when model.preset is 'custom', got 0");
  expect_contains(parse_error(custom), {"run.yaml: model.n_layer must be set"});
  Config c = parse_config(custom + "  n_layer: 2\n  n_head: 2\n  n_embd: 64\n  seq_len: 32\n",
                          "run.yaml");
  EXPECT_EQ(c.model.n_layer, 2);
  EXPECT_EQ(c.model.seq_len, 32);
  EXPECT_EQ(c.model.vocab_size, 0);
}

// Every preset names its family (a row of families()); a config that names none takes the family
// its parts make, as configs did before model.family; a named family fixes its block and flags.
TEST(Config, FamiliesAreNamedRowsAndFixTheirFlags) {
  const std::pair<const char*, const char*> presets[] = {
      {"tiny", "gpt2"},          {"gpt2", "gpt2"},         {"gpt2-xl", "gpt2"},          {"llama-debug", "llama"},
      {"llama3.2-1b", "llama"},  {"llama3.1-8b", "llama"}, {"qwen2.5-0.5b", "qwen2"},    {"qwen3-0.6b", "qwen3"},
      {"qwen3-8b", "qwen3"},     {"mistral-7b-v0.1", "mistral"}, {"gemma2-2b", "gemma2"},
      {"gemma3-1b", "gemma3"},   {"qwen3-30b-a3b", "qwen3_moe"}, {"mixtral-8x7b", "mixtral"},
      {"olmoe-1b-7b", "olmoe"}};
  for (const auto& [preset, family] : presets) {
    const Config c = parse_config(kMinimal, "run.yaml", {concat("model.preset=", preset)});
    EXPECT_EQ(c.model.family, family) << preset;
    EXPECT_EQ(c.model.arch, find_family(family)->block) << preset;
    EXPECT_EQ(dims_of_config(c.model).family, family) << preset;
    expect_same(c, parse_config(to_yaml(c), "resolved.yaml"));
  }
  // model.arch alone (configs written before model.family): the parts say the family.
  const std::vector<std::string> custom = {"model.preset=custom", "model.n_layer=2", "model.n_head=4",
                                           "model.n_embd=32", "model.seq_len=16"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> all = custom;
    all.insert(all.end(), more.begin(), more.end());
    return parse_config(kMinimal, "run.yaml", all).model;
  };
  EXPECT_EQ(with({}).family, "gpt2");
  EXPECT_EQ(with({"model.arch=llama", "model.intermediate_size=64"}).family, "llama");
  EXPECT_EQ(with({"model.arch=llama", "model.intermediate_size=64", "model.qkv_bias=true"}).family, "qwen2");
  EXPECT_EQ(with({"model.arch=llama", "model.intermediate_size=64", "model.qk_norm=true"}).family, "qwen3");
  EXPECT_EQ(with({"model.arch=llama", "model.intermediate_size=64", "model.sliding_window=16"}).family, "mistral");
  // A named family gives the block and its flags.
  const ModelConfig qwen3 = with({"model.family=qwen3", "model.intermediate_size=64"});
  EXPECT_EQ(qwen3.arch, "llama");
  EXPECT_EQ(qwen3.qk_norm, "true");
  EXPECT_EQ(qwen3.qkv_bias, "false");
  const ModelConfig qwen2 = with({"model.family=qwen2", "model.intermediate_size=64"});
  EXPECT_EQ(qwen2.qkv_bias, "true");
  EXPECT_EQ(qwen2.qk_norm, "false");
  // A family of the preset's block may be named over the preset: the shape stays the preset's.
  const Config over = parse_config(kMinimal, "run.yaml", {"model.preset=llama-debug", "model.family=mistral",
                                                          "model.sliding_window=256"});
  EXPECT_EQ(over.model.family, "mistral");
  EXPECT_EQ(over.model.n_embd, 256);
  EXPECT_EQ(window_of_config(over.model), 256);
  // Gemma 2 is named (no flag makes it), its caps and window taken or given; its query scale is
  // the head size unless set.
  const ModelConfig gemma = with({"model.family=gemma2", "model.intermediate_size=64", "model.sliding_window=8",
                                  "model.attn_softcap=50", "model.final_softcap=30"});
  EXPECT_EQ(gemma.arch, "llama");
  EXPECT_EQ(gemma.family, "gemma2");
  EXPECT_EQ(window_of_config(gemma), 8);  // shorter than seq_len 16: Gemma's windows cut
  EXPECT_EQ(gemma.query_pre_attn_scalar, 8.0);  // 32 / 4 heads
  EXPECT_EQ(dims_of_config(gemma).attn_softcap, 50.0);
  const Config gemma_preset = parse_config(kMinimal, "run.yaml", {"model.preset=gemma2-2b", "model.final_softcap=20"});
  EXPECT_EQ(gemma_preset.model.family, "gemma2");
  EXPECT_EQ(gemma_preset.model.final_softcap, 20.0);
  EXPECT_EQ(gemma_preset.model.attn_softcap, 50.0);
  // Gemma 3: q/k norms fixed on, the local rotary base 10000 unless set, linear rope scaling.
  const ModelConfig gemma3 = with({"model.family=gemma3", "model.intermediate_size=64", "model.rope_scaling=linear",
                                   "model.rope_factor=8"});
  EXPECT_EQ(gemma3.qk_norm, "true");
  EXPECT_EQ(gemma3.rope_local_theta, 10000.0);
  EXPECT_EQ(gemma3.rope_factor, 8.0);
  const GPTDims g3 = dims_of_config(gemma3);
  EXPECT_EQ(g3.local_layers(), "5 of every 6 layers");
  EXPECT_TRUE(g3.local_layer(0) && g3.local_layer(4) && !g3.local_layer(5) && g3.local_layer(6) && !g3.local_layer(11));
  std::set<std::string> classes;
  for (const Family& f : families()) {  // each family is read from and written as its own class
    EXPECT_EQ(family_by_model_type(f.hf_model_type), &f);
    EXPECT_TRUE(classes.insert(f.hf_architecture).second) << f.hf_architecture;
  }
}

// A field kept by key (model_fields.h's generic rows: the experts', the window) is written once: its row, the
// ModelArgs member, the code that uses it. Its name, as a word, is in at most 3 files of src/ and
// include/ (the YAML reader, presets, validation, config.json in and out and checkpoints read the
// row).
TEST(Config, AGenericFieldIsNamedInAtMostThreeSourceFiles) {
  const std::filesystem::path root = std::filesystem::path(kTestDataDir) / ".." / "..";
  std::vector<std::pair<std::string, std::string>> files;  // path, text
  for (const char* dir : {"src", "include"})
    for (const auto& e : std::filesystem::recursive_directory_iterator(root / dir))
      if (e.is_regular_file()) {
        std::ifstream in(e.path());
        files.emplace_back(e.path().string(), std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
      }
  ASSERT_GT(files.size(), 50u);
  auto word_at = [](const std::string& text, size_t at, size_t n) {
    auto part = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
    return (at == 0 || !part(text[at - 1])) && (at + n == text.size() || !part(text[at + n]));
  };
  int generic = 0;
  for (const ModelField& f : model_fields()) {
    if (!f.generic) continue;
    ++generic;
    std::vector<std::string> in;
    for (const auto& [path, text] : files)
      for (size_t at = text.find(f.key); at != std::string::npos; at = text.find(f.key, at + 1))
        if (word_at(text, at, std::string(f.key).size())) {
          in.push_back(path);
          break;
        }
    std::string names;
    for (const std::string& p : in) names += " " + p;
    EXPECT_LE(in.size(), 3u) << f.key << ":" << names;
  }
  EXPECT_GE(generic, 6);
}

// docs/config.md's model table is checked against the tables: every model.* key (to_yaml writes
// them all), every architecture field, every family and every preset is in it.
TEST(Config, DocsNameEveryModelKeyFamilyAndPreset) {
  std::ifstream in(std::string(kTestDataDir) + "/../../docs/config.md");
  ASSERT_TRUE(in) << "docs/config.md";
  const std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t begin = doc.find("## model"), end = doc.find("\n## ", begin + 1);
  ASSERT_NE(begin, std::string::npos);
  const std::string model = doc.substr(begin, end - begin);
  const Config c = parse_config(kMinimal, "run.yaml");
  const std::string yaml = to_yaml(c);
  const size_t m0 = yaml.find("model:\n"), m1 = yaml.find("\n", yaml.find("\n", m0) + 1);
  ASSERT_NE(m0, std::string::npos);
  std::vector<std::string> keys;
  for (size_t at = yaml.find("\n", m0) + 1; at < yaml.size() && yaml.compare(at, 2, "  ") == 0;
       at = yaml.find("\n", at) + 1)
    keys.push_back(yaml.substr(at + 2, yaml.find(':', at) - at - 2));
  EXPECT_GT(keys.size(), 20u) << yaml.substr(m0, m1 - m0);
  for (const ModelField& f : model_fields()) keys.push_back(f.key);
  for (const std::string& k : keys) EXPECT_NE(model.find("`" + k + "`"), std::string::npos) << "model." << k;
  for (const Family& f : families()) EXPECT_NE(model.find("`" + std::string(f.name) + "`"), std::string::npos) << f.name;
  for (const char* preset : {"tiny", "gpt2-medium", "llama-debug", "llama3.2-3b", "qwen2.5-0.5b", "qwen3-1.7b",
                             "qwen3-4b", "mistral-7b-v0.1", "gemma2-2b", "gemma3-1b"})
    EXPECT_NE(model.find(concat("`", preset, "`")), std::string::npos) << preset;
}

TEST(Config, LlamaPresetsHaveTheirPublishedShapes) {
  Config c = parse_config(kMinimal, "run.yaml", {"model.preset=llama3.2-1b"});
  const ModelConfig& m = c.model;
  EXPECT_EQ(m.arch, "llama");
  EXPECT_EQ(m.n_layer, 16);
  EXPECT_EQ(m.n_head, 32);
  EXPECT_EQ(m.n_kv_head, 8);
  EXPECT_EQ(m.n_embd, 2048);
  EXPECT_EQ(m.intermediate_size, 8192);
  EXPECT_EQ(m.vocab_size, 128256);
  EXPECT_EQ(m.max_position, 131072);
  EXPECT_EQ(m.rope_theta, 500000.0);
  EXPECT_EQ(m.rope_scaling, "llama3");
  EXPECT_EQ(m.rope_factor, 32.0);
  EXPECT_EQ(m.rope_original_max_position, 8192);
  EXPECT_EQ(m.tie_embeddings, "true");
  EXPECT_EQ(m.qkv_bias, "false");
  Config big = parse_config(kMinimal, "run.yaml", {"model.preset=llama3.1-8b"});
  EXPECT_EQ(big.model.intermediate_size, 14336);
  EXPECT_EQ(big.model.rope_factor, 8.0);
  EXPECT_EQ(big.model.tie_embeddings, "false");
  Config qwen = parse_config(kMinimal, "run.yaml", {"model.preset=qwen2.5-0.5b"});
  EXPECT_EQ(qwen.model.n_head, 14);
  EXPECT_EQ(qwen.model.n_kv_head, 2);
  EXPECT_EQ(qwen.model.qkv_bias, "true");
  EXPECT_EQ(qwen.model.norm_eps, 1e-6);
  EXPECT_EQ(qwen.model.rope_scaling, "none");
  EXPECT_EQ(qwen.model.qk_norm, "false");
  EXPECT_EQ(qwen.model.head_dim, 0);  // n_embd / n_head
  // Qwen3: 16 heads of 128 at width 1024, q/k norms, no biases, tied
  Config qwen3 = parse_config(kMinimal, "run.yaml", {"model.preset=qwen3-0.6b"});
  EXPECT_EQ(qwen3.model.n_layer, 28);
  EXPECT_EQ(qwen3.model.n_head, 16);
  EXPECT_EQ(qwen3.model.n_kv_head, 8);
  EXPECT_EQ(qwen3.model.n_embd, 1024);
  EXPECT_EQ(qwen3.model.head_dim, 128);
  EXPECT_EQ(qwen3.model.intermediate_size, 3072);
  EXPECT_EQ(qwen3.model.vocab_size, 151936);
  EXPECT_EQ(qwen3.model.max_position, 40960);
  EXPECT_EQ(qwen3.model.qk_norm, "true");
  EXPECT_EQ(qwen3.model.qkv_bias, "false");
  EXPECT_EQ(qwen3.model.tie_embeddings, "true");
  EXPECT_EQ(qwen3.model.rope_theta, 1000000.0);
  EXPECT_EQ(parse_config(kMinimal, "run.yaml", {"model.preset=qwen3-1.7b"}).model.intermediate_size, 6144);
  Config qwen3_4b = parse_config(kMinimal, "run.yaml", {"model.preset=qwen3-4b"});
  EXPECT_EQ(qwen3_4b.model.n_layer, 36);
  EXPECT_EQ(qwen3_4b.model.n_head, 32);
  EXPECT_EQ(qwen3_4b.model.n_embd, 2560);
  EXPECT_EQ(qwen3_4b.model.intermediate_size, 9728);
  EXPECT_EQ(qwen3_4b.model.tie_embeddings, "true");
  Config qwen3_8b = parse_config(kMinimal, "run.yaml", {"model.preset=qwen3-8b"});
  EXPECT_EQ(qwen3_8b.model.n_embd, 4096);
  EXPECT_EQ(qwen3_8b.model.intermediate_size, 12288);
  EXPECT_EQ(qwen3_8b.model.head_dim, 128);
  EXPECT_EQ(qwen3_8b.model.tie_embeddings, "false");
  EXPECT_EQ(window_of_config(qwen3.model), 0);
  expect_same(qwen3, parse_config(to_yaml(qwen3), "resolved.yaml"));
  Config debug = parse_config(kMinimal, "run.yaml", {"model.preset=llama-debug"});
  EXPECT_EQ(debug.model.n_embd, 256);
  EXPECT_EQ(debug.model.n_kv_head, 4);
  EXPECT_EQ(debug.model.vocab_size, 2048);
  // gpt2 keeps its fixed parts and no Llama key
  Config gpt = parse_config(kMinimal, "run.yaml");
  EXPECT_EQ(gpt.model.arch, "gpt2");
  EXPECT_EQ(gpt.model.n_kv_head, 0);
  EXPECT_EQ(gpt.model.norm_eps, 1e-5);
  expect_same(c, parse_config(to_yaml(c), "resolved.yaml"));
  expect_same(qwen, parse_config(to_yaml(qwen), "resolved.yaml"));
}

TEST(Config, HuggingFaceConfigGivesTheShapeAndDisagreementsNameBoth) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  std::ofstream(dir + "/config.json")
      << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
             "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 160,
             "vocab_size": 300, "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192},
             "tie_word_embeddings": false, "hidden_act": "silu"})";
  const std::string yaml = concat(kMinimal, "model: {init_from: 'hf:", dir, "'}\n");
  std::ofstream(dir + "/run.yaml") << yaml;
  Config c = load_config(dir + "/run.yaml");
  EXPECT_EQ(c.model.arch, "llama");
  EXPECT_EQ(c.model.preset, "custom");
  EXPECT_EQ(c.model.n_layer, 3);
  EXPECT_EQ(c.model.n_kv_head, 2);
  EXPECT_EQ(c.model.intermediate_size, 160);
  // vocab_size: the weights' classes, padded as automatic padding pads the data's (a padded
  // mpitrain export comes back with its padding); an explicit model.vocab_size must equal it.
  EXPECT_EQ(c.model.vocab_size, 0);
  EXPECT_EQ(c.model.init_vocab, 300);
  EXPECT_EQ(c.model.init_vocab_source, dir + "/config.json's vocab_size");
  EXPECT_EQ(load_config(dir + "/run.yaml", {"model.vocab_size=300"}).model.vocab_size, 300);
  expect_contains(usage_error([&] { load_config(dir + "/run.yaml", {"model.vocab_size=320"}); }),
                  {"run.yaml: model.vocab_size: 320 disagrees with ", "/config.json's 300"});
  EXPECT_EQ(c.model.seq_len, 2048);  // min(max_position_embeddings, 2048)
  EXPECT_EQ(c.model.max_position, 4096);
  EXPECT_EQ(c.model.rope_scaling, "llama3");
  EXPECT_EQ(c.model.rope_factor, 8.0);
  EXPECT_EQ(c.model.tie_embeddings, "false");
  // The resolved config parses again without the directory (a checkpoint's stored config).
  expect_same(c, parse_config(to_yaml(c), "resolved.yaml"));
  expect_contains(usage_error([&] { load_config(dir + "/run.yaml", {"model.n_kv_head=4"}); }),
                  {"run.yaml: model.n_kv_head: 4 disagrees with ", "/config.json's 2"});
  // Qwen3: head_dim wider than hidden_size / num_attention_heads, q/k norms
  const std::string qwen3 = R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "intermediate_size": 96, "vocab_size": 300, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
             "rope_theta": 1000000, "rope_scaling": null, "tie_word_embeddings": true, "hidden_act": "silu",
             "attention_bias": false, "use_sliding_window": false, "sliding_window": null})";
  std::ofstream(dir + "/config.json") << qwen3;
  Config q = load_config(dir + "/run.yaml");
  EXPECT_EQ(q.model.head_dim, 32);
  EXPECT_EQ(q.model.qk_norm, "true");
  EXPECT_EQ(q.model.qkv_bias, "false");
  EXPECT_EQ(q.model.n_embd, 64);
  expect_same(q, parse_config(to_yaml(q), "resolved.yaml"));
  expect_contains(usage_error([&] { load_config(dir + "/run.yaml", {"model.head_dim=16"}); }),
                  {"run.yaml: model.head_dim: 16 disagrees with ", "/config.json's 32"});
  expect_contains(usage_error([&] { load_config(dir + "/run.yaml", {"model.qk_norm=false"}); }),
                  {"run.yaml: model.qk_norm: false disagrees with ", "/config.json's true"});
  std::ofstream(dir + "/config.json") << std::string(qwen3).replace(qwen3.find("\"attention_bias\": false"), 23,
                                                                    "\"attention_bias\": true ");
  expect_contains(usage_error([&] { load_config(dir + "/run.yaml"); }),
                  {"/config.json: attention_bias: true: mpitrain's qwen3 has no such biases"});
  std::ofstream(dir + "/config.json") << std::string(qwen3).replace(qwen3.find("\"attention_bias\": false"), 23,
                                                                    "\"mlp_bias\": true, \"a\": 0");
  expect_contains(usage_error([&] { load_config(dir + "/run.yaml"); }), {"/config.json: mlp_bias: true"});
  std::ofstream(dir + "/config.json") << std::string(qwen3).replace(qwen3.find("\"head_dim\": 32"), 14,
                                                                    "\"head_dim\": 33");
  expect_contains(usage_error([&] { load_config(dir + "/run.yaml"); }), {"/config.json: head_dim: 33: rotary needs an even"});
  // Without head_dim a qwen3 config.json means transformers' Qwen3Config default, 128 (not
  // hidden_size / num_attention_heads = 16: its weights then failed on a shape, naming other keys).
  std::ofstream(dir + "/config.json") << std::string(qwen3).replace(qwen3.find("\"head_dim\": 32,"), 15, "");
  EXPECT_EQ(load_config(dir + "/run.yaml").model.head_dim, 128);
  // config.json is read only when it is a small regular file: not /dev/zero (read until memory ran
  // out, 2.2 GB per rank, before the JSON error), not a FIFO, not 2 MiB of JSON.
  std::remove((dir + "/config.json").c_str());
  ASSERT_EQ(symlink("/dev/zero", (dir + "/config.json").c_str()), 0);
  expect_contains(usage_error([&] { load_config(dir + "/run.yaml"); }),
                  {"run.yaml: model.init_from: ", "/config.json: not a regular file"});
  std::remove((dir + "/config.json").c_str());
  std::ofstream(dir + "/config.json") << std::string(2 << 20, ' ') << "{}";
  expect_contains(usage_error([&] { load_config(dir + "/run.yaml"); }),
                  {"/config.json: 2097154 bytes, larger than the 1 MiB a config.json may have"});
  std::ofstream(dir + "/config.json") << R"({"model_type": "deepseek_v3", "hidden_size": 64})";
  expect_contains(usage_error([&] { load_config(dir + "/run.yaml"); }),
                  {"run.yaml: model.init_from: ", "/config.json: model_type: 'deepseek_v3'"});
  std::system(("rm -rf " + dir).c_str());
}

// Qwen3 0.6B's published config.json (the keys transformers 4.51 writes) gives the preset's shape.
TEST(Config, Qwen3ConfigJsonGivesThePresetsShape) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  std::ofstream(dir + "/config.json")
      << R"({"architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
             "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
             "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
             "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
             "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
             "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true,
             "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true,
             "use_sliding_window": false, "vocab_size": 151936})";
  std::ofstream(dir + "/run.yaml") << concat(kMinimal, "model: {init_from: 'hf:", dir, "'}\n");
  Config from_file = load_config(dir + "/run.yaml");
  Config preset = parse_config(kMinimal, "run.yaml", {"model.preset=qwen3-0.6b"});
  from_file.model.preset = preset.model.preset;
  from_file.model.init_from = preset.model.init_from;
  // config.json's vocab_size is the weights' classes, which automatic padding pads (none on the CPU).
  EXPECT_EQ(from_file.model.vocab_size, 0);
  from_file.model.vocab_size = from_file.model.init_vocab;
  expect_same(from_file, preset);
  std::system(("rm -rf " + dir).c_str());
}

// Gemma 2 2B's and Gemma 3 1B's published config.json give the presets' shapes (their caps,
// windows, query scale, local rotary base); a layer_types that is not the family's pattern, or
// another sliding_window_pattern, is refused naming the key.
TEST(Config, GemmaConfigJsonGivesThePresetsShape) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  const std::string gemma2 = R"({"architectures": ["Gemma2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
      "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
      "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
      "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
      "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
      "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32", "transformers_version": "4.42.4",
      "use_cache": true, "vocab_size": 256000})";
  const std::string gemma3 = R"({"architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "attn_logit_softcapping": null, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
      "final_logit_softcapping": null, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
      "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
      "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
      "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": null,
      "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
      "transformers_version": "4.50.0.dev0", "use_cache": true, "vocab_size": 262144})";
  std::ofstream(dir + "/run.yaml") << concat(kMinimal, "model: {init_from: 'hf:", dir, "'}\n");
  for (const auto& [json, preset_name] : {std::pair{gemma2, "gemma2-2b"}, std::pair{gemma3, "gemma3-1b"}}) {
    std::ofstream(dir + "/config.json") << json;
    Config from_file = load_config(dir + "/run.yaml");
    Config preset = parse_config(kMinimal, "run.yaml", {concat("model.preset=", preset_name)});
    from_file.model.preset = preset.model.preset;
    from_file.model.init_from = preset.model.init_from;
    EXPECT_EQ(from_file.model.vocab_size, 0);
    from_file.model.vocab_size = from_file.model.init_vocab;
    expect_same(from_file, preset);
  }
  std::string other = gemma3;
  other.replace(other.find("\"sliding_window_pattern\": 6"), 27, "\"sliding_window_pattern\": 4");
  std::ofstream(dir + "/config.json") << other;
  expect_contains(usage_error([&] { load_config(dir + "/run.yaml"); }),
                  {"/config.json: sliding_window_pattern: 4: mpitrain's gemma3_text has 6"});
  other = gemma3;
  other.replace(other.find("\"sliding_window_pattern\": 6"), 27,
                "\"layer_types\": [\"sliding_attention\", \"full_attention\"]");
  std::ofstream(dir + "/config.json") << other;
  expect_contains(usage_error([&] { load_config(dir + "/run.yaml"); }),
                  {"/config.json: layer_types[1]: \"full_attention\": mpitrain's gemma3_text has a global layer every 6"});
  std::system(("rm -rf " + dir).c_str());
}

// transformers 5's form of Gemma 3's config.json (rope_parameters per layer type, no rope_theta or
// rope_local_base_freq at the top) gives what the older form gives, the linear scaling of the
// global layers included; keys absent from config.json take the transformers class's defaults
// (Gemma 2's caps 50 and 30, Gemma 3's rope_theta 1e6, LlamaConfig's shape), null means none; what
// mpitrain cannot run as written is refused naming the key.
TEST(Config, HfConfigTransformers5FormsAndClassDefaults) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  std::ofstream(dir + "/run.yaml") << concat(kMinimal, "model: {init_from: 'hf:", dir, "'}\n");
  auto load = [&](const std::string& json) {
    std::ofstream(dir + "/config.json") << json;
    return load_config(dir + "/run.yaml").model;
  };
  auto refused = [&](const std::string& json) {
    std::ofstream(dir + "/config.json") << json;
    return usage_error([&] { load_config(dir + "/run.yaml"); });
  };
  const std::string gemma3_shape = R"("model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912,
      "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "head_dim": 256,
      "max_position_embeddings": 32768, "sliding_window": 512, "vocab_size": 262144, "tie_word_embeddings": true)";
  const ModelConfig v4 = load(concat("{", gemma3_shape, R"(, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}})"));
  const std::string nested = concat("{", gemma3_shape, R"(, "rope_parameters": {
      "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}})");
  const ModelConfig v5 = load(nested);
  EXPECT_EQ(v4.rope_theta, 1e6);
  EXPECT_EQ(v4.rope_scaling, "linear");
  EXPECT_EQ(v4.rope_factor, 8.0);
  EXPECT_EQ(v4.rope_local_theta, 1e4);
  EXPECT_EQ(v5.rope_theta, v4.rope_theta);
  EXPECT_EQ(v5.rope_scaling, v4.rope_scaling);
  EXPECT_EQ(v5.rope_factor, v4.rope_factor);
  EXPECT_EQ(v5.rope_local_theta, v4.rope_local_theta);
  // A local base that differs is read as such (not a default), and the nested form without
  // scaling is none.
  std::string other = nested;
  other.replace(other.find("\"rope_theta\": 10000.0"), 21, "\"rope_theta\": 20000.0");
  other.replace(other.find("\"rope_type\": \"linear\", \"factor\": 8.0, "), 38, "");
  EXPECT_EQ(load(other).rope_local_theta, 2e4);
  EXPECT_EQ(load(other).rope_scaling, "none");
  // Refused by name: scaling on the local layers; a layer type mpitrain does not know; the older
  // key disagreeing with the nested one; a Gemma 3 score cap.
  other = nested;
  other.replace(other.find("\"rope_type\": \"default\""), 22, "\"rope_type\": \"linear\", \"factor\": 2.0");
  expect_contains(refused(other), {"/config.json: rope_parameters.sliding_attention.rope_type: 'linear': mpitrain's "
                                   "gemma3 scales the global layers' rotary only"});
  other = nested;
  other.replace(other.find("\"sliding_attention\""), 19, "\"chunked_attention\"");
  expect_contains(refused(other), {"/config.json: rope_parameters.chunked_attention: "});
  expect_contains(refused(concat(nested.substr(0, nested.size() - 1), ", \"rope_local_base_freq\": 100.0}")),
                  {"/config.json: rope_local_base_freq: 100 disagrees with rope_parameters.sliding_attention.rope_theta 10000"});
  expect_contains(refused(concat(nested.substr(0, nested.size() - 1), ", \"attn_logit_softcapping\": 50.0}")),
                  {"/config.json: attn_logit_softcapping: 50.0: transformers' Gemma 3 attention applies no score cap"});
  // Another family with one rotary for every layer: both layer types the same, or refused.
  const std::string llama_nested = R"({"model_type": "llama", "rope_parameters": {
      "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
      "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}})";
  EXPECT_EQ(load(llama_nested).rope_theta, 5e5);
  other = llama_nested;
  other.replace(other.rfind("500000.0"), 8, "10000.0");
  expect_contains(refused(other), {"/config.json: rope_parameters.sliding_attention: ",
                                   "differs from full_attention's", "mpitrain's llama has one rotary for every layer"});

  // Absent keys: the classes' defaults. Gemma 3 without rope_theta: 1e6 (not 10000); Gemma 2 without
  // its caps: 50 and 30 (null: none); a window of 4096 where the class has one.
  const ModelConfig g3 = load(concat("{", gemma3_shape, "}"));
  EXPECT_EQ(g3.rope_theta, 1e6);
  EXPECT_EQ(g3.rope_local_theta, 1e4);
  EXPECT_EQ(g3.attn_softcap, 0.0);
  // Nothing but Gemma 2's model_type: Gemma2Config's defaults are Gemma 2 2B, every field of the
  // preset (caps 50 and 30, window 4096, query scale 256, head_dim 256, 8192 positions, tied).
  std::ofstream(dir + "/config.json") << R"({"model_type": "gemma2"})";
  Config g2 = load_config(dir + "/run.yaml");
  const Config g2_preset = parse_config(kMinimal, "run.yaml", {"model.preset=gemma2-2b"});
  g2.model.preset = g2_preset.model.preset;
  g2.model.init_from = g2_preset.model.init_from;
  EXPECT_EQ(g2.model.vocab_size, 0);
  g2.model.vocab_size = g2.model.init_vocab;
  expect_same(g2, g2_preset);
  const ModelConfig g2_none = load(
      R"({"model_type": "gemma2", "attn_logit_softcapping": null, "final_logit_softcapping": null, "sliding_window": null})");
  EXPECT_EQ(g2_none.attn_softcap, 0.0);
  EXPECT_EQ(g2_none.final_softcap, 0.0);
  EXPECT_EQ(window_of_config(g2_none), 0);
  EXPECT_EQ(window_of_config(load(R"({"model_type": "mistral"})")), 4096);
  // Nothing but the model_type: LlamaConfig's defaults (the 7B shape of Llama 2), kv heads = heads.
  const ModelConfig llama = load(R"({"model_type": "llama"})");
  EXPECT_EQ(llama.n_layer, 32);
  EXPECT_EQ(llama.n_embd, 4096);
  EXPECT_EQ(llama.n_head, 32);
  EXPECT_EQ(llama.n_kv_head, 32);
  EXPECT_EQ(llama.intermediate_size, 11008);
  EXPECT_EQ(llama.init_vocab, 32000);
  EXPECT_EQ(llama.max_position, 2048);
  EXPECT_EQ(llama.rope_theta, 1e4);
  EXPECT_EQ(llama.tie_embeddings, "false");
  EXPECT_EQ(load(R"({"model_type": "qwen3"})").head_dim, 128);
  EXPECT_EQ(load(R"({"model_type": "qwen3"})").n_kv_head, 32);
  // Qwen3-MoE: the experts' keys read through their rows (model_fields.h's generic rows), absent
  // ones Qwen3MoeConfig's defaults; another family's config.json with them, or a list of dense
  // layers of its own, refused by key.
  const ModelConfig moe = load(R"({"model_type": "qwen3_moe"})");
  const std::map<std::string, std::string> moe_defaults = {
      {"num_experts", "128"},   {"num_experts_per_tok", "8"},  {"moe_intermediate_size", "768"},
      {"norm_topk_prob", "false"}, {"decoder_sparse_step", "1"}, {"router_aux_loss_coef", "0.001"}};
  EXPECT_EQ(moe.args, moe_defaults);
  EXPECT_EQ(moe.family, "qwen3_moe");
  EXPECT_EQ(moe.n_kv_head, 4);
  const ModelConfig moe16 = load(R"({"model_type": "qwen3_moe", "num_experts": 16, "norm_topk_prob": true})");
  EXPECT_EQ(moe16.args.at("num_experts"), "16");
  EXPECT_EQ(moe16.args.at("norm_topk_prob"), "true");
  expect_contains(refused(R"({"model_type": "llama", "num_experts": 8})"),
                  {"/config.json: num_experts: 8: mpitrain's llama has no such field (qwen3_moe|mixtral|olmoe have)"});
  expect_contains(refused(R"({"model_type": "qwen3_moe", "num_experts": 0})"),
                  {"/config.json: num_experts: must be an integer in [1, 65536], got 0"});
  expect_contains(refused(R"({"model_type": "qwen3_moe", "mlp_only_layers": [0, 2]})"),
                  {"/config.json: mlp_only_layers: [0,2]: not supported (the dense layers are those the sparse-layer step leaves)"});
}

// Mistral 7B v0.1's published config.json gives the preset's shape, its 4096-token window
// included; a training context longer than the window is refused by name (the window would cut).
// Qwen's configs name a sliding_window too, unused without use_sliding_window: it is not read.
TEST(Config, MistralConfigJsonGivesThePresetsShapeAndItsWindowBoundsTheContext) {
  const TempDir tmp;
  const std::string dir = tmp.path;
  const std::string mistral = R"({"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
             "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
             "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
             "sliding_window": 4096, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
             "transformers_version": "4.34.0.dev0", "use_cache": true, "vocab_size": 32000})";
  std::ofstream(dir + "/config.json") << mistral;
  std::ofstream(dir + "/run.yaml") << concat(kMinimal, "model: {init_from: 'hf:", dir, "'}\n");
  Config from_file = load_config(dir + "/run.yaml");
  EXPECT_EQ(window_of_config(from_file.model), 4096);
  EXPECT_EQ(from_file.model.seq_len, 2048);
  Config preset = parse_config(kMinimal, "run.yaml", {"model.preset=mistral-7b-v0.1"});
  from_file.model.preset = preset.model.preset;
  from_file.model.init_from = preset.model.init_from;
  // config.json's vocab_size is the weights' classes, which automatic padding pads (none on the CPU).
  EXPECT_EQ(from_file.model.vocab_size, 0);
  from_file.model.vocab_size = from_file.model.init_vocab;
  expect_same(from_file, preset);
  expect_same(preset, parse_config(to_yaml(preset), "resolved.yaml"));
  EXPECT_EQ(load_config(dir + "/run.yaml", {"model.seq_len=4096"}).model.seq_len, 4096);  // the whole window
  // A context longer than the window: the window cuts it, as Mistral 7B v0.1 runs beyond 4096 tokens.
  const Config longer = load_config(dir + "/run.yaml", {"model.seq_len=8192"});
  EXPECT_EQ(longer.model.seq_len, 8192);
  EXPECT_EQ(window_of_config(longer.model), 4096);
  expect_contains(usage_error([&] { load_config(dir + "/run.yaml", {"model.sliding_window=8192"}); }),
                  {"run.yaml: model.sliding_window: 8192 disagrees with ", "/config.json's 4096"});
  // Mistral NeMo's shape: no window, heads of 128 at width 5120 (32 x 128 = 4096)
  std::string nemo = mistral;
  nemo.replace(nemo.find("\"sliding_window\": 4096"), 22, "\"sliding_window\": null, \"head_dim\": 128");
  nemo.replace(nemo.find("\"hidden_size\": 4096"), 19, "\"hidden_size\": 5120");
  std::ofstream(dir + "/config.json") << nemo;
  Config n = load_config(dir + "/run.yaml", {"model.seq_len=8192"});
  EXPECT_EQ(window_of_config(n.model), 0);
  EXPECT_EQ(n.model.head_dim, 128);
  EXPECT_EQ(n.model.n_embd, 5120);
  // Qwen2.5's config: sliding_window 32768 with use_sliding_window false, so no window
  std::ofstream(dir + "/config.json")
      << R"({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
             "vocab_size": 300, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
             "sliding_window": 32768, "use_sliding_window": false, "max_window_layers": 21,
             "tie_word_embeddings": true, "hidden_act": "silu"})";
  Config q = load_config(dir + "/run.yaml");
  EXPECT_EQ(window_of_config(q.model), 0);
  EXPECT_EQ(q.model.qkv_bias, "true");
  std::system(("rm -rf " + dir).c_str());
}

TEST(Config, UnknownPresetListsTheNames) {
  expect_contains(parse_error(kMinimal, {"model.preset=gpt3"}),
                  {"run.yaml: model.preset must be one of", "tiny", "gpt2-medium", "gpt2-xl",
                   "custom", "got 'gpt3'"});
}

// ---- validation ---------------------------------------------------------------------------------

struct Invalid {
  const char* name;                // test name suffix
  std::vector<std::string> sets;   // overrides applied to kMinimal
  std::vector<std::string> pieces; // substrings of the message, after "run.yaml: "
};

class Validation : public ::testing::TestWithParam<Invalid> {};

TEST_P(Validation, NamesTheFileAndTheKey) {
  const Invalid& v = GetParam();
  const std::string message = parse_error(kMinimal, v.sets);
  EXPECT_EQ(message.rfind("run.yaml: ", 0), 0u) << message;
  expect_contains(message, v.pieces);
}

INSTANTIATE_TEST_SUITE_P(
    Config, Validation,
    ::testing::Values(
        Invalid{"n_layer", {"model.n_layer=-1"}, {"model.n_layer must be > 0, got -1"}},
        Invalid{"islands_word", {"parallel.islands=many"}, {"parallel.islands must be 1 (none), host", "got 'many'"}},
        Invalid{"islands_zero", {"parallel.islands=0"}, {"parallel.islands must be", "got '0'"}},
        Invalid{"inner_steps_zero", {"diloco.inner_steps=0"}, {"diloco.inner_steps must be >= 1", "got 0"}},
        Invalid{"outer_momentum_one", {"diloco.outer_momentum=1"}, {"diloco.outer_momentum must be in [0, 1), got 1"}},
        Invalid{"diloco_dtype", {"diloco.dtype=int4"}, {"diloco.dtype must be one of fp32|bf16|int8, got 'int4'"}},
        Invalid{"fragments_over_h", {"diloco.inner_steps=4", "diloco.fragments=5"},
                {"diloco.fragments must be in [1, diloco.inner_steps = 4]", "got 5"}},
        Invalid{"fragments_zero", {"diloco.fragments=0"}, {"diloco.fragments must be in [1, diloco.inner_steps = 100]"}},
        Invalid{"overlap_h", {"diloco.inner_steps=4", "diloco.overlap=4"},
                {"diloco.overlap must be in [0, diloco.inner_steps = 4)", "got 4"}},
        Invalid{"mix_one", {"diloco.mix=1"}, {"diloco.mix must be in [0, 1), got 1"}},
        Invalid{"optim_name", {"optim.name=lion"}, {"optim.name must be one of adamw|sgd, got 'lion'"}},
        Invalid{"sgd_fused", {"optim.name=sgd", "optim.fused=on"}, {"optim.fused must be auto or off with optim.name: sgd"}},
        Invalid{"state_dtype", {"optim.state_dtype=fp16"}, {"optim.state_dtype must be one of fp32|bf16, got 'fp16'"}},
        Invalid{"bf16_state_fused", {"optim.state_dtype=bf16", "optim.fused=on"},
                {"optim.fused must be auto or off with optim.state_dtype: bf16"}},
        Invalid{"n_kv_head", {"model.preset=llama-debug", "model.n_kv_head=3"},
                {"model.n_kv_head must be > 0 and dividing model.n_head (16), got 3"}},
        Invalid{"rope_scaling_on_gpt2", {"model.rope_scaling=llama3"},
                {"model.rope_scaling applies to model.arch: llama only"}},
        Invalid{"n_kv_head_on_gpt2", {"model.n_kv_head=2"}, {"model.n_kv_head applies to model.arch: llama only"}},
        Invalid{"llama_custom_intermediate", {"model.preset=custom", "model.arch=llama", "model.n_layer=2",
                                              "model.n_head=2", "model.n_embd=16", "model.seq_len=8"},
                {"model.intermediate_size must be set (> 0) for a custom llama model"}},
        Invalid{"arch_vs_preset", {"model.preset=gpt2", "model.arch=llama"},
                {"model.arch must be gpt2 with model.preset gpt2"}},
        Invalid{"family_unknown", {"model.family=gemma"},
                {"model.family must be one of gpt2|llama|qwen2|qwen3|mistral|gemma2|gemma3|qwen3_moe|mixtral|olmoe, got 'gemma'"}},
        Invalid{"gemma_field_on_llama", {"model.preset=llama-debug", "model.attn_softcap=50"},
                {"model.attn_softcap applies to model.family gemma2 only (this model is llama), got 50"}},
        Invalid{"gemma_field_on_gpt2", {"model.final_softcap=30"},
                {"model.final_softcap applies to model.family gemma2|gemma3 only (this model is gpt2), got 30"}},
        Invalid{"gemma_field_on_mistral", {"model.preset=mistral-7b-v0.1", "model.query_pre_attn_scalar=256"},
                {"model.query_pre_attn_scalar applies to model.family gemma2|gemma3 only (this model is mistral)"}},
        Invalid{"gemma_fused_kernels", {"model.preset=gemma2-2b", "model.fused_kernels=on"},
                {"model.fused_kernels must be auto or off with model.family gemma2", "got 'on'"}},
        Invalid{"gemma_fused_loss", {"model.preset=gemma2-2b", "model.fused_loss=on"},
                {"model.fused_loss must be auto or off with model.final_softcap", "got 'on'"}},
        Invalid{"gemma_negative_cap", {"model.preset=gemma2-2b", "model.attn_softcap=-1"},
                {"model.attn_softcap must be >= 0 (0 = none), got -1"}},
        Invalid{"gemma_fixes_qk_norm", {"model.preset=gemma2-2b", "model.qk_norm=true"},
                {"model.qk_norm must be false with model.family gemma2", "got 'true'"}},
        Invalid{"gemma3_fixes_qk_norm", {"model.preset=gemma3-1b", "model.qk_norm=false"},
                {"model.qk_norm must be true with model.family gemma3", "got 'false'"}},
        Invalid{"gemma3_field_on_gemma2", {"model.preset=gemma2-2b", "model.rope_local_theta=10000"},
                {"model.rope_local_theta applies to model.family gemma3 only (this model is gemma2), got 10000"}},
        Invalid{"linear_without_factor", {"model.preset=gemma3-1b", "model.rope_scaling=linear"},
                {"model.rope_factor must be >= 1, got 0"}},
        Invalid{"linear_with_llama3_key", {"model.preset=gemma3-1b", "model.rope_scaling=linear", "model.rope_factor=8",
                                           "model.rope_low_freq_factor=1"},
                {"model.rope_low_freq_factor must be unset (0) unless model.rope_scaling is llama3, got 1"}},
        Invalid{"family_vs_preset_block", {"model.preset=gpt2", "model.family=llama"},
                {"model.family must be one of the gpt2 families with model.preset gpt2"}},
        Invalid{"arch_vs_family", {"model.preset=custom", "model.family=qwen3", "model.arch=gpt2", "model.n_layer=2",
                                   "model.n_head=2", "model.n_embd=16", "model.seq_len=8"},
                {"model.arch must be llama with model.family qwen3"}},
        Invalid{"family_fixes_qkv_bias", {"model.preset=llama-debug", "model.family=qwen2", "model.qkv_bias=false"},
                {"model.qkv_bias must be true with model.family qwen2", "got 'false'"}},
        Invalid{"family_fixes_qk_norm", {"model.preset=qwen3-0.6b", "model.family=qwen3", "model.qk_norm=false"},
                {"model.qk_norm must be true with model.family qwen3", "got 'false'"}},
        Invalid{"family_window", {"model.preset=llama-debug", "model.family=llama", "model.sliding_window=256"},
                {"model.sliding_window applies to model.family mistral|gemma2|gemma3|mixtral only (this model is llama), got 256"}},
        Invalid{"rope_factor_without_llama3", {"model.preset=llama-debug", "model.rope_factor=2"},
                {"model.rope_factor must be unset (0) unless model.rope_scaling is llama3 or linear, got 2"}},
        Invalid{"rope_high_below_low", {"model.preset=llama3.2-1b", "model.rope_high_freq_factor=0.5"},
                {"model.rope_high_freq_factor must be > model.rope_low_freq_factor (1), got 0.5"}},
        Invalid{"head_dim_on_gpt2", {"model.head_dim=64"}, {"model.head_dim applies to model.arch: llama only"}},
        Invalid{"qk_norm_on_gpt2", {"model.qk_norm=true"}, {"model.qk_norm applies to model.arch: llama only"}},
        Invalid{"head_dim_odd", {"model.preset=llama-debug", "model.head_dim=15"},
                {"model.head_dim must be even (rotary pairs), got 15"}},
        Invalid{"qk_norm_with_qkv_bias", {"model.preset=qwen2.5-0.5b", "model.qk_norm=true"},
                {"model.qk_norm must be false with model.qkv_bias: true"}},
        Invalid{"qk_norm_value", {"model.preset=qwen3-0.6b", "model.qk_norm=yes"},
                {"model.qk_norm must be true or false, got 'yes'"}},
        Invalid{"sliding_window_on_gpt2", {"model.sliding_window=1024"},
                {"model.sliding_window applies to model.family mistral|gemma2|gemma3|mixtral only (this model is gpt2), got 1024"}},
        Invalid{"sliding_window_negative", {"model.preset=mistral-7b-v0.1", "model.sliding_window=-1"},
                {"model.sliding_window must be in [0, 2147483647], got -1"}},
        Invalid{"sliding_window_with_qk_norm", {"model.preset=qwen3-0.6b", "model.sliding_window=4096"},
                {"model.sliding_window applies to model.family mistral|gemma2|gemma3|mixtral only (this model is qwen3), got 4096"}},
        Invalid{"sliding_window_with_qkv_bias_unnamed",
                {"model.preset=custom", "model.arch=llama", "model.n_layer=2", "model.n_head=2", "model.n_embd=16",
                 "model.seq_len=8", "model.intermediate_size=32", "model.qkv_bias=true", "model.sliding_window=4"},
                {"model.sliding_window must be 0 with model.qkv_bias or model.qk_norm", "got 4"}},
        Invalid{"n_head", {"model.n_head=-2"}, {"model.n_head must be > 0, got -2"}},
        Invalid{"n_embd", {"model.n_embd=-3"}, {"model.n_embd must be > 0, got -3"}},
        Invalid{"seq_len", {"model.seq_len=-4"}, {"model.seq_len must be > 0, got -4"}},
        Invalid{"vocab_size", {"model.vocab_size=-1"}, {"model.vocab_size must be >= 0", "got -1"}},
        Invalid{"n_embd_divisible",
                {"model.n_embd=100", "model.n_head=6"},
                {"model.n_embd must be divisible by model.n_head (6), got 100"}},
        Invalid{"dropout_high", {"model.dropout=1"}, {"model.dropout must be in [0, 1), got 1"}},
        Invalid{"dropout_low",
                {"model.dropout=-0.1"},
                {"model.dropout must be in [0, 1), got -0.1"}},
        Invalid{"fused_kernels",
                {"model.fused_kernels=fast"},
                {"model.fused_kernels must be one of auto|on|off, got 'fast'"}},
        Invalid{"train_empty",
                {"data.train=[]"},
                {"data.train must be a non-empty list", "got []"}},
        Invalid{"train_empty_entry", {"data.train=['']"}, {"data.train must be a non-empty list"}},
        Invalid{"eval_every", {"eval.every=-1"}, {"eval.every must be >= 0", "got -1"}},
        Invalid{"val_needed",
                {"data.val=[]"},
                {"data.val must be non-empty when eval.every > 0", "got []"}},
        Invalid{"eval_batches", {"eval.batches=0"}, {"eval.batches must be > 0, got 0"}},
        Invalid{"micro_batch", {"train.micro_batch=-4"}, {"train.micro_batch must be > 0, got -4"}},
        Invalid{"grad_accum", {"train.grad_accum=-1"}, {"train.grad_accum must be >= 0", "got -1"}},
        Invalid{"global_batch",
                {"train.global_batch=-1"},
                {"train.global_batch must be >= 0", "got -1"}},
        Invalid{"steps", {"train.steps=0"}, {"train.steps must be > 0, got 0"}},
        Invalid{"threads", {"train.threads=-1"}, {"train.threads must be >= 0", "got -1"}},
        Invalid{"out_dir", {"train.out_dir=''"}, {"train.out_dir must be non-empty, got ''"}},
        Invalid{"lr", {"optim.lr=0"}, {"optim.lr must be > 0, got 0"}},
        Invalid{"min_lr_high",
                {"optim.min_lr=0.001"},
                {"optim.min_lr must be in [0, optim.lr] = [0, 0.0006], got 0.001"}},
        Invalid{"min_lr_low",
                {"optim.min_lr=-1e-5"},
                {"optim.min_lr must be in [0,", "got -1e-05"}},
        Invalid{"warmup_high",
                {"optim.warmup_steps=2000"},
                {"optim.warmup_steps must be in [0, train.steps] = [0, 1000], got 2000"}},
        Invalid{"warmup_low", {"optim.warmup_steps=-1"}, {"optim.warmup_steps must be in", "-1"}},
        Invalid{"weight_decay",
                {"optim.weight_decay=-0.1"},
                {"optim.weight_decay must be >= 0, got -0.1"}},
        Invalid{"beta1", {"optim.beta1=1"}, {"optim.beta1 must be in [0, 1), got 1"}},
        Invalid{"beta2", {"optim.beta2=-0.5"}, {"optim.beta2 must be in [0, 1), got -0.5"}},
        Invalid{"eps", {"optim.eps=0"}, {"optim.eps must be > 0, got 0"}},
        Invalid{"grad_clip", {"optim.grad_clip=-1"}, {"optim.grad_clip must be >= 0", "got -1"}},
        Invalid{"log_every", {"log.every=0"}, {"log.every must be > 0, got 0"}},
        Invalid{"log_level",
                {"log.level=verbose"},
                {"log.level must be one of debug|info|warn|error, got 'verbose'"}},
        Invalid{"checkpoint_dir", {"checkpoint.dir=''"}, {"checkpoint.dir must be non-empty"}},
        Invalid{"checkpoint_every",
                {"checkpoint.every=-5"},
                {"checkpoint.every must be >= 0", "got -5"}},
        Invalid{"checkpoint_keep", {"checkpoint.keep=0"}, {"checkpoint.keep must be >= 1, got 0"}},
        Invalid{"resume",
                {"checkpoint.resume=ckpt.pt"},
                {"checkpoint.resume must be 'auto', 'none' or", "got 'ckpt.pt'"}},
        Invalid{"backend",
                {"comm.backend=gloo"},
                {"comm.backend must be one of auto|mpi|nccl, got 'gloo'"}},
        Invalid{"bucket_mb", {"comm.bucket_mb=0"}, {"comm.bucket_mb must be > 0, got 0"}},
        Invalid{"sample_tokens", {"sample.tokens=-1"}, {"sample.tokens must be >= 0", "got -1"}},
        Invalid{"temperature",
                {"sample.temperature=0"},
                {"sample.temperature must be > 0, got 0"}},
        Invalid{"top_k", {"sample.top_k=-1"}, {"sample.top_k must be >= 0", "got -1"}}),
    [](const ::testing::TestParamInfo<Invalid>& info) { return std::string(info.param.name); });

TEST(Config, BoundaryValuesAreAccepted) {
  Config c = parse_config(kMinimal, "run.yaml",
                          {"model.dropout=0", "optim.min_lr=6e-4", "optim.warmup_steps=1000",
                           "optim.beta1=0", "optim.grad_clip=0", "eval.every=0", "data.val=[]",
                           "checkpoint.keep=1", "checkpoint.resume=none", "comm.backend=nccl",
                           "log.level=debug", "sample.top_k=0"});
  EXPECT_EQ(c.optim.min_lr, c.optim.lr);
  EXPECT_TRUE(c.data.val.empty());
  c = parse_config(kMinimal, "run.yaml", {"checkpoint.resume=ckpt/ckpt-00000100.h5"});
  EXPECT_EQ(c.checkpoint.resume, "ckpt/ckpt-00000100.h5");
}

// ---- overrides ----------------------------------------------------------------------------------

TEST(Config, OverridesApplyAfterTheFile) {
  Config c = parse_config(std::string(kMinimal) + "train:\n  steps: 10\n", "run.yaml",
                          {"train.steps=5", "optim.warmup_steps=5", "data.train=[a.h5,b.h5]",
                           "sample.prompt=Hello, world", "data.shuffle=false"});
  EXPECT_EQ(c.train.steps, 5);
  EXPECT_EQ(c.data.train, (std::vector<std::string>{"a.h5", "b.h5"}));
  EXPECT_EQ(c.sample.prompt, "Hello, world");
  EXPECT_FALSE(c.data.shuffle);
  EXPECT_EQ(c.source, "run.yaml");
}

TEST(Config, OverrideValidationUsesTheFinalValues) {
  // warmup 100 > steps 50 only after the override: the check sees the overridden value.
  expect_contains(parse_error(kMinimal, {"train.steps=50"}),
                  {"run.yaml: optim.warmup_steps must be in [0, train.steps] = [0, 50], got 100"});
}

TEST(Config, BadOverridesNameSet) {
  EXPECT_EQ(parse_error(kMinimal, {"train.stepz=5"}),
            "--set: unknown key 'train.stepz' (did you mean 'train.steps'?)");
  EXPECT_EQ(parse_error(kMinimal, {"trian.steps=5"}),
            "--set: unknown key 'trian.steps' (did you mean 'train.steps'?)");
  EXPECT_EQ(parse_error(kMinimal, {"foo"}), "--set: expected section.key=value, got 'foo'");
  EXPECT_EQ(parse_error(kMinimal, {"steps=5"}), "--set: expected section.key=value, got 'steps=5'");
  EXPECT_EQ(parse_error(kMinimal, {".steps=5"}),
            "--set: expected section.key=value, got '.steps=5'");
  EXPECT_EQ(parse_error(kMinimal, {"train.steps=abc"}),
            "--set: train.steps must be an integer, got 'abc'");
  expect_contains(parse_error(kMinimal, {"data.train=[a.h5"}),
                  {"--set 'data.train=[a.h5': the value of data.train: YAML syntax error at line 1"});
}

// ---- files --------------------------------------------------------------------------------------

TEST(Config, LoadConfigReadsTheFileAndNamesIt) {
  char path[] = "/tmp/mpitrain_config_XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  {
    std::ofstream out(path);
    out << kMinimal << "train:\n  steps: 700\n  micro_bach: 3\n";
  }
  EXPECT_EQ(usage_error([&] { load_config(path); }),
            std::string(path) +
                ": unknown key 'train.micro_bach' (did you mean 'train.micro_batch'?)");
  {
    std::ofstream out(path);
    out << kMinimal << "train:\n  steps: 700\n";
  }
  Config c = load_config(path, {"train.micro_batch=2"});
  EXPECT_EQ(c.source, path);
  EXPECT_EQ(c.train.steps, 700);
  EXPECT_EQ(c.train.micro_batch, 2);
  std::remove(path);
}

TEST(Config, LoadConfigOfAMissingFileOrADirectory) {
  expect_contains(usage_error([] { load_config("/nonexistent/run.yaml"); }),
                  {"/nonexistent/run.yaml: cannot read config file"});
  expect_contains(usage_error([] { load_config("/tmp"); }), {"/tmp: cannot read config file"});
}

// ---- world size ---------------------------------------------------------------------------------

Config with_batch(int64_t micro, int64_t accum, int64_t global) {
  return parse_config(kMinimal, "run.yaml",
                      {"train.micro_batch=" + std::to_string(micro),
                       "train.grad_accum=" + std::to_string(accum),
                       "train.global_batch=" + std::to_string(global)});
}

TEST(Config, WorldDefaultsToOneMicroStep) {
  Config c = with_batch(8, 0, 0);
  resolve_for_world(c, 4);
  EXPECT_EQ(c.train.grad_accum, 1);
  EXPECT_EQ(c.train.global_batch, 32);
}

TEST(Config, WorldDerivesGradAccumFromGlobalBatch) {
  Config c = with_batch(8, 0, 128);
  resolve_for_world(c, 4);
  EXPECT_EQ(c.train.grad_accum, 4);
  EXPECT_EQ(c.train.global_batch, 128);
  resolve_for_world(c, 4);  // resolving twice changes nothing
  EXPECT_EQ(c.train.grad_accum, 4);
}

TEST(Config, WorldDerivesGlobalBatchFromGradAccum) {
  Config c = with_batch(2, 3, 0);
  resolve_for_world(c, 1);
  EXPECT_EQ(c.train.grad_accum, 3);
  EXPECT_EQ(c.train.global_batch, 6);
}

TEST(Config, WorldRejectsANonDivisibleGlobalBatch) {
  Config c = with_batch(8, 0, 100);
  EXPECT_EQ(usage_error([&] { resolve_for_world(c, 4); }),
            "run.yaml: train.global_batch must be a multiple of train.micro_batch x world size "
            "(8 x 4 = 32), got 100");
  c = with_batch(8, 0, 16);  // smaller than one micro-step of the world
  expect_contains(usage_error([&] { resolve_for_world(c, 4); }), {"multiple", "got 16"});
}

TEST(Config, WorldRejectsInconsistentBatchSizes) {
  Config c = with_batch(8, 2, 100);
  expect_contains(usage_error([&] { resolve_for_world(c, 4); }),
                  {"run.yaml: train.global_batch must equal", "train.micro_batch", "world size",
                   "train.grad_accum", "(8 x 4 x 2 = 64), got 100"});
  c = with_batch(8, 2, 64);
  resolve_for_world(c, 4);
  EXPECT_EQ(c.train.global_batch, 64);
}

// ---- round trip ---------------------------------------------------------------------------------

TEST(Config, ToYamlRoundTripsEveryField) {
  const char* full =
      "model:\n  preset: custom\n  n_layer: 3\n  n_head: 4\n  n_embd: 64\n  seq_len: 128\n"
      "  vocab_size: 300\n  dropout: 0.1\n"
      "data:\n  train: [a.h5, 'dir with space/*.h5', 'null']\n  val: ['#v.h5']\n"
      "  seed: 18446744073709551615\n  shuffle: false\n"
      "train:\n  micro_batch: 3\n  grad_accum: 2\n  global_batch: 0\n  steps: 77\n"
      "  seed: 7\n  threads: 2\n  out_dir: 'runs/a: b'\n"
      "optim:\n  lr: 0.0003\n  min_lr: 1.0e-05\n  warmup_steps: 7\n  weight_decay: 0.01\n"
      "  beta1: 0.85\n  beta2: 0.999\n  eps: 1e-10\n  grad_clip: 0.3333333333333333\n"
      "eval:\n  every: 5\n  batches: 2\n"
      "log:\n  every: 1\n  level: debug\n  metrics: ''\n"
      "checkpoint:\n  dir: ck\n  every: 10\n  keep: 2\n  resume: ck/ckpt-00000010.h5\n"
      "comm:\n  backend: mpi\n  bucket_mb: 0.5\n"
      "sample:\n  tokens: 20\n  prompt: \"it's \\\"quoted\\\"\\nand: multi-line\"\n"
      "  temperature: 1.25\n  top_k: 0\n";
  Config a = parse_config(full, "full.yaml");
  EXPECT_EQ(a.sample.prompt, "it's \"quoted\"\nand: multi-line");
  EXPECT_EQ(a.data.train[2], "null");
  const std::string yaml = to_yaml(a);
  Config b = parse_config(yaml, "resolved.yaml");
  expect_same(a, b);
  EXPECT_EQ(to_yaml(b), yaml);
}

TEST(Config, ToYamlListsEveryKeyInStructOrder) {
  Config c = parse_config(kMinimal, "run.yaml");
  const std::string yaml = to_yaml(c);
  size_t last = 0;
  for (const char* key : {"model:", "preset:", "dropout:", "data:", "shuffle:", "train:",
                          "out_dir:", "optim:", "grad_clip:", "eval:", "batches:", "log:",
                          "metrics:", "checkpoint:", "resume:", "comm:", "bucket_mb:", "sample:",
                          "top_k:"}) {
    size_t at = yaml.find(key, last);
    ASSERT_NE(at, std::string::npos) << key << " missing or out of order in\n" << yaml;
    last = at;
  }
  // Doubles come out short when that is exact, and round-trip when it is not.
  EXPECT_NE(yaml.find("lr: 0.0006\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("eps: 1e-08\n"), std::string::npos) << yaml;
  expect_same(c, parse_config(yaml, "resolved.yaml"));
}

TEST(Config, ResolvedConfigRoundTripsAndResolvesAgain) {
  Config c = with_batch(4, 0, 32);
  resolve_for_world(c, 2);
  Config again = parse_config(to_yaml(c), "resolved.yaml");
  expect_same(c, again);
  resolve_for_world(again, 2);
  EXPECT_EQ(again.train.grad_accum, 4);
}

}  // namespace
}  // namespace mpitrain
