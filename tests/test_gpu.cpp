// GPU tests: the NCCL backend, bf16 autocast and fp16 loss scaling on CUDA, fused AdamW against
// the CPU path, checkpoints moving between GPU and CPU, the fused block kernels (GPT-2's and
// Llama's) against their ATen reference (model.fused_kernels). Compiled in every build; each test is
// skipped, with a message, where no CUDA device is visible (CTest then shows "Skipped").
// On a GPU machine: mpirun -np 1 build/tests/test_gpu
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>

#include "temp_dir.h"
#include "mpitrain/amp.h"
#include "mpitrain/checkpoint.h"
#include "mpitrain/comm.h"
#include "mpitrain/fused_ops.h"
#include "mpitrain/model.h"
#include "mpitrain/optim.h"
#include "zero3_probe.h"

using namespace mpitrain;

#define REQUIRE_CUDA()                                                                          \
  if (!torch::cuda::is_available())                                                             \
  GTEST_SKIP() << "no CUDA device visible (CPU build of libtorch, or no GPU): GPU test skipped"

namespace {

const torch::Device kGpu(torch::kCUDA, 0);

GPTDims tiny_dims() {
  GPTDims d;
  d.n_layer = 2;
  d.n_head = 2;
  d.n_embd = 64;
  d.seq_len = 32;
  d.vocab_size = 96;
  return d;
}

}  // namespace

TEST(Gpu, NcclCommunicator) {
  REQUIRE_CUDA();
  if (!have_nccl()) GTEST_SKIP() << "this build has no NCCL backend: skipped";
  auto c = make_communicator("nccl", mpi::world(), kGpu);
  ASSERT_EQ(c->name(), "nccl");
  const int n = c->size(), r = c->rank();
  auto t = torch::full({1000}, static_cast<float>(r + 1), kGpu);
  c->all_reduce(t, ReduceOp::sum);
  EXPECT_TRUE(torch::all(t == n * (n + 1) / 2.0f).item<bool>());
  auto a = torch::full({7}, static_cast<double>(r), torch::dtype(torch::kFloat64).device(kGpu));
  auto work = c->all_reduce_async(a, ReduceOp::avg);
  work->wait();
  EXPECT_DOUBLE_EQ(a[0].item<double>(), (n - 1) / 2.0);
  auto b = torch::full({5}, static_cast<float>(r * 10), torch::dtype(torch::kBFloat16).device(kGpu));
  c->broadcast(b, 0);
  EXPECT_TRUE(torch::all(b == 0).item<bool>());
  auto in = torch::full({3}, static_cast<float>(r), kGpu);
  auto out = torch::empty({3 * n}, kGpu);
  c->all_gather(in, out);
  for (int k = 0; k < n; ++k) EXPECT_EQ(out[3 * k].item<float>(), static_cast<float>(k));
  auto gathered = torch::empty({3 * n}, kGpu);  // ZeRO-3's prefetch: on the communication stream
  c->all_gather_async(in, gathered)->wait();
  EXPECT_TRUE(torch::equal(gathered, out));
  auto cpu = torch::ones({4}, torch::kFloat64);  // CPU tensors go through MPI
  c->all_reduce(cpu, ReduceOp::sum);
  EXPECT_EQ(cpu[0].item<double>(), n);
  c->barrier();
}

TEST(Gpu, Bf16AutocastTrainsWithFp32MasterWeights) {
  REQUIRE_CUDA();
  torch::manual_seed(1);
  GPT model(tiny_dims());
  model->to(kGpu);
  OptimConfig oc;
  oc.lr = 3e-3;
  oc.weight_decay = 0;
  AdamW opt(model->named_params(), oc);
  auto x = torch::randint(0, 96, {4, 32}, torch::dtype(torch::kLong).device(kGpu));
  auto y = torch::randint(0, 96, {4, 32}, torch::dtype(torch::kLong).device(kGpu));
  double first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    torch::Tensor loss;
    {
      Autocast ac(Precision::bf16, kGpu);
      loss = model->loss(x, y);
    }
    loss.backward();
    opt.step(oc.lr);
    opt.zero_grad();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first / 2) << first << " -> " << last;
  for (auto& [name, p] : model->named_params()) EXPECT_EQ(p.scalar_type(), torch::kFloat32) << name;
}

