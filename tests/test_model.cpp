// The GPT model: GPT-2 124M parameter count, tied embeddings, initialisation, causality, and
// that the tiny model can overfit one batch (the loss can go to ~0). The fused ops (fused_ops.h)
// against libtorch's own layer_norm / gelu autograd, and the model with them against without.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <map>

#include "temp_dir.h"
#include "mpitrain/amp.h"
#include "mpitrain/config.h"
#include "mpitrain/error.h"
#include "mpitrain/fused_ops.h"
#include "mpitrain/hf_format.h"
#include "mpitrain/host_memory.h"
#include "mpitrain/model.h"
#include "mpitrain/optim.h"
#include "mpitrain/pipeline.h"

using namespace mpitrain;

namespace {
GPTDims small_dims() {
  GPTDims d;
  d.n_layer = 2;
  d.n_head = 2;
  d.n_embd = 32;
  d.seq_len = 16;
  d.vocab_size = 50;
  return d;
}
}  // namespace

TEST(Model, Gpt2PresetHas124MParametersWithTiedEmbeddings) {
  Config cfg = parse_config("model: {preset: gpt2}\ndata: {train: [x.h5], val: [y.h5]}\n", "t.yaml");
  GPT model(model_dims(cfg.model, 50257));
  EXPECT_EQ(model->num_params(), 124439808);
  // Tied: no separate output matrix among the parameters.
  for (const auto& [name, p] : model->named_params()) EXPECT_EQ(name.find("lm_head"), std::string::npos);
}

TEST(Model, LlamaDebugPresetCountsEveryPart) {
  Config cfg = parse_config("model: {preset: llama-debug}\ndata: {train: [x.h5], val: [y.h5]}\n", "t.yaml");
  GPT model(model_dims(cfg.model, 257));
  // embedding 2048 x 256 (tied); per layer q 256x256, k and v 64x256 (4 kv heads of 16), o 256x256,
  // gate/up/down 768x256, two RMSNorms of 256; final RMSNorm
  const int64_t layer = 2 * 65536 + 2 * 16384 + 3 * 196608 + 2 * 256;
  EXPECT_EQ(model->num_params(), 2048 * 256 + 6 * layer + 256);
  for (const auto& [name, p] : model->named_params()) {
    EXPECT_EQ(name.find("wpe"), std::string::npos);
    EXPECT_EQ(name.find(".bias"), std::string::npos) << name;  // no biases without qkv_bias
  }
}

// Qwen3's attention: heads wider than n_embd / n_head (4 x 16 = 64 > 32), an RMSNorm over each
// head's q and k (weights of head_dim, starting at one, whole on every tp rank), no biases.
TEST(Model, Qwen3AttentionHasWideHeadsAndQkNorms) {
  GPTDims d;
  d.arch = "llama";
  d.n_layer = 2, d.n_head = 4, d.n_kv_head = 2, d.n_embd = 32, d.head_size = 16, d.intermediate_size = 48;
  d.seq_len = 16, d.vocab_size = 70, d.max_position = 16, d.qk_norm = true;
  GPT model(d);
  // per layer: q 64x32, k and v 32x32 (2 kv heads of 16), o 32x64, q/k norms of 16, gate/up/down
  // 48x32, two RMSNorms of 32; the tied embedding and the final RMSNorm
  const int64_t layer = 2 * 2048 + 2 * 1024 + 2 * 16 + 3 * 1536 + 2 * 32;
  EXPECT_EQ(model->num_params(), 70 * 32 + 2 * layer + 32);
  const auto params = model->named_params();
  std::map<std::string, torch::Tensor> by_name(params.begin(), params.end());
  ASSERT_TRUE(by_name.count("h.1.attn.q_norm.weight") && by_name.count("h.1.attn.k_norm.weight"));
  EXPECT_TRUE(torch::equal(by_name["h.1.attn.q_norm.weight"], torch::ones({16})));
  EXPECT_EQ(by_name["h.0.attn.q_proj.weight"].sizes(), torch::IntArrayRef({64, 32}));
  EXPECT_EQ(by_name["h.0.attn.c_proj.weight"].sizes(), torch::IntArrayRef({32, 64}));
  EXPECT_EQ(model->tp_split("h.0.attn.k_norm.weight"), TpSplit::replicated);
  EXPECT_EQ(hf_name("h.0.attn.q_norm.weight", d), "model.layers.0.self_attn.q_norm.weight");
  EXPECT_EQ(hf_architecture(d), "Qwen3ForCausalLM");
  // The norms act: the same model without them computes other logits.
  GPTDims plain = d;
  plain.qk_norm = false;
  GPT without(plain);
  {
    torch::NoGradGuard no_grad;
    for (const auto& [name, p] : without->named_params()) p.copy_(by_name.at(name));
    auto x = torch::randint(0, 70, {2, 16}, torch::kLong);
    EXPECT_FALSE(torch::allclose(model->forward(x), without->forward(x), 1e-3, 1e-3));
  }
}

// Gemma 2's block: four norms x (1 + w) whose weights start at zero (the gain one), GeGLU, the
// window on layers 0, 2, ..., Hugging Face's names for the four norms; Gemma 2 2B's size as
// published (2,614,341,888 parameters; one block built here, with a small vocabulary).
TEST(Model, Gemma2BlockHasFourNormsAndThePublishedSize) {
  Config cfg = parse_config("model: {preset: gemma2-2b, n_layer: 1, vocab_size: 64}\ndata: {train: [x.h5], val: [y.h5]}\n",
                            "t.yaml");
  EXPECT_EQ(cfg.model.family, "gemma2");
  EXPECT_EQ(cfg.model.attn_softcap, 50.0);
  EXPECT_EQ(cfg.model.final_softcap, 30.0);
  EXPECT_EQ(cfg.model.query_pre_attn_scalar, 256.0);
  const GPTDims d = model_dims(cfg.model, 64);
  GPT model(d);
  // q 2048x2304 (8 heads of 256), k and v 1024x2304, o 2304x2048, gate/up/down 9216x2304, four
  // RMSNorms of 2304
  const int64_t block = 2 * 4718592 + 2 * 2359296 + 3 * 21233664 + 4 * 2304;
  EXPECT_EQ(block, 77865984);
  EXPECT_EQ(model->num_params(), 64 * 2304 + block + 2304);
  EXPECT_EQ(26 * block + 256000 * 2304 + 2304, 2614341888);
  const auto params = model->named_params();
  std::map<std::string, torch::Tensor> by_name(params.begin(), params.end());
  for (const char* norm : {"h.0.ln_1.weight", "h.0.ln_2.weight", "h.0.post_attn_norm.weight", "h.0.post_mlp_norm.weight",
                           "ln_f.weight"}) {
    ASSERT_TRUE(by_name.count(norm)) << norm;
    EXPECT_TRUE(torch::equal(by_name[norm], torch::zeros({2304}))) << norm;
  }
  EXPECT_EQ(hf_name("h.3.ln_1.weight", d), "model.layers.3.input_layernorm.weight");
  EXPECT_EQ(hf_name("h.3.post_attn_norm.weight", d), "model.layers.3.post_attention_layernorm.weight");
  EXPECT_EQ(hf_name("h.3.ln_2.weight", d), "model.layers.3.pre_feedforward_layernorm.weight");
  EXPECT_EQ(hf_name("h.3.post_mlp_norm.weight", d), "model.layers.3.post_feedforward_layernorm.weight");
  EXPECT_EQ(hf_name("h.3.mlp.c_proj.weight", d), "model.layers.3.mlp.down_proj.weight");
  EXPECT_EQ(hf_architecture(d), "Gemma2ForCausalLM");
  EXPECT_EQ(d.window_of_layer(0), 4096);
  EXPECT_EQ(d.window_of_layer(1), 0);
  EXPECT_EQ(d.window_of_layer(24), 4096);
}

