// Tensor parallelism (tensor_parallel.h) under a real mpirun (-np 2 and -np 4), proven by
// equivalence with the dense model on every rank:
//  - a GPT built from the same seed and sharded by GPT::parallelize holds exactly the shards of
//    the dense model's parameters (tp_shard), for tp = 2 (groups of consecutive ranks) and tp = 4
//    (-np 4); a deferred one (ZeRO-3's) parallelized, then initialised, draws the same shards;
//  - on the same batch its loss is the dense loss, its local logits are the dense logits' columns
//    of its vocabulary slice, and after backward every parameter's gradient is the shard of the
//    dense gradient (replicated parameters: the whole dense gradient on every tp rank), with the
//    plain, with the fused block ops (the fused ops' ATen reference on the CPU) and with the
//    fused chunked loss (linear_cross_entropy in its vocabulary-parallel form, several chunks);
//  - vocab_parallel_cross_entropy equals cross_entropy over the whole logits, targets in every
//    rank's slice.
// Tolerance: the tp model sums the same fp32 products in another grouping (partial matmuls over
// E/tp or 4E/tp inputs, then an all-reduce), so values agree to a few ulps of the largest
// partial sums: 1e-5 relative to the tensor's scale, far below the 1e-2 that a wrong shard, a
// missing or doubled all-reduce, or a gradient counted tp times would give (checked below too).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "mpitrain/checkpoint.h"
#include "mpitrain/comm.h"
#include "mpitrain/hf_format.h"
#include "mpitrain/model.h"
#include "mpitrain/tensor_parallel.h"
#include "mpi_world.h"
#include "npy_writer.h"

using namespace mpitrain;

namespace {

// The tp group of this rank: `tp` consecutive ranks of the world.
struct TpGroup {
  MpiComm group;
  std::unique_ptr<Communicator> comm;
  explicit TpGroup(int tp) : group(mpi::split(mpi::world(), world_rank() / tp, world_rank())) {
    comm = make_mpi_communicator(group);
  }
  ~TpGroup() {
    comm.reset();
    mpi::free(group);
  }
};

GPTDims small_dims() {
  GPTDims d;
  d.n_layer = 2;
  d.n_head = 4;
  d.n_embd = 32;
  d.seq_len = 16;
  d.vocab_size = 64;
  return d;
}

// The fused paths a model runs with (the tp model's loss in chunks of `rows`).
RunOptions fused_paths(bool kernels, bool loss, int64_t rows = 0) {
  RunOptions run;
  run.fused_kernels = kernels, run.fused_loss = loss, run.fused_loss_rows = rows;
  return run;
}

// Largest |a - b| relative to b's largest magnitude.
double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-30);
  return (a - b).abs().max().item<double>() / scale;
}

constexpr double kTolerance = 1e-5;

}  // namespace

