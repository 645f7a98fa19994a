// The GPU code path of the fused ops, run on the CPU: src/model/fused_ops.cpp and src/model/model.cpp are
// compiled here with MPITRAIN_FUSED_KERNELS (their CUDA branches) and MPITRAIN_FUSED_EMULATION
// (CPU tensors go to the kernels), and linked with src/model/kernels/fused_kernels.cu compiled for CPU
// threads (tests/cuda_emu.h). So the dispatch, the buffers handed to the kernels, the partial-sum
// reductions and the in-place loss gradient run as they would on a GPU, and the results are
// compared with the ATen reference (FusedImpl::reference) and with the unfused model. What stays
// unrun without a GPU: streams, device guards, and the nvcc-compiled kernels themselves.
#include <gtest/gtest.h>

#include <string>

#include "mpitrain/amp.h"
#include "mpitrain/comm.h"
#include "mpitrain/fused_ops.h"
#include "mpitrain/model.h"
#include "mpitrain/tensor_parallel.h"
#include "mpi_world.h"

using namespace mpitrain;

namespace {

void expect_close(const torch::Tensor& got, const torch::Tensor& want, double rtol, double atol, const std::string& what) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!got.defined()) return;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  auto g = got.to(torch::kFloat32), w = want.to(torch::kFloat32);
  EXPECT_TRUE(torch::allclose(g, w, rtol, atol)) << what << ": max |diff| " << (g - w).abs().max().item<double>();
}

}  // namespace

TEST(FusedEmu, TheKernelPathIsTaken) {
  EXPECT_TRUE(fused_kernels_built());
  EXPECT_TRUE(fused_kernel_device(torch::zeros({2})));
}

TEST(FusedEmu, AddLayerNormThroughTheKernelsMatchesTheReference) {
  torch::manual_seed(21);
  for (auto delta_t : {torch::kFloat32, torch::kBFloat16}) {
    for (auto out_t : {torch::kFloat32, torch::kBFloat16}) {
      for (bool with_delta : {true, false}) {
        for (bool residual_used : {true, false}) {
          auto x0 = torch::randn({3, 5, 40}) * 2 + 1, d0 = torch::randn({3, 5, 40}).to(delta_t);
          auto w0 = torch::randn({40}), b0 = torch::randn({40});
          auto g_res = torch::randn({3, 5, 40}), g_norm = torch::randn({3, 5, 40});
          std::vector<torch::Tensor> res[2];
          for (int k = 0; k < 2; ++k) {
            auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true),
                 b = b0.clone().requires_grad_(true);
            auto d = with_delta ? d0.clone().requires_grad_(true) : torch::Tensor();
            auto [r, n] = add_layernorm(x, d, w, b, 1e-5, out_t, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
            auto loss = (n.to(torch::kFloat32) * g_norm).sum();
            if (residual_used) loss = loss + (r * g_res).sum();
            loss.backward();
            res[k] = {r.detach(), n.detach(), x.grad(), with_delta ? d.grad() : torch::Tensor(), w.grad(), b.grad()};
          }
          const std::string where = std::string(c10::toString(delta_t)) + " -> " + c10::toString(out_t) +
                                    (with_delta ? "" : " no delta") + (residual_used ? " residual used" : "");
          const char* names[] = {"residual", "normed", "d_x", "d_delta", "d_weight", "d_bias"};
          for (size_t i = 0; i < 6; ++i) {
            const bool low = (i == 1 && out_t != torch::kFloat32) || (i == 3 && delta_t != torch::kFloat32);
            expect_close(res[0][i], res[1][i], low ? 2e-2 : 1e-4, low ? 2e-2 : 1e-4, where + ": " + names[i]);
          }
        }
      }
    }
  }
}