// Qwen3-30B-A3B as published: 30,532,122,624 parameters, 3,353,032,704 active per token. One layer
// is built with experts of 8 units instead of 768 (2.4 GB of fp32 otherwise); the count of the
// built layer checks the formula, which the published shape then evaluates.
TEST(Model, Qwen3MoeLayerHasRouterAndExpertsAndThePublishedSize) {
  Config cfg = parse_config("model: {preset: qwen3-30b-a3b, n_layer: 1, vocab_size: 64, moe_intermediate_size: 8}\n"
                            "data: {train: [x.h5], val: [y.h5]}\n", "t.yaml");
  EXPECT_EQ(cfg.model.family, "qwen3_moe");
  const GPTDims d = model_dims(cfg.model, 64);
  EXPECT_EQ(d.num_experts, 128);
  EXPECT_EQ(d.num_experts_per_tok, 8);
  EXPECT_TRUE(d.norm_topk_prob);
  EXPECT_DOUBLE_EQ(d.router_aux_loss_coef, 0.001);
  GPT model(d);
  // q 4096x2048 (32 heads of 128), k and v 512x2048, o 2048x4096, q/k norms of 128, two RMSNorms of
  // 2048, the router 128x2048, 128 experts of gate/up/down units x 2048
  auto layer = [](int64_t units) { return 2 * 8388608 + 2 * 1048576 + 2 * 128 + 2 * 2048 + 128 * 2048 + 128 * 3 * units * 2048; };
  auto expert = [](int64_t units) { return 3 * units * 2048; };
  EXPECT_EQ(model->num_params(), 2 * 64 * 2048 + layer(8) + 2048);  // untied: the embedding and lm_head
  EXPECT_EQ(model->inactive_params(), 120 * expert(8));
  const int64_t total = 48 * layer(768) + 2 * 151936 * 2048 + 2048;
  EXPECT_EQ(total, 30532122624);
  EXPECT_EQ(total - 48 * 120 * expert(768), 3353032704);
  const auto params = model->named_params();
  std::map<std::string, torch::Tensor> by_name(params.begin(), params.end());
  EXPECT_EQ(by_name.at("h.0.mlp.gate.weight").sizes(), torch::IntArrayRef({128, 2048}));
  EXPECT_EQ(by_name.at("h.0.mlp.experts.127.c_proj.weight").sizes(), torch::IntArrayRef({2048, 8}));
  EXPECT_EQ(by_name.count("h.0.mlp.gate_proj.weight"), 0u);  // no dense MLP on a sparse layer
  EXPECT_EQ(hf_name("h.0.mlp.gate.weight", d), "model.layers.0.mlp.gate.weight");
  EXPECT_EQ(hf_name("h.0.mlp.experts.5.c_proj.weight", d), "model.layers.0.mlp.experts.5.down_proj.weight");
  EXPECT_EQ(hf_name("h.0.mlp.experts.5.up_proj.weight", d), "model.layers.0.mlp.experts.5.up_proj.weight");
  EXPECT_EQ(hf_architecture(d), "Qwen3MoeForCausalLM");
}

// Mixtral 8x7B and OLMoE 1B-7B as published (46,702,792,704 and 6,919,161,856 parameters;
// 12,879,925,248 and 1,282,017,280 active per token): one layer built with experts of 8 units
// checks each formula, which the published shape then evaluates. Mixtral's experts are
// block_sparse_moe's w1/w3/w2; OLMoE's q/k norms span the whole projections.
TEST(Model, MixtralAndOlmoeLayersHaveThePublishedSizes) {
  auto built = [](const char* preset) {
    Config cfg = parse_config(concat("model: {preset: ", preset, ", n_layer: 1, vocab_size: 64, intermediate_size: 8, ",
                                     "moe_intermediate_size: 8}\ndata: {train: [x.h5], val: [y.h5]}\n"), "t.yaml");
    return model_dims(cfg.model, 64);
  };
  const GPTDims mx = built("mixtral-8x7b");
  EXPECT_TRUE(mx.norm_topk_prob);  // fixed by the family
  GPT mixtral(mx);
  // q 4096x4096, k and v 1024x4096, o 4096x4096, two norms, the router 8x4096, 8 experts
  auto mx_layer = [](int64_t units) { return 2 * 16777216 + 2 * 4194304 + 2 * 4096 + 8 * 4096 + 8 * 3 * units * 4096; };
  EXPECT_EQ(mixtral->num_params(), 2 * 64 * 4096 + mx_layer(8) + 4096);
  EXPECT_EQ(mixtral->inactive_params(), 6 * 3 * 8 * 4096);
  EXPECT_EQ(32 * mx_layer(14336) + 2 * 32000 * 4096 + 4096, 46702792704);
  EXPECT_EQ(32 * mx_layer(14336) + 2 * 32000 * 4096 + 4096 - 32 * 6 * 3 * int64_t{14336} * 4096, 12879925248);
  EXPECT_EQ(hf_name("h.0.mlp.experts.7.c_proj.weight", mx), "model.layers.0.block_sparse_moe.experts.7.w2.weight");
  EXPECT_EQ(hf_name("h.0.mlp.experts.7.gate_proj.weight", mx), "model.layers.0.block_sparse_moe.experts.7.w1.weight");
  EXPECT_EQ(hf_name("h.0.mlp.experts.7.up_proj.weight", mx), "model.layers.0.block_sparse_moe.experts.7.w3.weight");
  EXPECT_EQ(hf_name("h.0.mlp.gate.weight", mx), "model.layers.0.block_sparse_moe.gate.weight");
  const GPTDims ol = built("olmoe-1b-7b");
  EXPECT_FALSE(ol.norm_topk_prob);
  GPT olmoe(ol);
  // q, k, v, o 2048x2048, q/k norms of 2048 (the whole projections), two norms, the router 64x2048, 64 experts
  auto ol_layer = [](int64_t units) { return 4 * 4194304 + 2 * 2048 + 2 * 2048 + 64 * 2048 + 64 * 3 * units * 2048; };
  EXPECT_EQ(olmoe->num_params(), 2 * 64 * 2048 + ol_layer(8) + 2048);
  EXPECT_EQ(16 * ol_layer(1024) + 2 * 50304 * 2048 + 2048, 6919161856);
  EXPECT_EQ(16 * ol_layer(1024) + 2 * 50304 * 2048 + 2048 - 16 * 56 * 3 * int64_t{1024} * 2048, 1282017280);
  const auto params = olmoe->named_params();
  std::map<std::string, torch::Tensor> by_name(params.begin(), params.end());
  EXPECT_EQ(by_name.at("h.0.attn.q_norm.weight").numel(), 2048);
  EXPECT_EQ(hf_architecture(ol), "OlmoeForCausalLM");
}

// Gemma 3 1B as published: 999,885,952 parameters (one block built, a small vocabulary): q/k norms
// of 256 whose weights start at zero, the local layers' own rotary table.
TEST(Model, Gemma3BlockHasQkNormsAndThePublishedSize) {
  Config cfg = parse_config("model: {preset: gemma3-1b, n_layer: 1, vocab_size: 64}\ndata: {train: [x.h5], val: [y.h5]}\n",
                            "t.yaml");
  EXPECT_EQ(cfg.model.family, "gemma3");
  EXPECT_EQ(cfg.model.rope_local_theta, 10000.0);
  GPT model(model_dims(cfg.model, 64));
  // q 1024x1152 (4 heads of 256), k and v 256x1152, o 1152x1024, gate/up/down 6912x1152, four
  // RMSNorms of 1152, q/k norms of 256
  const int64_t block = 2 * 1179648 + 2 * 294912 + 3 * 7962624 + 4 * 1152 + 2 * 256;
  EXPECT_EQ(block, 26842112);
  EXPECT_EQ(model->num_params(), 64 * 1152 + block + 1152);
  EXPECT_EQ(26 * block + 262144 * 1152 + 1152, 999885952);
  const auto params = model->named_params();
  std::map<std::string, torch::Tensor> by_name(params.begin(), params.end());
  EXPECT_TRUE(torch::equal(by_name.at("h.0.attn.q_norm.weight"), torch::zeros({256})));
  EXPECT_EQ(hf_name("h.0.attn.k_norm.weight", model->dims()), "model.layers.0.self_attn.k_norm.weight");
  EXPECT_EQ(hf_architecture(model->dims()), "Gemma3ForCausalLM");
}