TEST(TensorParallel, ShardedGptEqualsTheDenseModelInLossLogitsAndGradients) {
  const int world = world_size();
  for (int tp : {2, 4}) {
    if (world % tp != 0) continue;
    TpGroup group(tp);
    const int64_t r = group.comm->rank();
    for (int variant = 0; variant < 10; ++variant) {
      // 0: plain; 1: fused block ops; 2: the fused chunked loss (chunks of 7 rows here); 3: a Llama
      // (GQA with tp kv heads, SwiGLU, rotary with llama3 scaling, q/k/v biases, untied head); 4: that
      // Llama with the fused loss; 5: that Llama with the fused block ops (RMSNorm, SwiGLU, rotary);
      // 6: a Qwen3-shaped Llama (heads of 12 at width 32, q/k norms whose weights every tp rank
      // holds whole while normalising only its own heads, so their gradient is summed over the
      // group; no biases, tied); 7: that with the fused block ops; 8: a Gemma 2 (a window of 5 that cuts,
      // soft caps that bend these scores and logits, its query scale, four norms x (1 + w) whole on
      // every rank); 9: a Gemma 3 (q/k norms x (1 + w), five local layers of six rotating by a base
      // of their own, the global one with linear scaling)
      const bool fused = variant == 1 || variant == 5 || variant == 7, fused_loss = variant == 2 || variant == 4;
      const bool llama = variant >= 3, qwen3 = variant == 6 || variant == 7, gemma2 = variant == 8, gemma3 = variant == 9;
      SCOPED_TRACE(testing::Message() << "tp " << tp << ", fused block ops " << fused << ", fused loss " << fused_loss
                                      << ", llama " << llama << ", qwen3 " << qwen3 << ", gemma2 " << gemma2
                                      << ", gemma3 " << gemma3);
      GPTDims dense_dims = small_dims();
      if (llama) {
        dense_dims.arch = "llama";
        dense_dims.n_kv_head = tp;  // one kv head per rank, serving 4 / tp query heads
        dense_dims.intermediate_size = 24;
        dense_dims.rope_theta = 100, dense_dims.rope_scaling = "llama3", dense_dims.rope_factor = 4;
        dense_dims.rope_low_freq_factor = 1, dense_dims.rope_high_freq_factor = 4, dense_dims.rope_original_max_position = 32;
        dense_dims.qkv_bias = true, dense_dims.tie_embeddings = false;
        if (qwen3) {
          dense_dims.qkv_bias = false, dense_dims.tie_embeddings = true;
          dense_dims.head_size = 12, dense_dims.qk_norm = true;
        }
        if (gemma2 || gemma3) {
          dense_dims.family = gemma2 ? "gemma2" : "gemma3";
          dense_dims.qkv_bias = false, dense_dims.tie_embeddings = true, dense_dims.rope_scaling = "none";
          dense_dims.rope_factor = dense_dims.rope_low_freq_factor = dense_dims.rope_high_freq_factor = 0;
          dense_dims.rope_original_max_position = 0;
          dense_dims.head_size = 12, dense_dims.sliding_window = 5, dense_dims.query_pre_attn_scalar = 10;
          if (gemma2) dense_dims.attn_softcap = 0.5, dense_dims.final_softcap = 1;
          if (gemma3) {
            dense_dims.n_layer = 6, dense_dims.qk_norm = true, dense_dims.rope_local_theta = 10;
            dense_dims.rope_scaling = "linear", dense_dims.rope_factor = 4;
          }
        }
      }
      torch::manual_seed(7);
      GPT dense(dense_dims);
      dense->apply(fused_paths(fused, fused_loss));
      torch::manual_seed(7);
      GPT sharded(dense_dims);
      sharded->parallelize(TpPlace{tp, r, group.comm.get()});
      sharded->apply(fused_paths(fused, fused_loss, 7));

      const auto whole = dense->named_params(), local = sharded->named_params();
      ASSERT_EQ(local.size(), whole.size());
      for (size_t i = 0; i < whole.size(); ++i) {
        ASSERT_EQ(local[i].first, whole[i].first);
        EXPECT_TRUE(torch::equal(local[i].second, tp_shard(whole[i].second, dense->tp_split(whole[i].first), r, tp)))
            << whole[i].first;
      }

      // The same batch on every rank.
      torch::manual_seed(11);
      torch::Tensor x = torch::randint(dense_dims.vocab_size, {3, dense_dims.seq_len}, torch::kLong);
      torch::Tensor y = torch::randint(dense_dims.vocab_size, {3, dense_dims.seq_len}, torch::kLong);

      torch::Tensor dense_loss = dense->loss(x, y), tp_loss = sharded->loss(x, y);
      EXPECT_NEAR(tp_loss.item<double>(), dense_loss.item<double>(), kTolerance * dense_loss.item<double>());
      {
        torch::NoGradGuard no_grad;
        const int64_t v = dense_dims.vocab_size / tp;
        EXPECT_LT(rel_diff(sharded->forward(x), dense->forward(x).narrow(2, r * v, v)), kTolerance);
        const double eval_loss = dense->loss(x, y).item<double>();  // the loss alone (evaluation)
        EXPECT_NEAR(sharded->loss(x, y).item<double>(), eval_loss, kTolerance * eval_loss);
      }
      dense_loss.backward();
      tp_loss.backward();
      double worst = 0;
      for (size_t i = 0; i < whole.size(); ++i) {
        const torch::Tensor want = tp_shard(whole[i].second.grad(), dense->tp_split(whole[i].first), r, tp);
        const torch::Tensor got = local[i].second.grad();
        ASSERT_TRUE(got.defined()) << whole[i].first;
        const double d = rel_diff(got, want);
        worst = std::max(worst, d);
        EXPECT_LT(d, kTolerance) << whole[i].first;
        // A gradient counted tp times, or missing another rank's part, is far outside it.
        EXPECT_GT(rel_diff(got * 2, want), 100 * kTolerance) << whole[i].first;
      }
      if (world_rank() == 0)
        std::printf("[ info ] tp %d, fused ops %d, fused loss %d, llama %d, qwen3 %d, gemma %d: loss %.7f vs dense %.7f, "
                    "largest relative gradient difference %.2g\n",
                    tp, fused, fused_loss, llama, qwen3, gemma2 ? 2 : gemma3 ? 3 : 0, tp_loss.item<double>(),
                    dense_loss.item<double>(), worst);
    }
  }
}