TEST(Gpu, Fp16LossScalerSkipsOverflowedSteps) {
  REQUIRE_CUDA();
  auto p = torch::zeros({8}, kGpu).requires_grad_(true);
  LossScaler scaler(true, 1024.0, 2);
  p.mutable_grad() = torch::full({8}, 2048.0f, kGpu);
  EXPECT_TRUE(scaler.unscale_and_check({p}));
  EXPECT_TRUE(torch::allclose(p.grad(), torch::full({8}, 2.0f, kGpu)));
  p.mutable_grad()[3] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(scaler.unscale_and_check({p}));
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 512.0);
}

TEST(Gpu, FusedAdamWMatchesTheCpuPath) {
  REQUIRE_CUDA();
  torch::manual_seed(3);
  auto w = torch::randn({64, 32}), b = torch::randn({32});
  std::vector<std::pair<std::string, torch::Tensor>> cpu{{"w", w.clone().requires_grad_(true)},
                                                         {"b", b.clone().requires_grad_(true)}};
  std::vector<std::pair<std::string, torch::Tensor>> gpu{{"w", w.to(kGpu).requires_grad_(true)},
                                                         {"b", b.to(kGpu).requires_grad_(true)}};
  OptimConfig oc;
  AdamW on_cpu(cpu, oc), on_gpu(gpu, oc);
  for (int step = 0; step < 5; ++step) {
    auto gw = torch::randn({64, 32}), gb = torch::randn({32});
    cpu[0].second.mutable_grad() = gw.clone();
    cpu[1].second.mutable_grad() = gb.clone();
    gpu[0].second.mutable_grad() = gw.to(kGpu);
    gpu[1].second.mutable_grad() = gb.to(kGpu);
    on_cpu.step(1e-3);
    on_gpu.step(1e-3);
  }
  for (int i = 0; i < 2; ++i)
    EXPECT_TRUE(torch::allclose(cpu[i].second, gpu[i].second.cpu(), 1e-5, 1e-6)) << cpu[i].first;
}

TEST(Gpu, CheckpointsMoveBetweenGpuAndCpu) {
  REQUIRE_CUDA();
  const TempDir tmp;
  const std::string dir = tmp.path;
  torch::manual_seed(4);
  GPT on_gpu(tiny_dims());
  on_gpu->to(kGpu);
  OptimConfig oc;
  AdamW opt(on_gpu->named_params(), oc);
  for (auto& [name, p] : on_gpu->named_params()) p.mutable_grad() = torch::randn_like(p);
  opt.step(1e-3);
  TrainState st;
  st.step = 1;
  const std::string from_gpu = save_checkpoint(dir, on_gpu, opt, st, 3);

  torch::manual_seed(99);
  GPT on_cpu(tiny_dims());
  AdamW cpu_opt(on_cpu->named_params(), oc);
  TrainState loaded;
  load_checkpoint(from_gpu, on_cpu, &cpu_opt, loaded);
  auto a = on_gpu->named_params(), b = on_cpu->named_params();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i].second.cpu(), b[i].second)) << a[i].first;
  for (size_t i = 0; i < opt.size(); ++i) EXPECT_TRUE(torch::equal(opt.exp_avg(i).cpu(), cpu_opt.exp_avg(i)));

  // ... and back: a CPU checkpoint into a model on the GPU.
  st.step = 2;
  const std::string from_cpu = save_checkpoint(dir, on_cpu, cpu_opt, st, 3);
  GPT again(tiny_dims());
  again->to(kGpu);
  AdamW again_opt(again->named_params(), oc);
  load_checkpoint(from_cpu, again, &again_opt, loaded);
  auto c = again->named_params();
  for (size_t i = 0; i < c.size(); ++i) {
    EXPECT_TRUE(c[i].second.is_cuda());
    EXPECT_TRUE(torch::equal(c[i].second.cpu(), b[i].second)) << c[i].first;
  }
}

