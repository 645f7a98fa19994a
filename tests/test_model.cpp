// The GPT model: GPT-2 124M parameter count, tied embeddings, initialisation, causality, and
// that the tiny model can overfit one batch (the loss can go to ~0).
#include <gtest/gtest.h>

#include "mpitrain/config.h"
#include "mpitrain/error.h"
#include "mpitrain/model.h"
#include "mpitrain/optim.h"

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
  d.fused_loss = true;
  torch::manual_seed(5);
  GPT fused(d);
  d.fused_loss = false;
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
