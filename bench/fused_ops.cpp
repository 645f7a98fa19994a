// Micro-benchmark of the fused block ops (model.fused_kernels) against the libtorch ops the
// unfused model runs, forward + backward, at one GPT layer's shapes. On a GPU the fused side
// runs the CUDA kernels (when built); on the CPU it runs the ATen reference, which is not meant
// to be fast, so the CPU table only shows that the benchmark works.
//
//   bench_fused_ops [--rows 16384] [--cols 768] [--iters 50]
//
// rows = micro-batch x seq (GPT-2 at 16 x 1024: 16384), cols = n_embd; GPT-2's MLP is 4 x cols
// wide. The Llama ops (residual add + RMSNorm, SwiGLU, rotary) run at the same rows with Llama 3.2
// 1B's proportions scaled to cols: SwiGLU 4 x cols (1B: 8192 for 2048), rotary over cols / 64
// heads of 64. Activations are bf16 on a GPU (as under autocast) and fp32 on the CPU.
#include <torch/torch.h>

#include <algorithm>
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

  // Llama: residual add + RMSNorm (no bias), SwiGLU over the hidden width, rotary on q.
  const double rms_plain = time_ms(dev, iters, [&] {
    auto r = x + delta;
    auto n = (r * torch::rsqrt(r.pow(2).mean(-1, true) + 1e-5) * w).to(act);
    torch::autograd::backward({r, n}, {g_res, g_norm});
  });
  const double rms_fused = time_ms(dev, iters, [&] {
    auto [r, n] = add_rmsnorm(x, delta, w, 1e-5, act);
    torch::autograd::backward({r, n}, {g_res, g_norm});
  });
  auto gate = torch::randn({rows, 4 * cols}, f32).to(act).requires_grad_(true);
  auto up = torch::randn({rows, 4 * cols}, f32).to(act).requires_grad_(true);
  const double swiglu_plain = time_ms(dev, iters, [&] {
    auto y = F::silu(gate) * up;
    y.backward(g_out);
  });
  const double swiglu_fused = time_ms(dev, iters, [&] {
    auto y = swiglu(gate, up);
    y.backward(g_out);
  });
  const int64_t head_dim = 64, heads = std::max<int64_t>(1, cols / head_dim), T = std::min<int64_t>(rows, 1024);
  const int64_t B = std::max<int64_t>(1, rows / T), half = head_dim / 2;
  auto q = torch::randn({B, T, heads, head_dim}, f32).to(act).requires_grad_(true);
  auto angle = torch::arange(T, f32).unsqueeze(1) * torch::pow(10000.0, -torch::arange(half, f32) / half).unsqueeze(0);
  auto cos_t = torch::cat({angle.cos(), angle.cos()}, 1), sin_t = torch::cat({angle.sin(), angle.sin()}, 1);
  auto g_q = torch::randn({B, T, heads, head_dim}, f32).to(act);
  const double rope_plain = time_ms(dev, iters, [&] {
    auto c = cos_t.to(act).view({T, 1, head_dim}), s = sin_t.to(act).view({T, 1, head_dim});
    auto rotated = torch::cat({-q.narrow(-1, half, half), q.narrow(-1, 0, half)}, -1);
    auto y = q * c + rotated * s;
    y.backward(g_q);
  });
  const double rope_fused = time_ms(dev, iters, [&] {
    auto y = rotary(q, cos_t, sin_t);
    y.backward(g_q);
  });

  std::printf("fused block ops, forward + backward, %s, activations %s, %d iterations%s\n",
              cuda ? "CUDA" : "CPU (ATen reference, not the kernels)", c10::toString(act), iters,
              cuda && !fused_kernels_built() ? " (this build has no kernels: the reference runs)" : "");
  std::printf("| op | shape | libtorch ms | fused ms | libtorch / fused |\n|---|---|---:|---:|---:|\n");
  std::printf("| residual add + LayerNorm | %lld x %lld | %.3f | %.3f | %.2fx |\n", static_cast<long long>(rows),
              static_cast<long long>(cols), ln_plain, ln_fused, ln_plain / ln_fused);
  std::printf("| bias + GELU | %lld x %lld | %.3f | %.3f | %.2fx |\n", static_cast<long long>(rows),
              static_cast<long long>(4 * cols), gelu_plain, gelu_fused, gelu_plain / gelu_fused);
  std::printf("| residual add + RMSNorm (Llama) | %lld x %lld | %.3f | %.3f | %.2fx |\n", static_cast<long long>(rows),
              static_cast<long long>(cols), rms_plain, rms_fused, rms_plain / rms_fused);
  std::printf("| SwiGLU (Llama) | %lld x %lld | %.3f | %.3f | %.2fx |\n", static_cast<long long>(rows),
              static_cast<long long>(4 * cols), swiglu_plain, swiglu_fused, swiglu_plain / swiglu_fused);
  std::printf("| rotary on q (Llama) | %lld x %lld x %lld x %lld | %.3f | %.3f | %.2fx |\n", static_cast<long long>(B),
              static_cast<long long>(T), static_cast<long long>(heads), static_cast<long long>(head_dim), rope_plain,
              rope_fused, rope_plain / rope_fused);
  return 0;
}