TEST(Gpu, AsyncCheckpointOfAGpuModelEqualsTheSyncOne) {
  REQUIRE_CUDA();
  const TempDir tmp;
  const std::string dir = tmp.path;
  torch::manual_seed(6);
  GPT model(tiny_dims());
  model->to(kGpu);
  OptimConfig oc;
  AdamW opt(model->named_params(), oc);
  for (auto& [name, p] : model->named_params()) p.mutable_grad() = torch::randn_like(p);
  opt.step(1e-3);
  TrainState st;
  st.step = 1;
  std::string async_path;
  {
    AsyncCheckpointWriter writer(dir + "/async", 3, /*async=*/true);  // pinned snapshot, one sync
    async_path = writer.save(model, opt, st);
    writer.wait();
  }
  GPT loaded(tiny_dims());
  AdamW loaded_opt(loaded->named_params(), oc);
  TrainState back;
  load_checkpoint(async_path, loaded, &loaded_opt, back);
  auto a = model->named_params(), b = loaded->named_params();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i].second.cpu(), b[i].second)) << a[i].first;
  for (size_t i = 0; i < opt.size(); ++i) EXPECT_TRUE(torch::equal(opt.exp_avg_sq(i).cpu(), loaded_opt.exp_avg_sq(i)));
}

// ---- fused block kernels (src/model/kernels/fused_kernels.cu) against the ATen reference ------------

#define REQUIRE_FUSED_KERNELS()                                                                 \
  REQUIRE_CUDA();                                                                               \
  if (!fused_kernels_built())                                                                   \
  GTEST_SKIP() << "this GPU build has no fused kernels (no CUDA compiler at configure time): skipped"

namespace {

struct Tol {
  double rtol, atol;
};

Tol tol_for(c10::ScalarType t) {
  return t == torch::kFloat32 ? Tol{1e-4, 1e-5} : Tol{2e-2, 2e-2};  // one bf16/fp16 rounding step
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, Tol tol, const std::string& what) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!got.defined()) return;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  auto g = got.to(torch::kFloat32).cpu(), w = want.to(torch::kFloat32).cpu();
  EXPECT_TRUE(torch::allclose(g, w, tol.rtol, tol.atol))
      << what << ": max |diff| " << (g - w).abs().max().item<double>();
}

// Forward outputs and the gradients of every input, for the given output gradients.
std::vector<torch::Tensor> add_layernorm_run(FusedImpl impl, const torch::Tensor& x, const torch::Tensor& delta,
                                             const torch::Tensor& w, const torch::Tensor& b, c10::ScalarType out,
                                             const torch::Tensor& d_res, const torch::Tensor& d_norm) {
  auto xi = x.detach().clone().requires_grad_(true), wi = w.detach().clone().requires_grad_(true),
       bi = b.detach().clone().requires_grad_(true);
  torch::Tensor di = delta.defined() ? delta.detach().clone().requires_grad_(true) : torch::Tensor();
  auto [res, normed] = add_layernorm(xi, di, wi, bi, 1e-5, out, impl);
  torch::Tensor loss = (normed.to(torch::kFloat32) * d_norm).sum();
  if (d_res.defined()) loss = loss + (res * d_res).sum();
  loss.backward();
  return {res.detach(), normed.detach(), xi.grad(), di.defined() ? di.grad() : torch::Tensor(), wi.grad(), bi.grad()};
}

}  // namespace

