// Micro-benchmark of the fused block ops (model.fused_kernels) against the libtorch ops the
// unfused model runs, forward + backward, at one GPT layer's shapes. On a GPU the fused side
// runs the CUDA kernels (when built); on the CPU it runs the ATen reference, which is not meant
// to be fast, so the CPU table only shows that the benchmark works.
//
//   bench_fused_ops [--rows 16384] [--cols 768] [--iters 50]
//
// rows = micro-batch x seq (GPT-2 at 16 x 1024: 16384), cols = n_embd; the MLP is 4 x cols wide.
// Activations are bf16 on a GPU (as under autocast) and fp32 on the CPU.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "mpitrain/fused_ops.h"

using namespace mpitrain;

namespace {

double time_ms(const torch::Device& dev, int iters, const std::function<void()>& fn) {
  auto sync = [&] {
    if (dev.is_cuda()) torch::cuda::synchronize();
  };
  for (int i = 0; i < 3; ++i) fn();
  sync();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) fn();
  sync();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / iters;
}

}  // namespace

int main(int argc, char** argv) {
  const bool cuda = torch::cuda::is_available();
  int64_t rows = cuda ? 16384 : 2048, cols = 768;
  int iters = cuda ? 50 : 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--rows")) rows = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--cols")) cols = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s [--rows N] [--cols C] [--iters K]\n", argv[0]);
      return 2;
    }
  }
  const torch::Device dev = cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  const auto act = cuda ? torch::kBFloat16 : torch::kFloat32;
  const auto f32 = torch::dtype(torch::kFloat32).device(dev);
  torch::manual_seed(0);

  // Residual add + LayerNorm: residual x (fp32), delta (activation dtype), output in the
  // activation dtype; gradients arrive on both outputs, as inside the model.
  auto x = torch::randn({rows, cols}, f32).requires_grad_(true);
  auto delta = torch::randn({rows, cols}, f32).to(act).requires_grad_(true);
  auto w = torch::ones({cols}, f32).requires_grad_(true), b = torch::zeros({cols}, f32).requires_grad_(true);
  auto g_res = torch::randn({rows, cols}, f32), g_norm = torch::randn({rows, cols}, f32).to(act);
  const double ln_plain = time_ms(dev, iters, [&] {
    auto r = x + delta;
    auto n = torch::layer_norm(r, {cols}, w, b, 1e-5).to(act);
    torch::autograd::backward({r, n}, {g_res, g_norm});
  });
  const double ln_fused = time_ms(dev, iters, [&] {
    auto [r, n] = add_layernorm(x, delta, w, b, 1e-5, act);
    torch::autograd::backward({r, n}, {g_res, g_norm});
  });

  // Bias + GELU over the MLP's hidden width (the bias is fp32, as a master weight).
  auto pre = torch::randn({rows, 4 * cols}, f32).to(act).requires_grad_(true);
  auto bias = torch::randn({4 * cols}, f32).requires_grad_(true);
  auto g_out = torch::randn({rows, 4 * cols}, f32).to(act);
  namespace F = torch::nn::functional;
  const double gelu_plain = time_ms(dev, iters, [&] {
    auto y = F::gelu(pre + bias.to(act), F::GELUFuncOptions().approximate("tanh"));
    y.backward(g_out);
  });
  const double gelu_fused = time_ms(dev, iters, [&] {
    auto y = bias_gelu(pre, bias);
    y.backward(g_out);
  });

  std::printf("fused block ops, forward + backward, %s, activations %s, %d iterations%s\n",
              cuda ? "CUDA" : "CPU (ATen reference, not the kernels)", c10::toString(act), iters,
              cuda && !fused_kernels_built() ? " (this build has no kernels: the reference runs)" : "");
  std::printf("| op | shape | libtorch ms | fused ms | libtorch / fused |\n|---|---|---:|---:|---:|\n");
  std::printf("| residual add + LayerNorm | %lld x %lld | %.3f | %.3f | %.2fx |\n", static_cast<long long>(rows),
              static_cast<long long>(cols), ln_plain, ln_fused, ln_plain / ln_fused);
  std::printf("| bias + GELU | %lld x %lld | %.3f | %.3f | %.2fx |\n", static_cast<long long>(rows),
              static_cast<long long>(4 * cols), gelu_plain, gelu_fused, gelu_plain / gelu_fused);
  return 0;
}