// Gemma 2's parts act: each of them changed alone changes the logits of a small model whose
// norms are away from their initial zeros.
TEST(Model, Gemma2PartsEachChangeTheLogits) {
  GPTDims d;
  d.family = "gemma2", d.arch = "llama";
  d.n_layer = 2, d.n_head = 4, d.n_kv_head = 2, d.n_embd = 32, d.head_size = 16, d.intermediate_size = 48;
  d.seq_len = 16, d.vocab_size = 70, d.max_position = 16, d.sliding_window = 4;
  d.attn_softcap = 0.05, d.final_softcap = 0.5, d.query_pre_attn_scalar = 8;
  torch::manual_seed(1);
  GPT model(d);
  const auto params = model->named_params();
  std::map<std::string, torch::Tensor> by_name(params.begin(), params.end());
  {
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : by_name)
      if (name.find("norm") != std::string::npos || name.find("ln_") != std::string::npos) p.normal_(0.0, 0.5);
  }
  const auto x = torch::randint(0, 70, {2, 16}, torch::kLong);
  const torch::Tensor ref = model->forward(x).detach();
  EXPECT_LE(ref.abs().max().item<double>(), 0.5);  // the final cap bounds the logits
  auto other = [&](const char* what, auto change) {
    GPTDims e = d;
    change(e);
    GPT m(e);
    torch::NoGradGuard no_grad;
    for (const auto& [name, p] : m->named_params()) p.copy_(by_name.at(name));
    EXPECT_FALSE(torch::allclose(m->forward(x), ref, 1e-4, 1e-5)) << what;
  };
  other("no window", [](GPTDims& e) { e.sliding_window = 0; });
  other("no score cap", [](GPTDims& e) { e.attn_softcap = 0; });
  other("no logit cap", [](GPTDims& e) { e.final_softcap = 0; });
  other("the head size's query scale", [](GPTDims& e) { e.query_pre_attn_scalar = 16; });
}

// Qwen3 0.6B's blocks as published: 28 of 15,730,944 parameters, 0.44B without the embedding
// (one block built here, with a small vocabulary: the whole model would take 2.4 GB).
TEST(Model, Qwen3PresetBlockHasThePublishedSize) {
  Config cfg = parse_config("model: {preset: qwen3-0.6b, n_layer: 1, vocab_size: 64}\ndata: {train: [x.h5], val: [y.h5]}\n",
                            "t.yaml");
  GPT model(model_dims(cfg.model, 64));
  // q 2048x1024, k and v 1024x1024 (8 kv heads of 128), o 1024x2048, q/k norms of 128, gate/up/down
  // 3072x1024, two RMSNorms of 1024
  const int64_t block = 2 * 2097152 + 2 * 1048576 + 2 * 128 + 3 * 3145728 + 2 * 1024;
  EXPECT_EQ(block, 15730944);
  EXPECT_EQ(model->num_params(), 64 * 1024 + block + 1024);
  EXPECT_EQ(28 * block + 1024, 440467456);  // "0.44B non-embedding parameters"
}

// A Llama written to Hugging Face's files and read back: every tensor bitwise, in one file and in
// shards with an index; a tied model writes no lm_head, an untied one does. Qwen2-shaped (q/k/v
// biases) tied and untied, and Qwen3-shaped (wide heads, q/k norms).
TEST(Model, LlamaHuggingFaceFilesRoundTripBitwise) {
  for (int variant : {0, 1, 2}) {
    const bool tied = variant != 1, qwen3 = variant == 2;
    GPTDims d;
    d.arch = "llama";
    d.n_layer = 2, d.n_head = 4, d.n_kv_head = 2, d.n_embd = 32, d.intermediate_size = 48, d.seq_len = 16;
    d.vocab_size = 70, d.max_position = 16, d.qkv_bias = !qwen3, d.tie_embeddings = tied;
    if (qwen3) d.head_size = 16, d.qk_norm = true;
    torch::manual_seed(3);
    GPT a(d);
    if (qwen3) {  // norms other than their initial ones, so that a norm left at one is seen
      torch::NoGradGuard no_grad;
      for (const auto& [name, p] : a->named_params())
        if (name.find("_norm.") != std::string::npos) p.uniform_(0.5, 1.5);
    }
    const TempDir tmp;
    const std::string dir = tmp.path;
    for (uint64_t shard_bytes : {uint64_t{5'000'000'000}, uint64_t{8000}}) {
      HfWriteOptions opts;
      opts.max_shard_bytes = shard_bytes;
      const std::string files = write_hf_model(dir, a, 7, opts);
      const bool sharded = shard_bytes < 1'000'000;
      EXPECT_EQ(std::filesystem::exists(dir + "/model.safetensors.index.json"), sharded) << files;
      EXPECT_EQ(std::filesystem::exists(dir + "/model.safetensors"), !sharded) << files;
      torch::manual_seed(4);
      GPT b(d);
      EXPECT_EQ(load_initial_weights("hf:" + dir, b), b->num_params() > 0 ? static_cast<int64_t>(b->named_params().size()) : 0);
      const auto pa = a->named_params(), pb = b->named_params();
      for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i].second, pb[i].second)) << pa[i].first;
      EXPECT_EQ(hf_name("h.1.attn.c_proj.weight", d), "model.layers.1.self_attn.o_proj.weight");
      EXPECT_EQ(hf_name("h.0.mlp.c_proj.weight", d), "model.layers.0.mlp.down_proj.weight");
      EXPECT_EQ(hf_name("h.0.ln_2.weight", d), "model.layers.0.post_attention_layernorm.weight");
    }
  }
}

// Each module declares how tensor parallelism splits the parameters it makes; the model answers by
// full name. The roles as Megatron splits them: the vocabulary's rows, column-parallel layers by
// output rows (c_attn as [q; k; v] by whole heads), row-parallel weights by input columns, and the
// rest (norms, positions, row-parallel biases) whole. The same declarations at tp 1 and tp 2.
TEST(Model, TensorParallelSplitsAreDeclaredWhereTheParametersAreMade) {
  auto expected = [](const std::string& name) {
    auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
    if (name == "wte.weight" || name == "lm_head.weight") return TpSplit::rows;
    if (has(".attn.c_attn.")) return TpSplit::qkv_rows;
    if (has(".q_proj.") || has(".k_proj.") || has(".v_proj.") || has(".c_fc.") || has(".gate_proj.") || has(".up_proj."))
      return TpSplit::rows;
    if (has(".c_proj.weight")) return TpSplit::cols;
    return TpSplit::replicated;
  };
  GPTDims llama;
  llama.arch = "llama";
  llama.n_layer = 2, llama.n_head = 4, llama.n_kv_head = 2, llama.n_embd = 32, llama.intermediate_size = 48;
  llama.seq_len = 16, llama.vocab_size = 70, llama.max_position = 16, llama.qkv_bias = true, llama.tie_embeddings = false;
  for (const GPTDims& d : {small_dims(), llama}) {
    GPT model(d);
    int rows = 0, qkv = 0, cols = 0, whole = 0;
    for (const auto& [name, p] : model->named_params()) {
      const TpSplit split = model->tp_split(name);
      EXPECT_EQ(split, expected(name)) << d.arch << " " << name;
      rows += split == TpSplit::rows, qkv += split == TpSplit::qkv_rows, cols += split == TpSplit::cols;
      whole += split == TpSplit::replicated;
    }
    const int layers = static_cast<int>(d.n_layer);
    if (d.llama()) {  // q, k, v weights and biases, gate, up per layer; wte and lm_head
      EXPECT_EQ(rows, layers * 8 + 2);
      EXPECT_EQ(qkv, 0);
    } else {  // c_fc weight and bias per layer; wte
      EXPECT_EQ(rows, layers * 2 + 1);
      EXPECT_EQ(qkv, layers * 2);
    }
    EXPECT_EQ(cols, layers * 2);  // attn.c_proj and mlp.c_proj weights
    EXPECT_GT(whole, 0);
    EXPECT_THROW(model->tp_split("h.0.no_such.weight"), std::exception);
  }
}