TEST(Gpu, FusedAddLayerNormKernelMatchesReference) {
  REQUIRE_FUSED_KERNELS();
  torch::manual_seed(11);
  const char* names[] = {"residual", "normed", "d_x", "d_delta", "d_weight", "d_bias"};
  for (int64_t cols : {768, 100, 33}) {
    for (int64_t rows : {int64_t{1}, int64_t{37}, int64_t{2048}}) {
      for (c10::ScalarType delta_t : {torch::kFloat32, torch::kBFloat16, torch::kFloat16, c10::ScalarType::Undefined}) {
        for (auto out_t : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
          for (bool residual_used : {true, false}) {
            auto opts = torch::dtype(torch::kFloat32).device(kGpu);
            auto x = torch::randn({rows, cols}, opts) * 3 + 1;
            torch::Tensor delta;
            if (delta_t != c10::ScalarType::Undefined) delta = torch::randn({rows, cols}, opts).to(delta_t);
            auto w = torch::randn({cols}, opts), b = torch::randn({cols}, opts);
            auto d_norm = torch::randn({rows, cols}, opts);
            auto d_res = residual_used ? torch::randn({rows, cols}, opts) : torch::Tensor();
            auto got = add_layernorm_run(FusedImpl::automatic, x, delta, w, b, out_t, d_res, d_norm);
            auto want = add_layernorm_run(FusedImpl::reference, x, delta, w, b, out_t, d_res, d_norm);
            const std::string where = "cols " + std::to_string(cols) + " rows " + std::to_string(rows) + " delta " +
                                      c10::toString(delta_t) + " out " + c10::toString(out_t) +
                                      (residual_used ? " residual used" : " residual unused");
            for (size_t i = 0; i < got.size(); ++i) {
              // Gradients reached through a low-precision output or delta carry its rounding;
              // the parameter gradients sum over rows, so their tolerance grows with them.
              Tol tol = tol_for(i == 1 ? out_t : (i == 3 && delta.defined() ? delta_t : torch::kFloat32));
              if (i >= 4) tol = Tol{1e-3, 1e-3 * std::sqrt(static_cast<double>(rows))};
              expect_close(got[i], want[i], tol, where + ": " + names[i]);
            }
          }
        }
      }
    }
  }
}

