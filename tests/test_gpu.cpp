// GPU tests: the NCCL backend, bf16 autocast and fp16 loss scaling on CUDA, fused AdamW against
// the CPU path, checkpoints moving between GPU and CPU. Compiled in every build; each test is
// skipped, with a message, where no CUDA device is visible (CTest then shows "Skipped").
// On a GPU machine: mpirun -np 1 build/tests/test_gpu
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "mpitrain/amp.h"
#include "mpitrain/checkpoint.h"
#include "mpitrain/comm.h"
#include "mpitrain/model.h"
#include "mpitrain/optim.h"

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

std::string temp_dir() {
  char tmpl[] = "/tmp/mpitrain-gpu-XXXXXX";
  return mkdtemp(tmpl);
}

}  // namespace

TEST(Gpu, NcclCommunicator) {
  REQUIRE_CUDA();
  if (!have_nccl()) GTEST_SKIP() << "this build has no NCCL backend: skipped";
  auto c = make_communicator("nccl", MPI_COMM_WORLD, kGpu);
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
  const std::string dir = temp_dir();
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
  std::filesystem::remove_all(dir);
}