TEST(FusedEmu, BiasGeluThroughTheKernelsMatchesTheReference) {
  torch::manual_seed(22);
  for (auto t : {torch::kFloat32, torch::kBFloat16}) {
    for (int64_t cols : {64, 36}) {  // 16-byte packs; the scalar path for bf16
      auto pre0 = (torch::randn({2, 7, cols}) * 2).to(t), bias0 = torch::randn({cols}), g = torch::randn({2, 7, cols});
      std::vector<torch::Tensor> res[2];
      for (int k = 0; k < 2; ++k) {
        auto pre = pre0.clone().requires_grad_(true), bias = bias0.clone().requires_grad_(true);
        auto y = bias_gelu(pre, bias, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
        (y.to(torch::kFloat32) * g).sum().backward();
        res[k] = {y.detach(), pre.grad(), bias.grad()};
      }
      const double tol = t == torch::kFloat32 ? 1e-4 : 2e-2;
      const std::string where = std::string(c10::toString(t)) + " cols " + std::to_string(cols);
      expect_close(res[0][0], res[1][0], tol, tol, where + ": out");
      expect_close(res[0][1], res[1][1], tol, tol, where + ": d_pre");
      expect_close(res[0][2], res[1][2], 1e-3, tol, where + ": d_bias");
    }
  }
}

TEST(FusedEmu, LinearCrossEntropyThroughTheKernelMatchesTheReference) {
  torch::manual_seed(23);
  auto h0 = torch::randn({45, 16}), w0 = torch::randn({72, 16}) * 0.3;
  auto t = torch::randint(0, 72, {45}, torch::kLong);
  std::vector<torch::Tensor> res[2];
  for (int k = 0; k < 2; ++k) {
    auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    auto loss = linear_cross_entropy(h, w, t, 10, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
    (loss * 3.0).backward();
    torch::NoGradGuard no_grad;
    auto eval = linear_cross_entropy(h0, w0, t, 10, k == 0 ? FusedImpl::automatic : FusedImpl::reference);
    res[k] = {loss.detach(), h.grad(), w.grad(), eval};
  }
  expect_close(res[0][0], res[1][0], 1e-5, 1e-5, "loss");
  expect_close(res[0][1], res[1][1], 1e-4, 1e-6, "d_hidden");
  expect_close(res[0][2], res[1][2], 1e-4, 1e-6, "d_weight");
  expect_close(res[0][3], res[1][3], 1e-5, 1e-5, "loss without gradients");
}

TEST(FusedEmu, TheFusedModelMatchesTheUnfusedModel) {
  GPTDims d{/*n_layer=*/2, /*n_head=*/2, /*n_embd=*/32, /*seq_len=*/8, /*vocab_size=*/48};
  d.fused_kernels = true;
  d.fused_loss = true;
  torch::manual_seed(24);
  GPT fused(d);
  d.fused_kernels = false;
  d.fused_loss = false;
  torch::manual_seed(24);
  GPT plain(d);
  auto x = torch::randint(0, 48, {2, 8}, torch::kLong), y = torch::randint(0, 48, {2, 8}, torch::kLong);
  auto lf = fused->loss(x, y), lp = plain->loss(x, y);
  EXPECT_NEAR(lf.item<double>(), lp.item<double>(), 1e-5);
  lf.backward();
  lp.backward();
  auto pf = fused->named_params(), pp = plain->named_params();
  for (size_t i = 0; i < pf.size(); ++i)
    expect_close(pf[i].second.grad(), pp[i].second.grad(), 1e-3, 1e-5, pf[i].first);
  // bf16 autocast on the CPU: the kernels take bf16 activations, as on a GPU.
  Autocast ac(Precision::bf16, torch::Device(torch::kCPU));
  EXPECT_NEAR(fused->loss(x, y).item<double>(), plain->loss(x, y).item<double>(), 3e-2);
}

// Tensor parallel on the kernel path (CTest test_fused_emu_tp_np2: mpirun -np 2; the singleton
// run filters it out): a tp 2 model whose block ops go through the emulated CUDA kernels and whose
// loss is the vocabulary-parallel fused chunked one matches the unfused dense model in its loss and
// in every gradient's shard, as the fused dense model does above.
TEST(FusedEmuTensorParallel, TheFusedTpModelMatchesTheUnfusedDenseModel) {
  ASSERT_EQ(world_size(), 2) << "runs under mpirun -np 2";
  auto tp = make_mpi_communicator(MPI_COMM_WORLD);
  GPTDims d{/*n_layer=*/2, /*n_head=*/2, /*n_embd=*/32, /*seq_len=*/8, /*vocab_size=*/48};
  torch::manual_seed(24);
  GPT plain(d);
  d.fused_kernels = true;
  d.fused_loss = true;
  d.fused_loss_rows = 5;
  d.tp = 2;
  d.tp_rank = tp->rank();
  d.tp_comm = tp.get();
  torch::manual_seed(24);
  GPT fused(d);
  torch::manual_seed(25);  // the same batch on both ranks
  auto x = torch::randint(0, 48, {2, 8}, torch::kLong), y = torch::randint(0, 48, {2, 8}, torch::kLong);
  auto lf = fused->loss(x, y), lp = plain->loss(x, y);
  EXPECT_NEAR(lf.item<double>(), lp.item<double>(), 1e-5);
  lf.backward();
  lp.backward();
  auto pf = fused->named_params(), pp = plain->named_params();
  ASSERT_EQ(pf.size(), pp.size());
  for (size_t i = 0; i < pf.size(); ++i)
    expect_close(pf[i].second.grad(), tp_shard(pp[i].second.grad(), tp_split(pp[i].first), tp->rank(), 2).contiguous(),
                 1e-3, 1e-5, pf[i].first);
}