TEST(Gpu, FusedBiasGeluKernelMatchesReference) {
  REQUIRE_FUSED_KERNELS();
  torch::manual_seed(12);
  for (int64_t cols : {3072, 100, 24}) {
    for (auto t : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
      for (bool aligned : {true, false}) {
        const int64_t rows = 67;
        auto opts = torch::dtype(t).device(kGpu);
        // The unaligned case starts one element into its storage: the kernels' scalar path.
        auto pre = torch::empty({rows * cols + 1}, opts).narrow(0, aligned ? 0 : 1, rows * cols).view({rows, cols});
        pre.copy_(torch::randn({rows, cols}, opts) * 2);
        auto bias = torch::randn({cols}, torch::dtype(torch::kFloat32).device(kGpu));
        auto d_out = torch::randn({rows, cols}, opts);
        std::vector<torch::Tensor> res[2];
        for (int k = 0; k < 2; ++k) {
          auto p = pre.detach().clone().requires_grad_(true), bb = bias.detach().clone().requires_grad_(true);
          if (!aligned) {  // keep the clone unaligned too
            auto storage = torch::empty({rows * cols + 1}, opts).narrow(0, 1, rows * cols).view({rows, cols});
            storage.copy_(pre);
            p = storage.detach().requires_grad_(true);
          }
          auto y = bias_gelu(p, bb, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
          (y.to(torch::kFloat32) * d_out.to(torch::kFloat32)).sum().backward();
          res[k] = {y.detach(), p.grad(), bb.grad()};
        }
        const std::string where = "cols " + std::to_string(cols) + " " + c10::toString(t) +
                                  (aligned ? " aligned" : " unaligned");
        expect_close(res[0][0], res[1][0], tol_for(t), where + ": out");
        expect_close(res[0][1], res[1][1], tol_for(t), where + ": d_pre");
        expect_close(res[0][2], res[1][2], Tol{1e-3, 1e-2}, where + ": d_bias");
      }
    }
  }
}

namespace {

// The model with RunOptions::fused_kernels on and off from the same seed, on the GPU: the same loss and
// gradients in fp32, the same loss within bf16's precision under autocast.
void expect_fused_model_matches_unfused(GPTDims d, uint64_t seed) {
  torch::manual_seed(seed);
  GPT fused(d);
  RunOptions fused_ops;
  fused_ops.fused_kernels = true;
  fused->apply(fused_ops);
  torch::manual_seed(seed);
  GPT plain(d);
  fused->to(kGpu);
  plain->to(kGpu);
  auto x = torch::randint(0, 96, {4, 32}, torch::dtype(torch::kLong).device(kGpu));
  auto y = torch::randint(0, 96, {4, 32}, torch::dtype(torch::kLong).device(kGpu));
  auto lf = fused->loss(x, y), lp = plain->loss(x, y);
  EXPECT_NEAR(lf.item<double>(), lp.item<double>(), 1e-4);
  lf.backward();
  lp.backward();
  auto pf = fused->named_params(), pp = plain->named_params();
  for (size_t i = 0; i < pf.size(); ++i)
    expect_close(pf[i].second.grad(), pp[i].second.grad(), Tol{1e-3, 1e-5}, pf[i].first);
  Autocast ac(Precision::bf16, kGpu);
  EXPECT_NEAR(fused->loss(x, y).item<double>(), plain->loss(x, y).item<double>(), 2e-2);
}

}  // namespace

TEST(Gpu, FusedKernelsModelMatchesTheUnfusedModel) {
  REQUIRE_FUSED_KERNELS();
  expect_fused_model_matches_unfused(tiny_dims(), 13);
}

// The Llama block's fused ops (add_rmsnorm, swiglu, rotary) on the GPU against their ATen
// reference, as tests/test_fused_emu.cpp checks them through the CPU emulation of the kernels.
TEST(Gpu, FusedLlamaOpsKernelsMatchReference) {
  REQUIRE_FUSED_KERNELS();
  torch::manual_seed(15);
  auto f32 = torch::dtype(torch::kFloat32).device(kGpu);
  for (auto t : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    for (int64_t cols : {768, 100, 33}) {
      const std::string where = std::string(c10::toString(t)) + " cols " + std::to_string(cols);
      // add_rmsnorm: fp32 stream, a delta and the output in t.
      auto x0 = torch::randn({67, cols}, f32) * 3 + 1, d0 = torch::randn({67, cols}, f32).to(t);
      auto w0 = torch::randn({cols}, f32), g_res = torch::randn({67, cols}, f32), g_n = torch::randn({67, cols}, f32);
      std::vector<torch::Tensor> norm[2];
      for (int k = 0; k < 2; ++k) {
        auto x = x0.clone().requires_grad_(true), d = d0.clone().requires_grad_(true);
        auto w = w0.clone().requires_grad_(true);
        auto [r, n] = add_rmsnorm(x, d, w, 1e-5, t, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
        ((r * g_res).sum() + (n.to(torch::kFloat32) * g_n).sum()).backward();
        norm[k] = {r.detach(), n.detach(), x.grad(), d.grad(), w.grad()};
      }
      const char* names[] = {"residual", "normed", "d_x", "d_delta", "d_weight"};
      for (size_t i = 0; i < 5; ++i) {
        Tol tol = tol_for(i == 1 || i == 3 ? t : torch::kFloat32);
        if (i == 4) tol = Tol{1e-3, 1e-3 * std::sqrt(67.0)};
        expect_close(norm[0][i], norm[1][i], tol, where + " add_rmsnorm: " + names[i]);
      }
      // swiglu
      auto gate0 = (torch::randn({67, cols}, f32) * 3).to(t), up0 = torch::randn({67, cols}, f32).to(t);
      auto g = torch::randn({67, cols}, f32);
      std::vector<torch::Tensor> glu[2];
      for (int k = 0; k < 2; ++k) {
        auto gate = gate0.clone().requires_grad_(true), up = up0.clone().requires_grad_(true);
        auto y = swiglu(gate, up, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
        (y.to(torch::kFloat32) * g).sum().backward();
        glu[k] = {y.detach(), gate.grad(), up.grad()};
      }
      for (size_t i = 0; i < 3; ++i)
        expect_close(glu[0][i], glu[1][i], tol_for(t), where + " swiglu " + std::to_string(i));
    }
    // rotary: the same roundings as the ATen ops (fused_kernels.h), so equal bit for bit.
    for (int64_t head_dim : {64, 128, 12}) {
      const int64_t T = 33;
      auto freqs = torch::arange(40, f32).unsqueeze(1) * (torch::rand({head_dim / 2}, f32) * 0.9 + 0.05).unsqueeze(0);
      auto emb = torch::cat({freqs, freqs}, -1);
      auto cos = emb.cos(), sin = emb.sin();
      auto x0 = (torch::randn({3, T, 5, head_dim}, f32) * 2).to(t);
      auto g = torch::randn({3, T, 5, head_dim}, f32);
      std::vector<torch::Tensor> rot[2];
      for (int k = 0; k < 2; ++k) {
        auto x = x0.clone().requires_grad_(true);
        auto y = rotary(x, cos, sin, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
        (y.to(torch::kFloat32) * g).sum().backward();
        rot[k] = {y.detach(), x.grad()};
      }
      const std::string where = std::string(c10::toString(t)) + " head_dim " + std::to_string(head_dim);
      EXPECT_TRUE(torch::equal(rot[0][0], rot[1][0])) << where << " rotary out";
      EXPECT_TRUE(torch::equal(rot[0][1], rot[1][1])) << where << " rotary d_x";
    }
  }
}

// Llama-shaped, then Qwen3-shaped (heads of 16 at width 32 and q/k norms, no biases).
TEST(Gpu, FusedKernelsLlamaMatchesTheUnfusedLlama) {
  REQUIRE_FUSED_KERNELS();
  for (bool qwen3 : {false, true}) {
    SCOPED_TRACE(qwen3 ? "qwen3" : "llama");
    GPTDims d = tiny_dims();
    d.arch = "llama";
    d.n_head = 4, d.n_kv_head = 2, d.intermediate_size = 96, d.max_position = d.seq_len;
    d.rope_scaling = "llama3", d.rope_factor = 8, d.rope_low_freq_factor = 1, d.rope_high_freq_factor = 4;
    d.rope_original_max_position = 64;
    d.qkv_bias = !qwen3, d.tie_embeddings = false;
    if (qwen3) d.head_size = 16, d.qk_norm = true;
    expect_fused_model_matches_unfused(d, 16);
  }
}

TEST(Gpu, FusedSoftmaxCrossEntropyKernelMatchesReference) {
  REQUIRE_FUSED_KERNELS();
  torch::manual_seed(14);
  // vocab 1001: the kernel's scalar path; 2048: 16-byte packs. Chunks of 50 rows: several chunks.
  for (int64_t vocab : {1001, 2048}) {
    for (bool bf16 : {false, true}) {
      auto h0 = torch::randn({300, 64}, kGpu), w0 = torch::randn({vocab, 64}, kGpu) * 0.1;
      auto t = torch::randint(0, vocab, {300}, torch::dtype(torch::kLong).device(kGpu));
      std::vector<torch::Tensor> res[2];
      for (int k = 0; k < 2; ++k) {
        auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
        torch::Tensor loss;
        {
          std::optional<Autocast> ac;
          if (bf16) ac.emplace(Precision::bf16, kGpu);
          loss = linear_cross_entropy(h, w, t, 50, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
        }
        (loss * 2.0).backward();
        torch::Tensor eval_loss;
        {
          torch::NoGradGuard no_grad;
          std::optional<Autocast> ac;
          if (bf16) ac.emplace(Precision::bf16, kGpu);
          eval_loss = linear_cross_entropy(h0, w0, t, 50, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
        }
        res[k] = {loss.detach(), h.grad(), w.grad(), eval_loss};
      }
      const std::string where = "vocab " + std::to_string(vocab) + (bf16 ? " bf16" : " fp32");
      // bf16: the kernel's gradient is rounded to bf16 before the matmuls, the reference's is
      // rounded by autocast at the same point; the loss is reduced in fp32 by both.
      const Tol tol = bf16 ? Tol{2e-2, 1e-4} : Tol{1e-4, 1e-6};
      expect_close(res[0][0], res[1][0], Tol{1e-4, 1e-4}, where + ": loss");
      expect_close(res[0][1], res[1][1], tol, where + ": d_hidden");
      expect_close(res[0][2], res[1][2], tol, where + ": d_weight");
      expect_close(res[0][3], res[1][3], Tol{1e-4, 1e-4}, where + ": loss without gradients");
    }
  }
}

// ---- activation checkpointing on the GPU ---------------------------------------------------------

// train.activation_checkpointing: full and selective on CUDA. The second run of each block must
// draw the first run's dropout masks from the CUDA generator (checkpointing.cpp saves and restores
// its state; selective also skips over what a replayed attention kernel drew) and run under the
// first run's autocast; selective replays its linear layers through cuBLAS with PyTorch's own
// backward formulas and, with a fused attention kernel (flash / memory-efficient: the GPU's
// choice for these shapes), that kernel's own backward. So the loss and gradients equal those
// without checkpointing. Control: the same run twice without checkpointing. Where that is bitwise
// (deterministic kernels), checkpointing must be bitwise too; where a kernel's backward adds in a
// varying order (atomics), checkpointing may differ by no more than twice what the control does.
TEST(Gpu, ActivationCheckpointingEqualsNoCheckpointingOnCuda) {
  REQUIRE_CUDA();
  for (bool llama : {false, true}) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(std::string(llama ? "llama" : "gpt2") + (bf16 ? " bf16" : " fp32"));
      GPTDims d = tiny_dims();
      if (llama) {
        d.arch = "llama";
        d.n_head = 4, d.n_kv_head = 2, d.intermediate_size = 96, d.max_position = d.seq_len;
        d.tie_embeddings = false;
      } else {
        d.dropout = 0.1;  // the masks the recomputation must draw again
      }
      RunOptions run;
      run.fused_kernels = fused_kernels_built();
      auto x = torch::randint(0, 96, {4, 32}, torch::dtype(torch::kLong)).to(kGpu);
      auto y = torch::randint(0, 96, {4, 32}, torch::dtype(torch::kLong)).to(kGpu);
      const RunOptions::Ac modes[4] = {RunOptions::Ac::none, RunOptions::Ac::none, RunOptions::Ac::full, RunOptions::Ac::selective};
      std::vector<torch::Tensor> runs[4];  // none, none again (control), full, selective
      int64_t attention_replayed = 0;
      for (int k = 0; k < 4; ++k) {
        run.ac = modes[k];
        torch::manual_seed(21);  // the same weights, and the same CUDA generator for dropout
        GPT m(d);
        m->apply(run);
        m->to(kGpu);
        m->train();
        const int64_t before = recomputed_blocks(), linear_before = replayed_linear_layers(),
                      attention_before = replayed_attention();
        torch::Tensor loss;
        {
          std::optional<Autocast> ac;
          if (bf16) ac.emplace(Precision::bf16, kGpu);
          loss = m->loss(x, y);
        }
        loss.backward();
        torch::cuda::synchronize();
        EXPECT_EQ(recomputed_blocks() - before, k >= 2 ? d.n_layer : 0) << "blocks run again in backward";
        EXPECT_EQ(replayed_linear_layers() - linear_before, k == 3 ? d.n_layer * (llama ? 7 : 4) : 0)
            << "linear layers replayed";
        if (k == 3) attention_replayed = replayed_attention() - attention_before;
        runs[k].push_back(loss.detach());
        for (auto& [name, p] : m->named_params()) runs[k].push_back(p.grad());
      }
      double control = 0, full = 0, selective = 0;
      for (size_t i = 0; i < runs[0].size(); ++i) {
        ASSERT_TRUE(runs[0][i].defined() && runs[2][i].defined() && runs[3][i].defined()) << "tensor " << i;
        control = std::max(control, (runs[0][i] - runs[1][i]).abs().max().item<double>());
        full = std::max(full, (runs[0][i] - runs[2][i]).abs().max().item<double>());
        selective = std::max(selective, (runs[0][i] - runs[3][i]).abs().max().item<double>());
      }
      if (control == 0) {
        EXPECT_EQ(full, 0) << "deterministic kernels: full checkpointing must be bitwise";
        EXPECT_EQ(selective, 0) << "deterministic kernels: selective checkpointing must be bitwise";
      } else {
        EXPECT_LE(full, 2 * control) << "control (same run twice) differs by " << control;
        EXPECT_LE(selective, 2 * control) << "control (same run twice) differs by " << control;
      }
      std::printf("  %s %s: vs none max |diff| full %.3g, selective %.3g (attention replayed in %lld of %lld blocks), "
                  "control %.3g\n",
                  llama ? "llama" : "gpt2", bf16 ? "bf16" : "fp32", full, selective,
                  static_cast<long long>(attention_replayed), static_cast<long long>(d.n_layer), control);
    }
  }
}

// Gradient clipping's fp64 sum of squares: the nvcc-compiled kernel against the per-tensor fp64
// norms, on tensors of many sizes (several launches' worth of tensors, multi-chunk ones).
TEST(Gpu, SumOfSquaresKernelMatchesTheReference) {
  REQUIRE_FUSED_KERNELS();
  torch::manual_seed(12);
  std::vector<torch::Tensor> ts;
  for (int i = 0; i < 60; ++i) ts.push_back(torch::randn({1 + (i * 7919) % 3000}, torch::device(kGpu)) * (1 + i % 5));
  ts.push_back(torch::randn({3 * 65536 + 17}, torch::device(kGpu)));
  const double kernel = sum_of_squares(ts, kGpu).item<double>();
  const double reference = sum_of_squares(ts, kGpu, FusedImpl::reference).item<double>();
  EXPECT_NEAR(kernel, reference, 1e-12 * reference);
  std::printf("  sum of squares: kernel %.17g, reference %.17g\n", kernel, reference);
}

// ZeRO-3's parameter shards on CUDA (one rank: the shard is the whole unit, but every unit's
// memory is still dropped after use and all-gathered again, through the caching allocator, and the
// backward's gathers run on autograd's device thread): the gradients equal the model's without
// sharding bit for bit, GPT-2 and the fused Llama, with and without checkpointing, fp32 and bf16,
// and no unit stays whole after backward.
TEST(Gpu, ZeroThreeShardsOnCudaEqualTheWholeModel) {
  REQUIRE_CUDA();
  auto c = make_communicator(have_nccl() ? "nccl" : "mpi", mpi::self(), kGpu);
  for (const char* arch : {"gpt2", "llama"})
    for (bool checkpointing : {false, true})
      for (Precision precision : {Precision::fp32, Precision::bf16}) {
        GPTDims d = tiny_dims();
        d.n_layer = 3;
        d.arch = arch;
        RunOptions run;
        run.fused_kernels = std::string(arch) == "llama" && fused_kernels_built();
        run.ac = checkpointing ? RunOptions::Ac::full : RunOptions::Ac::none;
        const std::string what = concat(arch, checkpointing ? ", checkpointing" : "", ", ", precision_name(precision));
        const auto plain = zero3_probe(d, run, *c, kGpu, precision, false);
        const auto sharded = zero3_probe(d, run, *c, kGpu, precision, true);
        EXPECT_TRUE(torch::equal(plain.loss, sharded.loss)) << what;
        ASSERT_EQ(plain.grad_shards.size(), sharded.grad_shards.size());
        for (size_t b = 0; b < plain.grad_shards.size(); ++b)
          EXPECT_TRUE(torch::equal(plain.grad_shards[b], sharded.grad_shards[b])) << what << ": unit " << b;
        EXPECT_EQ(sharded.whole_after, 0u) << what;
        EXPECT_TRUE(sharded.gather_all_exact) << what;
        // train's start-up: the model made on the host without values, each parameter drawn on
        // its own into the shards on the GPU.
        const auto from_host = zero3_probe(d, run, *c, kGpu, precision, true, torch::kFloat32, /*from_host=*/true);
        EXPECT_TRUE(torch::equal(plain.loss, from_host.loss)) << what << ", built on the host";
        for (size_t b = 0; b < plain.grad_shards.size(); ++b)
          EXPECT_TRUE(torch::equal(plain.grad_shards[b], from_host.grad_shards[b]))
              << what << ", built on the host: unit " << b;
        // comm.param_dtype bf16: the gathers (NCCL's bf16 all-gather, widened on the device)
        // compute with the weights rounded to bf16, as the whole model does with them rounded first.
        const auto rounded = zero3_probe(d, run, *c, kGpu, precision, false, torch::kBFloat16);
        const auto bf16_wire = zero3_probe(d, run, *c, kGpu, precision, true, torch::kBFloat16);
        EXPECT_TRUE(torch::equal(rounded.loss, bf16_wire.loss)) << what << ", param_dtype bf16";
        for (size_t b = 0; b < rounded.grad_shards.size(); ++b)
          EXPECT_TRUE(torch::equal(rounded.grad_shards[b], bf16_wire.grad_shards[b]))
              << what << ", param_dtype bf16: unit " << b;
        EXPECT_TRUE(bf16_wire.gather_all_exact) << what << ", param_dtype bf16";
      }
}