// Automatic vocabulary padding (ModelArgs::vocab_live): 37 tokens in 64 rows. The padded model
// draws the tokens' rows as the unpadded one does and zeroes the rest, so every parameter is the
// unpadded model's (plus zero rows); its loss is the unpadded loss and its gradients are the
// unpadded gradients (plus zero rows): the padding is outside the loss. Sharded over tp 2 (rank 1
// holds 5 tokens and 27 padding rows) and tp 4 (rank 2 holds 5 tokens, rank 3 only padding), it
// equals the padded dense model as any sharded model does. Plain and fused loss, GPT-2 and a
// Llama with an untied output layer.
TEST(TensorParallel, PaddedVocabularyIsOutsideTheLossOnEveryLayout) {
  const int world = world_size();
  constexpr int64_t kTokens = 37, kRows = 64;
  for (int tp : {2, 4}) {
    if (world % tp != 0) continue;
    TpGroup group(tp);
    const int64_t r = group.comm->rank();
    for (int variant = 0; variant < 4; ++variant) {
      const bool fused_loss = variant % 2 == 1, llama = variant >= 2;
      SCOPED_TRACE(testing::Message() << "tp " << tp << ", fused loss " << fused_loss << ", llama " << llama);
      GPTDims unpadded = small_dims();
      unpadded.vocab_size = kTokens;
      if (llama) {
        unpadded.arch = "llama";
        unpadded.n_kv_head = tp;
        unpadded.intermediate_size = 24;
        unpadded.tie_embeddings = false;
      }
      GPTDims padded = unpadded;
      padded.vocab_size = kRows;
      padded.vocab_live = kTokens;
      torch::manual_seed(5);
      GPT plain(unpadded);
      plain->apply(fused_paths(false, fused_loss));
      torch::manual_seed(5);
      GPT dense(padded);
      dense->apply(fused_paths(false, fused_loss));
      torch::manual_seed(5);
      GPT sharded(padded);
      sharded->parallelize(TpPlace{tp, r, group.comm.get()});
      sharded->apply(fused_paths(false, fused_loss, 7));

      const auto want = plain->named_params(), whole = dense->named_params(), local = sharded->named_params();
      ASSERT_EQ(whole.size(), want.size());
      auto is_vocab = [](const std::string& name) { return name == "wte.weight" || name == "lm_head.weight"; };
      for (size_t i = 0; i < whole.size(); ++i) {
        const torch::Tensor& w = whole[i].second;
        if (is_vocab(whole[i].first)) {
          EXPECT_TRUE(torch::equal(w.narrow(0, 0, kTokens), want[i].second)) << whole[i].first;
          EXPECT_EQ(w.narrow(0, kTokens, kRows - kTokens).abs().max().item<float>(), 0.0f) << whole[i].first;
        } else {
          EXPECT_TRUE(torch::equal(w, want[i].second)) << whole[i].first;
        }
        EXPECT_TRUE(torch::equal(local[i].second, tp_shard(w, dense->tp_split(whole[i].first), r, tp))) << whole[i].first;
      }
      EXPECT_EQ(sharded->live_rows(), std::clamp<int64_t>(kTokens - r * (kRows / tp), 0, kRows / tp));

      torch::manual_seed(13);
      torch::Tensor x = torch::randint(kTokens, {3, unpadded.seq_len}, torch::kLong);
      torch::Tensor y = torch::randint(kTokens, {3, unpadded.seq_len}, torch::kLong);
      torch::Tensor plain_loss = plain->loss(x, y), dense_loss = dense->loss(x, y), tp_loss = sharded->loss(x, y);
      EXPECT_NEAR(dense_loss.item<double>(), plain_loss.item<double>(), kTolerance * plain_loss.item<double>());
      EXPECT_NEAR(tp_loss.item<double>(), plain_loss.item<double>(), kTolerance * plain_loss.item<double>());
      {
        torch::NoGradGuard no_grad;
        EXPECT_EQ(dense->forward(x).size(2), kTokens);  // no logits for the padding
        EXPECT_LT(rel_diff(dense->forward(x), plain->forward(x)), kTolerance);
      }
      plain_loss.backward();
      dense_loss.backward();
      tp_loss.backward();
      for (size_t i = 0; i < whole.size(); ++i) {
        const torch::Tensor g = whole[i].second.grad();
        ASSERT_TRUE(g.defined()) << whole[i].first;
        if (is_vocab(whole[i].first)) {
          EXPECT_LT(rel_diff(g.narrow(0, 0, kTokens), want[i].second.grad()), kTolerance) << whole[i].first;
          EXPECT_EQ(g.narrow(0, kTokens, kRows - kTokens).abs().max().item<float>(), 0.0f) << whole[i].first;
        } else {
          EXPECT_LT(rel_diff(g, want[i].second.grad()), kTolerance) << whole[i].first;
        }
        const torch::Tensor got = local[i].second.grad();
        ASSERT_TRUE(got.defined()) << whole[i].first;
        // Relative to the whole gradient's scale: a shard of padding rows has an all-zero gradient.
        const double scale = std::max(g.abs().max().item<double>(), 1e-30);
        EXPECT_LT((got - tp_shard(g, dense->tp_split(whole[i].first), r, tp)).abs().max().item<double>() / scale, kTolerance)
            << whole[i].first;
      }
    }
  }
}