TEST(Model, VocabularyMayBePaddedButNotSmallerThanData) {
  ModelConfig m;
  m.n_layer = 1; m.n_head = 1; m.n_embd = 8; m.seq_len = 8;
  m.vocab_size = 64;
  EXPECT_EQ(model_dims(m, 50).vocab_size, 64);
  m.vocab_size = 0;
  EXPECT_EQ(model_dims(m, 50).vocab_size, 50);
  m.vocab_size = 40;
  EXPECT_THROW(model_dims(m, 50), UsageError);
}

// model.init_from: hf:DIR: config.json's vocab_size is the weights' classes. Automatic padding pads
// them, as it pads the data's; fewer than the data's tokens is refused naming the file and key (it
// said "model.vocab_size must be >= the data's vocab_size 257, got 200", naming neither).
TEST(Model, InitialWeightsClassesArePaddedAndMayNotBeFewerThanTheData) {
  ModelConfig m;
  m.n_layer = 1; m.n_head = 1; m.n_embd = 8; m.seq_len = 8;
  m.init_vocab = 257;
  m.init_vocab_source = "hf/config.json's vocab_size";
  GPTDims d = model_dims(m, 200, 2);  // tp 2 on the CPU
  EXPECT_EQ(d.vocab_size, 258);
  EXPECT_EQ(d.vocab_live, 257);
  EXPECT_EQ(d.classes(), 257);
  d = model_dims(m, 257, 1);
  EXPECT_EQ(d.vocab_size, 257);
  EXPECT_EQ(d.vocab_live, 0);
  m.init_vocab = 200;
  try {
    model_dims(m, 257, 1);
    ADD_FAILURE() << "no UsageError";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()), "model.init_from: hf/config.json's vocab_size is 200, smaller than the data's "
                                     "vocab_size 257 (the weights have no row for the data's larger token ids)");
  }
}

TEST(Model, AutomaticPaddingRoundsTheDataVocabularyUpAndKeepsThePaddingOutOfTheLoss) {
  ModelConfig m;
  m.n_layer = 1; m.n_head = 1; m.n_embd = 8; m.seq_len = 8;
  // model.vocab_multiple 0: 64 on CUDA, 1 on the CPU; times tp.
  EXPECT_EQ(vocab_pad_multiple(m, true, 1), 64);
  EXPECT_EQ(vocab_pad_multiple(m, true, 2), 128);
  EXPECT_EQ(vocab_pad_multiple(m, false, 1), 1);
  EXPECT_EQ(vocab_pad_multiple(m, false, 2), 2);
  m.vocab_multiple = 8;
  EXPECT_EQ(vocab_pad_multiple(m, false, 4), 32);
  const GPTDims bytes_tp2 = model_dims(m, 257, 2);  // the byte vocabulary under tp 2 on the CPU
  EXPECT_EQ(bytes_tp2.vocab_size, 258);
  EXPECT_EQ(bytes_tp2.vocab_live, 257);
  EXPECT_EQ(bytes_tp2.classes(), 257);
  const GPTDims gpt2_gpu = model_dims(m, 50257, 64);
  EXPECT_EQ(gpt2_gpu.vocab_size, 50304);  // nanoGPT's
  EXPECT_EQ(gpt2_gpu.classes(), 50257);
  const GPTDims exact = model_dims(m, 256, 64);  // nothing to pad: every row a class
  EXPECT_EQ(exact.vocab_size, 256);
  EXPECT_EQ(exact.vocab_live, 0);
  m.vocab_size = 50304;  // explicit: every row a class, as nanoGPT and Hugging Face have it
  EXPECT_EQ(model_dims(m, 50257, 64).vocab_live, 0);
  EXPECT_EQ(model_dims(m, 50257, 64).classes(), 50304);
}

TEST(Model, Gpt2Initialisation) {
  torch::manual_seed(0);
  GPTDims d = small_dims();
  d.n_layer = 4;
  d.n_embd = 64;
  d.vocab_size = 512;
  GPT model(d);
  for (const auto& [name, p] : model->named_params()) {
    if (name.find("ln_") != std::string::npos) {
      EXPECT_TRUE(torch::all(p == (name.find(".weight") != std::string::npos ? 1.0 : 0.0)).item<bool>()) << name;
    } else if (name.find(".bias") != std::string::npos) {
      EXPECT_EQ(p.abs().max().item<float>(), 0.0f) << name;
    } else {
      const double expected = name.find("c_proj.weight") != std::string::npos ? 0.02 / std::sqrt(8.0) : 0.02;
      EXPECT_NEAR(p.std().item<double>(), expected, expected * 0.15) << name;
    }
  }
}

// ZeRO-3's start-up (GPT made `deferred`): the modules are made with every draw they make, but no
// parameter keeps memory, so at most one block and the embeddings exist at once; initialize()
// then hands out, one parameter at a time, the values a model made whole draws, bitwise: GPT-2
// with a padded vocabulary, Llama with an untied head and q/k/v biases. It changes no generator
// state, so it can run twice.
TEST(Model, DeferredModelDrawsTheSameValuesOneParameterAtATime) {
  count_cpu_allocations();
  GPTDims gpt2 = small_dims();
  gpt2.n_layer = 6;
  gpt2.vocab_live = 45;  // 5 padding rows, drawn as zeros
  GPTDims llama = gpt2;
  llama.arch = "llama";
  llama.n_kv_head = 1;
  llama.tie_embeddings = false;
  llama.qkv_bias = true;
  llama.intermediate_size = 48;
  for (const GPTDims& d : {gpt2, llama}) {  // (a tensor-parallel rank's: test_tensor_parallel)
    const std::string what = d.arch;
    torch::manual_seed(3);
    GPT whole(d);
    const auto want = whole->named_params();
    int64_t whole_bytes = 0, largest_block = 0, outside = 0;
    std::map<std::string, int64_t> block_bytes;
    for (const auto& [name, p] : want) {
      whole_bytes += p.nbytes();
      if (name.rfind("h.", 0) == 0) block_bytes[name.substr(0, name.find('.', 2))] += p.nbytes();
      else outside += p.nbytes();
    }
    for (const auto& [block, bytes] : block_bytes) largest_block = std::max(largest_block, bytes);

    torch::manual_seed(3);
    reset_cpu_peak();
    const int64_t before = cpu_allocated_bytes();
    GPT deferred(d, /*deferred=*/true);
    const int64_t made_peak = cpu_peak_allocated_bytes() - before;
    const torch::Tensor next_draw = torch::rand({4});  // the generator as the modules left it
    // At most the layers outside the blocks (a padded embedding twice while it is padded) and one
    // block at once.
    const int64_t bound = 2 * outside + largest_block;
    EXPECT_LE(made_peak, bound) << what;
    EXPECT_LT(bound, whole_bytes) << what << ": the bound says something";
    for (const auto& [name, p] : deferred->named_params())
      EXPECT_LE(p.storage().nbytes(), p.element_size()) << what << ": " << name << " has memory";
    for (int pass = 0; pass < 2; ++pass) {
      size_t seen = 0;
      deferred->initialize([&](size_t k, const torch::Tensor& v) {
        ASSERT_EQ(k, seen++) << what;
        EXPECT_TRUE(torch::equal(v, want.at(k).second)) << what << ": " << want[k].first << ", pass " << pass;
      });
      EXPECT_EQ(seen, want.size()) << what;
    }
    torch::manual_seed(3);
    GPT again(d, true);
    EXPECT_TRUE(torch::equal(torch::rand({4}), next_draw)) << what << ": initialize() drew from the default generator";
  }
}