TEST(TensorParallel, VocabParallelCrossEntropyEqualsTheWholeLogits) {
  const int tp = world_size();
  TpGroup group(tp);
  const int64_t r = group.comm->rank(), v = 8 * tp;
  torch::manual_seed(3);
  torch::Tensor logits = (torch::randn({40, v}) * 4).requires_grad_(true);
  torch::Tensor targets = torch::arange(40, torch::kLong) % v;  // every rank's slice is hit
  torch::Tensor want = torch::nn::functional::cross_entropy(logits, targets);
  want.backward();
  torch::Tensor local = logits.detach().narrow(1, r * 8, 8).clone().requires_grad_(true);
  torch::Tensor got = vocab_parallel_cross_entropy(local, targets, r * 8, *group.comm);
  EXPECT_NEAR(got.item<double>(), want.item<double>(), kTolerance * want.item<double>());
  got.backward();
  EXPECT_LT(rel_diff(local.grad(), logits.grad().narrow(1, r * 8, 8)), kTolerance);
}

// tp_runs: any range of a shard's flat elements maps to runs of the whole parameter that hold the
// same values, for every split, rank and (ranges cut anywhere) start and length.
TEST(TensorParallel, ShardRangesMapToTheWholeParametersElements) {
  const int64_t size = 4;
  const std::vector<std::pair<TpSplit, std::vector<int64_t>>> cases = {
      {TpSplit::rows, {16, 6}}, {TpSplit::rows, {24}},  {TpSplit::qkv_rows, {24, 5}}, {TpSplit::qkv_rows, {12}},
      {TpSplit::cols, {5, 8}},  {TpSplit::replicated, {7, 3}}};
  for (const auto& [split, shape] : cases) {
    const torch::Tensor whole = torch::arange(c10::multiply_integers(shape), torch::kFloat32).view(shape);
    const torch::Tensor flat = whole.reshape({-1});
    for (int64_t r = 0; r < size; ++r) {
      const torch::Tensor shard = tp_shard(whole, split, r, size).contiguous().view({-1});
      for (int64_t begin = 0; begin < shard.numel(); begin += 3)
        for (int64_t length : {int64_t{1}, int64_t{4}, shard.numel() - begin}) {
          if (begin + length > shard.numel()) continue;
          int64_t covered = 0;
          for (const TpRun& run : tp_runs(split, tp_shard(whole, split, r, size).sizes(), r, size, begin, length)) {
            ASSERT_EQ(run.local, covered);
            EXPECT_TRUE(torch::equal(flat.narrow(0, run.whole, run.length), shard.narrow(0, begin + run.local, run.length)))
                << "split " << static_cast<int>(split) << " rank " << r << " begin " << begin << " length " << length;
            covered += run.length;
          }
          EXPECT_EQ(covered, length);
        }
    }
  }
}

// model.init_from under tensor parallelism: each rank of a tp group reads its shards of the whole
// tensors in the files itself (no whole copy on rank 0, no broadcast of whole tensors): a block
// of rows read alone (Llama's q/k/v/gate/up, the vocabulary), or a whole tensor read and cut
// (row-parallel c_proj by columns, GPT-2's transposed Conv1D c_attn as [q; k; v]). For Hugging
// Face safetensors (one file and sharded with an index) and .npy directories, GPT-2 and an
// untied Llama with q/k/v biases: every shard bitwise the dense model's.
TEST(TensorParallel, EachRankReadsItsShardsOfTheInitialWeightFiles) {
  namespace fs = std::filesystem;
  const int world = world_size();
  char buf[256] = {};
  if (world_rank() == 0) {
    char tmpl[] = "/tmp/mpitrain-tp-init-XXXXXX";
    std::snprintf(buf, sizeof buf, "%s", mkdtemp(tmpl));
  }
  mpi::broadcast(buf, sizeof buf, 0, mpi::world());
  const std::string root = buf;
  for (bool llama : {false, true}) {
    GPTDims dense_dims = small_dims();
    if (llama) {
      dense_dims.arch = "llama";
      dense_dims.n_kv_head = 4, dense_dims.intermediate_size = 24, dense_dims.max_position = 16;
      dense_dims.qkv_bias = true, dense_dims.tie_embeddings = false;
    }
    torch::manual_seed(7);
    GPT dense(dense_dims);
    const std::string hf = concat(root, "/hf-", llama), sharded_hf = concat(root, "/hf-sharded-", llama),
                      npy = concat(root, "/npy-", llama);
    if (world_rank() == 0) {
      write_hf_model(hf, dense, 0);
      HfWriteOptions small_shards;
      small_shards.max_shard_bytes = 20000;
      write_hf_model(sharded_hf, dense, 0, small_shards);
      fs::create_directories(npy);
      for (const auto& [name, p] : dense->named_params()) npy_test::write_npy_tensor(npy + "/" + name + ".npy", p);
    }
    mpi::barrier(mpi::world());
    ASSERT_TRUE(fs::exists(sharded_hf + "/model.safetensors.index.json"));
    for (int tp : {2, 4}) {
      if (world % tp != 0) continue;
      TpGroup group(tp);
      const int64_t r = group.comm->rank();
      const TpPlace place{tp, r, group.comm.get()};
      const auto whole = dense->named_params();
      for (const std::string& from : {"hf:" + hf, "hf:" + sharded_hf, npy}) {
        SCOPED_TRACE(testing::Message() << (llama ? "llama" : "gpt2") << ", tp " << tp << ", " << from);
        torch::manual_seed(99);  // other values than the files'
        GPT sharded(dense_dims);
        sharded->parallelize(place);
        EXPECT_EQ(load_initial_weights(from, sharded), static_cast<int64_t>(sharded->named_params().size()));
        const auto local = sharded->named_params();
        for (size_t i = 0; i < whole.size(); ++i)
          EXPECT_TRUE(torch::equal(local[i].second, tp_shard(whole[i].second, dense->tp_split(whole[i].first), r, tp)))
              << whole[i].first;
        // ZeRO-3's way: a model without values, the files read one parameter at a time.
        GPT empty(dense_dims, /*deferred=*/true);
        empty->parallelize(place);
        const auto files = open_initial_weights(from, empty);
        ASSERT_EQ(files->size(), whole.size());
        for (size_t i = 0; i < whole.size(); ++i)
          EXPECT_TRUE(torch::equal(files->read(i), local[i].second)) << "read one at a time: " << whole[i].first;
      }
      // A deferred tp rank draws, one parameter at a time, its shards of the dense model's draws:
      // what a tp rank made whole holds, bitwise.
      torch::manual_seed(7);
      GPT deferred(dense_dims, /*deferred=*/true);
      deferred->parallelize(place);
      size_t seen = 0;
      deferred->initialize([&](size_t k, const torch::Tensor& v) {
        ASSERT_EQ(k, seen++);
        EXPECT_TRUE(torch::equal(v, tp_shard(whole.at(k).second, dense->tp_split(whole[k].first), r, tp)))
            << "deferred, tp " << tp << ": " << whole[k].first;
      });
      EXPECT_EQ(seen, whole.size());
    }
  }
  mpi::barrier(mpi::world());
  if (world_rank() == 0) fs::remove_all(root);
}