TEST(Model, IsCausal) {
  torch::manual_seed(1);
  GPT model(small_dims());
  model->eval();
  auto a = torch::randint(0, 50, {1, 16}, torch::kInt64);
  auto b = a.clone();
  b.index_put_({0, 10}, (a.index({0, 10}).item<int64_t>() + 1) % 50);
  auto la = model->forward(a), lb = model->forward(b);
  using torch::indexing::Slice;
  EXPECT_TRUE(torch::allclose(la.index({0, Slice(0, 10)}), lb.index({0, Slice(0, 10)})));
  EXPECT_FALSE(torch::allclose(la.index({0, Slice(10, 16)}), lb.index({0, Slice(10, 16)})));
}

TEST(Model, TinyModelOverfitsOneBatch) {
  torch::manual_seed(2);
  GPT model(small_dims());
  OptimConfig oc;
  oc.lr = 3e-3;
  oc.weight_decay = 0.0;
  AdamW opt(model->named_params(), oc);
  auto batch = torch::randint(0, 50, {4, 17}, torch::kInt64);
  using torch::indexing::Slice;
  auto x = batch.index({Slice(), Slice(0, 16)}), y = batch.index({Slice(), Slice(1, 17)});
  double first = 0, last = 0;
  for (int i = 0; i < 300; ++i) {
    auto loss = model->loss(x, y);
    loss.backward();
    opt.step(oc.lr);
    opt.zero_grad();
    if (i == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  EXPECT_NEAR(first, std::log(50.0), 0.3);  // starts near uniform
  EXPECT_LT(last, 0.05);                    // and memorises the batch
}

TEST(Model, GenerateIsDeterministicPerSeed) {
  torch::manual_seed(3);
  GPT model(small_dims());
  auto a = generate(model, {1, 2, 3}, 20, 1.0, 10, 7);
  auto b = generate(model, {1, 2, 3}, 20, 1.0, 10, 7);
  auto c = generate(model, {1, 2, 3}, 20, 1.0, 10, 8);
  EXPECT_EQ(a.size(), 23u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  for (auto t : a) EXPECT_LT(t, 50);
}

// The fused, chunked classifier + cross-entropy equals logits-then-cross_entropy in value and in
// the gradients of both the hidden states and the (tied) weight, whatever the chunking.
TEST(Model, FusedLinearCrossEntropyEqualsTheTextbookPath) {
  torch::manual_seed(21);
  const int64_t n = 50, c = 12, v = 33;
  auto h0 = torch::randn({n, c}), w0 = torch::randn({v, c}) * 0.5;
  auto t = torch::randint(0, v, {n}, torch::kLong);

  auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  auto ref = torch::nn::functional::cross_entropy(torch::matmul(h, w.t()), t);
  ref.backward();
  for (int64_t rows : {0, 7, 50, 64}) {
    auto hf = h0.clone().requires_grad_(true), wf = w0.clone().requires_grad_(true);
    auto loss = linear_cross_entropy(hf, wf, t, rows);
    (loss * 3.0).backward();  // the incoming gradient is applied in backward
    EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-5) << rows;
    EXPECT_TRUE(torch::allclose(hf.grad(), h.grad() * 3.0, 1e-5, 1e-6)) << rows;
    EXPECT_TRUE(torch::allclose(wf.grad(), w.grad() * 3.0, 1e-5, 1e-6)) << rows;
    torch::NoGradGuard no_grad;  // evaluation path: the loss alone
    EXPECT_NEAR(linear_cross_entropy(h0, w0, t, rows).item<double>(), ref.item<double>(), 1e-5);
  }

  // In the model: the fused loss and the plain one agree, and so do their gradients.
  GPTDims d;
  d.n_layer = 1;
  d.n_head = 2;
  d.n_embd = 16;
  d.seq_len = 8;
  d.vocab_size = 40;
  torch::manual_seed(5);
  GPT fused(d);
  RunOptions fused_loss;
  fused_loss.fused_loss = true;
  fused->apply(fused_loss);
  torch::manual_seed(5);
  GPT plain(d);
  auto x = torch::randint(0, 40, {3, 8}, torch::kLong), y = torch::randint(0, 40, {3, 8}, torch::kLong);
  auto lf = fused->loss(x, y), lp = plain->loss(x, y.to(torch::kInt32));  // int32 targets are accepted
  EXPECT_NEAR(lf.item<double>(), lp.item<double>(), 1e-5);
  lf.backward();
  lp.backward();
  auto pf = fused->named_params(), pp = plain->named_params();
  for (size_t i = 0; i < pf.size(); ++i)
    EXPECT_TRUE(torch::allclose(pf[i].second.grad(), pp[i].second.grad(), 1e-4, 1e-6)) << pf[i].first;
}

// ---- fused ops (fused_ops.h) -------------------------------------------------------------------

namespace {

// |a - b| <= atol + rtol * |b| everywhere; an undefined gradient counts as zeros.
::testing::AssertionResult tensors_close(torch::Tensor a, torch::Tensor b, double rtol, double atol) {
  if (!a.defined() && !b.defined()) return ::testing::AssertionSuccess();
  if (!a.defined()) a = torch::zeros_like(b);
  if (!b.defined()) b = torch::zeros_like(a);
  if (a.sizes() != b.sizes())
    return ::testing::AssertionFailure() << "shapes " << a.sizes() << " vs " << b.sizes();
  if (a.scalar_type() != b.scalar_type())
    return ::testing::AssertionFailure() << "dtypes " << a.scalar_type() << " vs " << b.scalar_type();
  auto x = a.to(torch::kDouble), y = b.to(torch::kDouble);
  const double excess = ((x - y).abs() - (atol + rtol * y.abs())).max().item<double>();
  if (excess <= 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max |a - b| = " << (x - y).abs().max().item<double>()
                                       << ", over the tolerance by " << excess;
}

struct AddLnCase {
  const char* name;
  bool residual_in_loss;  // the residual output reaches the loss (else its gradient is undefined)
  bool normed_in_loss;    // the normed output reaches the loss
  bool with_delta;
  c10::ScalarType dtype;  // of delta and of the normed output
  double rtol, atol;
};

void PrintTo(const AddLnCase& c, std::ostream* os) { *os << c.name; }

class AddLayerNormVsLibtorch : public ::testing::TestWithParam<AddLnCase> {};

}  // namespace

// residual = x + delta, normed = layer_norm(residual) in values and in all four gradients,
// against x + delta and torch::layer_norm under libtorch's autograd; odd sizes.
TEST_P(AddLayerNormVsLibtorch, ValuesAndGradients) {
  const AddLnCase& c = GetParam();
  const int64_t rows = 37, cols = 100;
  const double eps = 1e-5;
  torch::manual_seed(31);
  const auto x0 = torch::randn({rows, cols}) * 2 + 0.5, d0 = torch::randn({rows, cols}).to(c.dtype);
  const auto w0 = torch::randn({cols}), b0 = torch::randn({cols});
  const auto gr = torch::randn({rows, cols}), gn = torch::randn({rows, cols});
  auto loss_of = [&](const torch::Tensor& r, const torch::Tensor& n) {
    torch::Tensor loss = torch::zeros({});
    if (c.residual_in_loss) loss = loss + (r * gr).sum();
    if (c.normed_in_loss) loss = loss + (n.to(torch::kFloat32) * gn).sum();
    return loss;
  };
  auto leaf = [](const torch::Tensor& t) { return t.clone().requires_grad_(true); };

  auto x = leaf(x0), d = leaf(d0), w = leaf(w0), b = leaf(b0);
  const auto r = c.with_delta ? x + d : x * 1;
  const auto n = torch::layer_norm(r, {cols}, w, b, eps).to(c.dtype);
  loss_of(r, n).backward();

  for (FusedImpl impl : {FusedImpl::reference, FusedImpl::automatic}) {
    SCOPED_TRACE(impl == FusedImpl::reference ? "reference" : "automatic");
    auto xf = leaf(x0), df = leaf(d0), wf = leaf(w0), bf = leaf(b0);
    auto [rf, nf] = add_layernorm(xf, c.with_delta ? df : torch::Tensor(), wf, bf, eps, c.dtype, impl);
    EXPECT_EQ(rf.scalar_type(), torch::kFloat32);
    EXPECT_EQ(nf.scalar_type(), c.dtype);
    EXPECT_TRUE(tensors_close(rf, r, 1e-6, 1e-6));
    EXPECT_TRUE(tensors_close(nf, n, c.rtol, c.atol));
    loss_of(rf, nf).backward();
    EXPECT_TRUE(tensors_close(xf.grad(), x.grad(), c.rtol, c.atol)) << "d x";
    EXPECT_TRUE(tensors_close(wf.grad(), w.grad(), c.rtol, c.atol)) << "d weight";
    EXPECT_TRUE(tensors_close(bf.grad(), b.grad(), c.rtol, c.atol)) << "d bias";
    if (c.with_delta) {
      ASSERT_TRUE(df.grad().defined());
      EXPECT_EQ(df.grad().scalar_type(), c.dtype);
      EXPECT_TRUE(tensors_close(df.grad(), d.grad(), c.rtol, c.atol)) << "d delta";
    } else {
      EXPECT_FALSE(df.grad().defined());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fused, AddLayerNormVsLibtorch,
    ::testing::Values(AddLnCase{"both_outputs", true, true, true, torch::kFloat32, 1e-4, 1e-5},
                      AddLnCase{"normed_only", false, true, true, torch::kFloat32, 1e-4, 1e-5},
                      AddLnCase{"residual_only", true, false, true, torch::kFloat32, 1e-4, 1e-5},
                      AddLnCase{"no_delta", true, true, false, torch::kFloat32, 1e-4, 1e-5},
                      AddLnCase{"no_delta_normed_only", false, true, false, torch::kFloat32, 1e-4, 1e-5},
                      // one bf16 ulp is 2^-8 relative: a value rounded the other way is still close
                      AddLnCase{"bf16", true, true, true, torch::kBFloat16, 1e-2, 1e-2}),
    [](const ::testing::TestParamInfo<AddLnCase>& info) { return std::string(info.param.name); });

// gelu_tanh(pre + bias) against F::gelu(pre + bias, tanh) under autograd, fp32 and bf16, 3-D.
TEST(Fused, BiasGeluVsLibtorch) {
  namespace F = torch::nn::functional;
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const bool bf16 = dtype == torch::kBFloat16;
    const double rtol = bf16 ? 1e-2 : 1e-5, atol = bf16 ? 1e-2 : 1e-6;
    torch::manual_seed(32);
    const auto p0 = (torch::randn({3, 5, 70}) * 3).to(dtype), b0 = torch::randn({70});
    const auto g = torch::randn({3, 5, 70});
    auto p = p0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
    auto ref = F::gelu(p + b, F::GELUFuncOptions().approximate("tanh")).to(dtype);
    (ref.to(torch::kFloat32) * g).sum().backward();
    for (FusedImpl impl : {FusedImpl::reference, FusedImpl::automatic}) {
      auto pf = p0.clone().requires_grad_(true), bf = b0.clone().requires_grad_(true);
      auto out = bias_gelu(pf, bf, impl);
      EXPECT_EQ(out.scalar_type(), dtype);
      EXPECT_TRUE(tensors_close(out, ref, rtol, atol));
      (out.to(torch::kFloat32) * g).sum().backward();
      EXPECT_TRUE(tensors_close(pf.grad(), p.grad(), rtol, atol)) << "d pre";
      EXPECT_TRUE(tensors_close(bf.grad(), b.grad(), bf16 ? 1e-3 : 1e-5, bf16 ? 1e-3 : 1e-5)) << "d bias";
    }
  }
}

// Autocast must not re-type the ops inside (a guard: Debian's 1.13 CPU autocast lists none of
// them, newer libtorch lists more): under CPU bf16 autocast the results equal those outside it.
TEST(Fused, AutocastDoesNotChangeTheOps) {
  torch::manual_seed(33);
  const auto x = torch::randn({9, 24}), d = torch::randn({9, 24}).to(torch::kBFloat16);
  const auto w = torch::randn({24}), b = torch::randn({24});
  auto [r0, n0] = add_layernorm(x, d, w, b, 1e-5, torch::kBFloat16);
  auto g0 = bias_gelu(x, w);
  Autocast amp(Precision::bf16, torch::kCPU);
  EXPECT_EQ(autocast_dtype_or(c10::DeviceType::CPU, torch::kFloat32), torch::kBFloat16);
  auto [r1, n1] = add_layernorm(x, d, w, b, 1e-5, torch::kBFloat16);
  EXPECT_TRUE(torch::equal(r0, r1));
  EXPECT_TRUE(torch::equal(n0, n1));
  EXPECT_TRUE(torch::equal(g0, bias_gelu(x, w)));
}

TEST(Fused, KernelsAreBuiltOnlyWithACudaCompiler) {
#ifdef MPITRAIN_FUSED_KERNELS
  EXPECT_TRUE(fused_kernels_built());
#else
  EXPECT_FALSE(fused_kernels_built());
#endif
}

// The model with fused_kernels against without, from the same initial parameters: the same loss
// and gradients (with the plain and the fused loss, with dropout drawing the same masks), the
// same parameter names, and the same logits in evaluation; GPT-2 and a Llama (GQA, qkv biases,
// untied head: RMSNorm, SwiGLU and rotary as fused ops, here their ATen reference). fp32 only
// here: under autocast the fused path's norm outputs are bf16 where libtorch's layer_norm keeps
// fp32.
TEST(Model, FusedKernelsMatchTheUnfusedModel) {
  for (bool llama : {false, true}) {
    for (bool fused_loss : {false, true}) {
      for (double dropout : {0.0, 0.1}) {
        SCOPED_TRACE(concat("llama ", llama, " fused_loss ", fused_loss, " dropout ", dropout));
        GPTDims d = small_dims();
        if (llama) {
          d.arch = "llama";
          d.n_head = 4, d.n_kv_head = 2, d.intermediate_size = 48, d.max_position = 16;
          d.qkv_bias = dropout == 0, d.tie_embeddings = false;
          if (dropout > 0) d.head_size = 12, d.qk_norm = true;  // Qwen3-shaped: the fused rotary after the q/k norms
        }
        RunOptions run;
        run.fused_loss = fused_loss;
        d.dropout = dropout;
        torch::manual_seed(41);
        GPT plain(d);
        plain->apply(run);
        run.fused_kernels = true;
        torch::manual_seed(41);
        GPT fused(d);
        fused->apply(run);
        auto x = torch::randint(0, 50, {3, 16}, torch::kLong), y = torch::randint(0, 50, {3, 16}, torch::kLong);
        torch::manual_seed(42);
        auto lp = plain->loss(x, y);
        torch::manual_seed(42);
        auto lf = fused->loss(x, y);
        EXPECT_NEAR(lf.item<double>(), lp.item<double>(), 1e-5);
        lp.backward();
        lf.backward();
        auto pp = plain->named_params(), pf = fused->named_params();
        ASSERT_EQ(pp.size(), pf.size());
        for (size_t i = 0; i < pp.size(); ++i) {
          EXPECT_EQ(pf[i].first, pp[i].first);
          EXPECT_TRUE(tensors_close(pf[i].second.grad(), pp[i].second.grad(), 1e-4, 1e-6)) << pp[i].first;
        }
        plain->eval();
        fused->eval();
        torch::NoGradGuard no_grad;
        EXPECT_TRUE(tensors_close(fused->forward(x), plain->forward(x), 1e-4, 1e-5)) << "eval logits";
      }
    }
  }
}

// Activation checkpointing at shapes where the matmuls span several of the BLAS kernels' blocks
// (256 and 688 wide, 512 rows; test_train's runs are 32 wide): selective's replayed linear layers
// (PyTorch's own mm formulas on the same operands, so equal by construction on every kernel path)
// and full's second runs give bitwise the gradients of no checkpointing, GPT-2 with dropout and a
// Llama with grouped-query attention (whose attention libtorch >= 2 may run as a fused kernel,
// which selective then replays), in fp32 and under bf16 autocast.
TEST(Model, CheckpointingGivesBitwiseTheGradientsAtLargerShapes) {
  for (bool llama : {false, true})
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      SCOPED_TRACE(concat(llama ? "llama " : "gpt2 ", precision_name(precision)));
      GPTDims d;
      d.n_layer = 2, d.n_head = 4, d.n_embd = 256, d.seq_len = 128, d.vocab_size = 300;
      if (llama) {
        d.arch = "llama";
        d.n_kv_head = 2, d.intermediate_size = 688, d.max_position = 128, d.tie_embeddings = false;
      } else {
        d.dropout = 0.1;
      }
      torch::manual_seed(7);
      const auto x = torch::randint(0, 300, {4, 128}, torch::kLong), y = torch::randint(0, 300, {4, 128}, torch::kLong);
      auto grads = [&](RunOptions::Ac ac) {
        RunOptions run;
        run.ac = ac;
        torch::manual_seed(8);
        GPT model(d);
        model->apply(run);
        model->train();
        torch::manual_seed(9);
        torch::Tensor loss;
        {
          Autocast autocast(precision, torch::kCPU);
          loss = model->loss(x, y);
        }
        loss.backward();
        std::vector<std::pair<std::string, torch::Tensor>> out;
        for (auto& [name, p] : model->named_params()) out.emplace_back(name, p.grad());
        return out;
      };
      const auto none = grads(RunOptions::Ac::none);
      for (RunOptions::Ac ac : {RunOptions::Ac::selective, RunOptions::Ac::full}) {
        const int64_t linear_before = replayed_linear_layers();
        const auto got = grads(ac);
        EXPECT_EQ(replayed_linear_layers() - linear_before, ac == RunOptions::Ac::selective ? 2 * (llama ? 7 : 4) : 0);
        ASSERT_EQ(got.size(), none.size());
        for (size_t i = 0; i < none.size(); ++i)
          EXPECT_TRUE(torch::equal(got[i].second, none[i].second))
              << (ac == RunOptions::Ac::full ? "full: " : "selective: ") << none[i].first << " differs by "
              << (got[i].second - none[i].second).abs().max().item<double>();
      }
    }
}

// Under bf16 autocast the fused model still tracks the unfused one (bf16 LayerNorm outputs).
TEST(Model, FusedKernelsUnderBf16AutocastTrackTheUnfusedModel) {
  GPTDims d = small_dims();
  torch::manual_seed(43);
  GPT plain(d);
  torch::manual_seed(43);
  GPT fused(d);
  RunOptions fused_ops;
  fused_ops.fused_kernels = true;
  fused->apply(fused_ops);
  auto x = torch::randint(0, 50, {3, 16}, torch::kLong), y = torch::randint(0, 50, {3, 16}, torch::kLong);
  torch::Tensor lp, lf;
  {
    Autocast amp(Precision::bf16, torch::kCPU);
    lp = plain->loss(x, y);
    lf = fused->loss(x, y);
  }
  EXPECT_NEAR(lf.item<double>(), lp.item<double>(), 2e-2);
  lp.backward();
  lf.backward();
  auto pp = plain->named_params(), pf = fused->named_params();
  for (size_t i = 0; i < pp.size(); ++i) {
    const auto& gp = pp[i].second.grad();
    const auto& gf = pf[i].second.grad();
    ASSERT_TRUE(gf.defined()) << pp[i].first;
    EXPECT_EQ(gf.scalar_type(), torch::kFloat32) << pp[i].first;
    // Direction, not elementwise values: bf16 noise is large for tiny gradient entries.
    const double cos = (gf * gp).sum().item<double>() / (gf.norm() * gp.norm()).item<double>();
    EXPECT_GT(cos, 0.99) << pp[i].first;
  }
}

// Pipeline parallelism's stages (model.h's stage_forward / stage_loss, pipeline.h): a 3-block GPT-2
// and a tied Qwen3 cut into 2 and 3 stages (and a 4-block one into 2 stages of 2 interleaved chunks
// each: blocks 0 and 2 on the first, 1 and 3 on the second) hold the whole model's parameters under the same names
// with the same initial values; chaining the stages' forwards (each stage's input a new leaf, as
// the received activation is) gives the whole model's loss bitwise, and each stage's backward,
// fed the next stage's input gradient, every parameter's gradient bitwise, but the tied
// embedding's, whose two halves (the first stage's and the last's) sum to the whole model's.
TEST(Model, PipelineStagesChainToTheWholeModel) {
  for (const char* family : {"gpt2", "qwen3"}) {
    // (pp 2 with first = 2: parallel.pp_first_stage_blocks, blocks 0-1 on the first stage, 2 on the last)
    for (const auto& [pp, v, first] : {std::tuple<int64_t, int64_t, int64_t>{2, 1, 0}, {3, 1, 0}, {2, 2, 0}, {2, 1, 2}}) {
      GPTDims d = small_dims();
      d.n_layer = v > 1 ? 4 : 3;
      if (std::string(family) == "qwen3") {
        d.arch = "llama", d.family = "qwen3", d.n_kv_head = 1, d.intermediate_size = 48, d.qk_norm = true;
      }
      complete_dims(d);
      torch::manual_seed(7);
      GPT whole(d);
      std::vector<GPT> stages;
      for (int64_t s = 0; s < pp; ++s) {
        GPTDims at = d;
        at.pp = pp, at.pp_stage = s, at.pp_virtual = v, at.pp_first_blocks = first;
        if (first > 0) {
          EXPECT_EQ(at.chunk_end(0) - at.chunk_begin(0), s == 0 ? first : d.n_layer - first);
        }
        torch::manual_seed(7);
        stages.emplace_back(at);
      }
      std::map<std::string, torch::Tensor> all;
      for (const auto& [name, p] : whole->named_params()) all.emplace(name, p);
      size_t held = 0;
      for (auto& stage : stages)
        for (const auto& [name, p] : stage->named_params()) {
          ASSERT_TRUE(all.count(name)) << family << " pp " << pp << ": " << name;
          EXPECT_TRUE(torch::equal(p, all[name])) << name;
          ++held;
        }
      EXPECT_EQ(held, all.size() + 1) << "every parameter once, the tied embedding twice";
      const torch::Tensor x = torch::randint(d.vocab_size, {2, d.seq_len}, torch::kLong);
      const torch::Tensor y = torch::randint(d.vocab_size, {2, d.seq_len}, torch::kLong);
      const torch::Tensor expected = whole->loss(x, y);
      expected.backward();
      std::vector<torch::Tensor> ins, outs;
      torch::Tensor in = x;
      for (int64_t u = 0; u < pp * v; ++u) {  // the virtual stages in order: chunk u / pp of stage u % pp
        ins.push_back(in);
        torch::Tensor out = stages[static_cast<size_t>(u % pp)]->stage_forward(in, u / pp);
        if (u + 1 == pp * v) out = stages.back()->stage_loss(out, y);
        outs.push_back(out);
        in = out.detach().requires_grad_(true);
      }
      EXPECT_TRUE(torch::equal(outs.back(), expected)) << family << " pp " << pp;
      outs.back().backward();
      for (int64_t u = pp * v - 2; u >= 0; --u) outs[static_cast<size_t>(u)].backward(ins[static_cast<size_t>(u) + 1].grad());
      torch::Tensor tied = torch::zeros_like(all["wte.weight"]);
      for (auto& stage : stages)
        for (const auto& [name, p] : stage->named_params()) {
          if (name == "wte.weight") {
            tied += p.grad();
            continue;
          }
          EXPECT_TRUE(torch::equal(p.grad(), all[name].grad())) << family << " pp " << pp << ": " << name;
        }
      EXPECT_TRUE(torch::allclose(tied, all["wte.weight"].grad(), 1e-6, 1e-7)) << family << " pp " << pp;
    }
  }
}

// fn(schedule, pp, v, m) for each schedule at pp 2-4: gpipe and 1f1b with 1, 3 and 8 micro-batches,
// interleaved with 2 and 3 chunks per rank and 1-3 groups of pp micro-batches.
template <class Fn>
void for_each_schedule(Fn&& fn) {
  for (const std::string kind : {"gpipe", "1f1b", "interleaved"})
    for (int64_t pp : {2, 3, 4})
      for (int64_t v : kind == "interleaved" ? std::vector<int64_t>{2, 3} : std::vector<int64_t>{1})
        for (int64_t m : kind == "interleaved" ? std::vector<int64_t>{pp, 2 * pp, 3 * pp} : std::vector<int64_t>{1, 3, 8}) {
          SCOPED_TRACE(concat(kind, " pp ", pp, " v ", v, " m ", m));
          fn(kind, pp, v, m);
        }
}

// The schedules: every chunk's forward and backward of every micro-batch once, each chunk's
// forwards and its backwards in micro-batch order (so that gradients accumulate in the same order
// under each schedule); 1f1b's stage s runs pp - 1 - s forwards ahead and so holds at most pp - s
// micro-batches' activations, gpipe all of them, interleaved at most its 2 (pp - 1 - s) + (v - 1)
// pp forwards ahead and one; and a virtual stage's m-th forward can run once the virtual stage
// before has run its own (no schedule waits on a later step of an earlier stage: simulated, the
// interleaved ranks' chunks going round the pipeline).
TEST(Pipeline, SchedulesRunEachMicroBatchOnceInOrderAndDoNotDeadlock) {
  for_each_schedule([](const std::string& kind, int64_t pp, int64_t v, int64_t m) {
    const int64_t P = pp * v;
    std::vector<std::vector<PipeStep>> steps;
    for (int64_t s = 0; s < pp; ++s) {
      steps.push_back(pipeline_schedule(kind, pp, s, m, v));
      const auto& got = steps.back();
      ASSERT_EQ(got.size(), static_cast<size_t>(2 * m * v));
      std::vector<int64_t> next_forward(static_cast<size_t>(v)), next_backward(static_cast<size_t>(v));
      int64_t held = 0, most = 0;
      for (const PipeStep& p : got) {
        ASSERT_TRUE(p.chunk >= 0 && p.chunk < v);
        const auto c = static_cast<size_t>(p.chunk);
        if (p.forward) {
          EXPECT_EQ(p.micro, next_forward[c]++);
          most = std::max(most, ++held);
        } else {
          EXPECT_EQ(p.micro, next_backward[c]++);
          EXPECT_LT(p.micro, next_forward[c]) << "a backward before its forward";
          --held;
        }
      }
      const int64_t expected = kind == "gpipe" ? m
                               : kind == "1f1b" ? std::min(m, pp - s)
                                                : std::min(m * v, m == pp ? m * v : 2 * (pp - 1 - s) + (v - 1) * pp + 1);
      EXPECT_EQ(most, expected) << "stage " << s;
    }
    // Run every stage's steps as far as its inputs allow: F(u, m) needs F(u - 1, m) of the
    // virtual stage u - 1 before; B(u, m) needs B(u + 1, m) (the last: its own F).
    std::vector<size_t> at(static_cast<size_t>(pp), 0);
    std::vector<std::vector<bool>> fwd(static_cast<size_t>(P), std::vector<bool>(static_cast<size_t>(m))), bwd = fwd;
    for (bool moved = true; moved;) {
      moved = false;
      for (int64_t s = 0; s < pp; ++s) {
        const auto r = static_cast<size_t>(s);
        if (at[r] == steps[r].size()) continue;
        const PipeStep& p = steps[r][at[r]];
        const auto u = static_cast<size_t>(p.chunk * pp + s), k = static_cast<size_t>(p.micro);
        const bool ready = p.forward ? (u == 0 || fwd[u - 1][k]) : (u + 1 == static_cast<size_t>(P) ? fwd[u][k] : bwd[u + 1][k]);
        if (!ready) continue;
        (p.forward ? fwd : bwd)[u][k] = true;
        ++at[r];
        moved = true;
      }
    }
    for (int64_t s = 0; s < pp; ++s) EXPECT_EQ(at[static_cast<size_t>(s)], steps[static_cast<size_t>(s)].size()) << "deadlocks";
  });
  EXPECT_DOUBLE_EQ(pipeline_bubble(4, 8), 3.0 / 8);
  EXPECT_DOUBLE_EQ(pipeline_bubble(4, 8, 2), 3.0 / 16);
}

// The pipeline's channels match no tags (NCCL has none): on every channel (a kind of transfer from
// one stage to its neighbour) the receiving stage must post its receives in the order the sending
// stage sends, under every schedule (interleaved: the chunks' transfers round from the last stage
// to the first too); and the channels carry every micro-batch across each of the P - 1 boundaries
// between virtual stages once each way.
TEST(Pipeline, EveryChannelReceivesInTheOrderItsSenderSends) {
  for_each_schedule([](const std::string& kind, int64_t pp, int64_t v, int64_t m) {
    size_t crossings = 0;
    for (const ChannelOrder& c : pipeline_channel_orders(kind, pp, m, v)) {
      EXPECT_EQ(c.sent, c.received) << (c.kind == PipeChannels::activations ? "activations" : "gradients")
                                    << " from stage " << c.from;
      crossings += c.sent.size();
    }
    EXPECT_EQ(crossings, static_cast<size_t>(2 * m * (pp * v - 1)));
  });
}

// The schedule simulated from per-chunk times (plan's bubble): equal stages without transfer
// time take Megatron's (m + (pp - 1) / v) (F + B) on the first stage, which is busy m (F + B) of
// it, for gpipe, 1f1b and interleaved (each chunk F / v, B / v); a transfer delays the pipeline; a
// slower stage makes the others wait.
TEST(Pipeline, TheSimulatedStepHasTheBubbleOfTheSchedule) {
  const double F = 1, B = 2;
  for (const std::string kind : {"gpipe", "1f1b", "interleaved"})
    for (int64_t pp : {2, 4}) {
      const int64_t v = kind == "interleaved" ? 2 : 1, m = 2 * pp;
      SCOPED_TRACE(concat(kind, " pp ", pp));
      const std::vector<std::vector<double>> f(static_cast<size_t>(pp), std::vector<double>(static_cast<size_t>(v), F / v)),
          b(static_cast<size_t>(pp), std::vector<double>(static_cast<size_t>(v), B / v));
      const PipelineTimes t = simulate_pipeline(kind, m, f, b, std::vector<double>(static_cast<size_t>(pp), 0.0));
      EXPECT_NEAR(t.end[0], (m + static_cast<double>(pp - 1) / v) * (F + B), 1e-9);
      EXPECT_NEAR(t.busy[0], m * (F + B), 1e-9);
      EXPECT_NEAR(1 - t.busy[0] / t.end[0], static_cast<double>(pp - 1) / (v * m + pp - 1), 1e-9);
      const PipelineTimes slow = simulate_pipeline(kind, m, f, b, std::vector<double>(static_cast<size_t>(pp), 0.25));
      EXPECT_GT(slow.end[0], t.end[0]);
      auto heavy = f;
      heavy[1][0] *= 3;
      EXPECT_GT(simulate_pipeline(kind, m, heavy, b, std::vector<double>(static_cast<size_t>(pp), 0.0)).end[0], t.end[0]);
    }
}
