// The CUDA kernels of src/model/kernels/fused_kernels.cu, launchers included, run on CPU threads under
// tests/cuda_emu.h (one fiber per CUDA thread, real barriers for __syncthreads and warp
// shuffles) and checked against straightforward double-precision loops written here. This
// checks the kernels' indexing, reductions, vectorised and scalar paths, dtype conversions and
// partial-sum layouts on machines without a GPU; it says nothing about their speed, and the
// nvcc-compiled code is checked against the ATen reference only by tests/test_gpu.cpp on a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#define MPITRAIN_CUDA_EMULATION 1
#include "../src/model/kernels/fused_kernels.cu"

using namespace mpitrain::kernels;

namespace {

// Values of one dtype kept as their storage (float, or 16-bit patterns), converted like the kernels.
struct Buffer {
  DType t;
  std::vector<float> f32;
  std::vector<uint16_t> b16;
  Buffer(DType type, size_t n) : t(type) { t == DType::f32 ? f32.assign(n, 0.f) : b16.assign(n, 0); }
  void* data() { return t == DType::f32 ? static_cast<void*>(f32.data()) : static_cast<void*>(b16.data()); }
  float get(size_t i) const {
    if (t == DType::f32) return f32[i];
    return t == DType::bf16 ? __bfloat162float(__nv_bfloat16{b16[i]}) : __half2float(__half{b16[i]});
  }
  void set(size_t i, float v) {
    if (t == DType::f32) f32[i] = v;
    else b16[i] = t == DType::bf16 ? __float2bfloat16_rn(v).bits : __float2half_rn(v).bits;
  }
};

const char* name(DType t) { return t == DType::f32 ? "f32" : t == DType::bf16 ? "bf16" : "f16"; }

// |got - want| within one rounding of the dtype (relative) plus an absolute floor.
double tol(DType t, double want, double abs_floor = 1e-5) {
  const double ulp = t == DType::f32 ? 1e-5 : t == DType::bf16 ? 1.0 / 128 : 1.0 / 1024;
  return ulp * std::fabs(want) + abs_floor;
}

std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.f, float shift = 0.f) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng) * scale + shift;
  return v;
}

}  // namespace

TEST(KernelsEmu, AddLayerNormForwardAndBackwardMatchDoublePrecisionLoops) {
  std::mt19937 rng(1);
  const float eps = 1e-5f;
  for (int64_t cols : {100, 33, 64}) {
    for (int64_t rows : {int64_t{1}, int64_t{37}}) {
      for (int delta_case = 0; delta_case < 4; ++delta_case) {  // none, f32, bf16, f16
        for (DType out_t : {DType::f32, DType::bf16, DType::f16}) {
          const bool has_delta = delta_case > 0;
          const DType delta_t = has_delta ? static_cast<DType>(delta_case - 1) : DType::f32;
          const size_t n = static_cast<size_t>(rows * cols);
          const std::string where = std::string("cols ") + std::to_string(cols) + " rows " + std::to_string(rows) +
                                    " delta " + (has_delta ? name(delta_t) : "none") + " out " + name(out_t);
          auto x = randn(n, rng, 3.f, 1.f), gamma = randn(cols, rng), beta = randn(cols, rng);
          Buffer delta(delta_t, n);
          for (size_t i = 0; i < n; ++i) delta.set(i, randn(1, rng)[0]);
          std::vector<float> residual(n), mean(rows), rstd(rows);
          Buffer normed(out_t, n);
          ASSERT_EQ(add_layernorm_forward(x.data(), has_delta ? delta.data() : nullptr, delta_t, gamma.data(),
                                          beta.data(), eps, residual.data(), normed.data(), out_t, mean.data(),
                                          rstd.data(), rows, cols, nullptr),
                    nullptr);
          // Reference forward, and the values the backward pass needs.
          std::vector<double> r(n), xhat(n), rs(rows);
          for (int64_t i = 0; i < rows; ++i) {
            double m = 0, v = 0;
            for (int64_t c = 0; c < cols; ++c) {
              const size_t k = i * cols + c;
              r[k] = static_cast<double>(x[k]) + (has_delta ? delta.get(k) : 0.0);
              m += r[k];
            }
            m /= cols;
            for (int64_t c = 0; c < cols; ++c) v += (r[i * cols + c] - m) * (r[i * cols + c] - m);
            rs[i] = 1.0 / std::sqrt(v / cols + eps);
            EXPECT_NEAR(mean[i], m, 1e-5 * (1 + std::fabs(m))) << where;
            EXPECT_NEAR(rstd[i], rs[i], 1e-5 * rs[i]) << where;
            for (int64_t c = 0; c < cols; ++c) {
              const size_t k = i * cols + c;
              xhat[k] = (r[k] - m) * rs[i];
              EXPECT_NEAR(residual[k], r[k], 1e-6 * (1 + std::fabs(r[k]))) << where;
              const double want = xhat[k] * gamma[c] + beta[c];
              ASSERT_NEAR(normed.get(k), want, tol(out_t, want, 1e-4)) << where << " at " << k;
            }
          }
          // Backward, with and without the residual stream's own gradient, and without d_normed.
          for (int grad_case = 0; grad_case < 3; ++grad_case) {
            const bool has_dout = grad_case != 1, has_dn = grad_case != 2;
            Buffer dn(out_t, n);
            for (size_t i = 0; i < n; ++i) dn.set(i, randn(1, rng)[0]);
            auto dout = randn(n, rng);
            std::vector<float> dx(n);
            Buffer ddelta(delta_t, n);
            const int64_t blocks = layernorm_param_grad_blocks(rows);
            std::vector<float> partials(static_cast<size_t>(2 * blocks * cols), -1.f);
            ASSERT_EQ(add_layernorm_backward(residual.data(), mean.data(), rstd.data(), gamma.data(),
                                             has_dn ? dn.data() : nullptr, out_t, has_dout ? dout.data() : nullptr,
                                             dx.data(), has_delta ? ddelta.data() : nullptr, delta_t,
                                             partials.data(), rows, cols, nullptr),
                      nullptr);
            const std::string w2 = where + (has_dout ? " +d_out" : "") + (has_dn ? " +d_normed" : "");
            std::vector<double> dgamma(cols, 0.0), dbeta(cols, 0.0);
            for (int64_t i = 0; i < rows; ++i) {
              double m1 = 0, m2 = 0;
              for (int64_t c = 0; c < cols; ++c) {
                const size_t k = i * cols + c;
                const double g = has_dn ? dn.get(k) * static_cast<double>(gamma[c]) : 0.0;
                m1 += g;
                m2 += g * xhat[k];
              }
              m1 /= cols;
              m2 /= cols;
              for (int64_t c = 0; c < cols; ++c) {
                const size_t k = i * cols + c;
                const double g = has_dn ? dn.get(k) * static_cast<double>(gamma[c]) : 0.0;
                const double want = (has_dout ? dout[k] : 0.0) + rs[i] * (g - m1 - xhat[k] * m2);
                ASSERT_NEAR(dx[k], want, 2e-4 * (1 + std::fabs(want))) << w2 << " d_x at " << k;
                if (has_delta) {
                  ASSERT_NEAR(ddelta.get(k), want, tol(delta_t, want, 2e-4)) << w2 << " d_delta";
                }
                if (has_dn) {
                  dgamma[c] += dn.get(k) * xhat[k];
                  dbeta[c] += dn.get(k);
                }
              }
            }
            for (int64_t c = 0; c < cols; ++c) {
              double sg = 0, sb = 0;
              for (int64_t b = 0; b < blocks; ++b) {
                sg += partials[b * cols + c];
                sb += partials[(blocks + b) * cols + c];
              }
              EXPECT_NEAR(sg, dgamma[c], 1e-4 * (1 + std::fabs(dgamma[c])) * rows) << w2 << " d_gamma " << c;
              EXPECT_NEAR(sb, dbeta[c], 1e-4 * (1 + std::fabs(dbeta[c])) * rows) << w2 << " d_beta " << c;
            }
          }
        }
      }
    }
  }
}

namespace {

double gelu(double u) { return 0.5 * u * (1 + std::tanh(0.7978845608028654 * (u + 0.044715 * u * u * u))); }
double gelu_grad(double u) {
  const double k = 0.7978845608028654, t = std::tanh(k * (u + 0.044715 * u * u * u));
  return 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * k * (1 + 3 * 0.044715 * u * u);
}

}  // namespace

TEST(KernelsEmu, BiasGeluForwardAndBackwardMatchDoublePrecisionLoops) {
  std::mt19937 rng(2);
  // 96: 16-byte packs for every dtype; 100: packs for f32 only; 24 and one element off the
  // aligned start: the scalar path. 300 rows: several row groups in the bias-gradient partials.
  for (int64_t cols : {96, 100, 24}) {
    for (DType t : {DType::f32, DType::bf16, DType::f16}) {
      for (bool aligned : {true, false}) {
        const int64_t rows = 300;
        const size_t n = static_cast<size_t>(rows * cols), off = aligned ? 0 : 1;
        const std::string where = "cols " + std::to_string(cols) + " " + name(t) + (aligned ? "" : " unaligned");
        Buffer pre(t, n + 1), out(t, n + 1), dout(t, n + 1), dpre(t, n + 1);
        for (size_t i = 0; i < n; ++i) {
          pre.set(off + i, randn(1, rng, 2.f)[0]);
          dout.set(off + i, randn(1, rng)[0]);
        }
        auto bias = randn(cols, rng);
        const size_t bytes = t == DType::f32 ? 4 : 2;
        auto at = [&](Buffer& b) { return static_cast<char*>(b.data()) + off * bytes; };
        ASSERT_EQ(bias_gelu_forward(at(pre), bias.data(), at(out), t, rows, cols, nullptr), nullptr);
        const int64_t blocks = bias_gelu_grad_blocks(rows);
        std::vector<float> partials(static_cast<size_t>(blocks * cols), -1.f);
        ASSERT_EQ(bias_gelu_backward(at(pre), bias.data(), at(dout), at(dpre), t, partials.data(), rows, cols, nullptr),
                  nullptr);
        std::vector<double> dbias(cols, 0.0);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t c = 0; c < cols; ++c) {
            const size_t k = off + i * cols + c;
            const double u = pre.get(k) + static_cast<double>(bias[c]);
            ASSERT_NEAR(out.get(k), gelu(u), tol(t, gelu(u), 1e-5)) << where << " out at " << k;
            const double d = dout.get(k) * gelu_grad(u);
            ASSERT_NEAR(dpre.get(k), d, tol(t, d, 1e-5)) << where << " d_pre at " << k;
            dbias[c] += d;
          }
        for (int64_t c = 0; c < cols; ++c) {
          double s = 0;
          for (int64_t b = 0; b < blocks; ++b) s += partials[b * cols + c];
          EXPECT_NEAR(s, dbias[c], 1e-4 * (1 + std::fabs(dbias[c])) * 10) << where << " d_bias " << c;
        }
        EXPECT_EQ(pre.get(aligned ? n : 0), 0.f) << "the element outside the tensor was not touched";
        EXPECT_EQ(out.get(aligned ? n : 0), 0.f) << where << ": wrote outside the tensor";
      }
    }
  }
}

TEST(KernelsEmu, SoftmaxCrossEntropyMatchesDoublePrecisionLoops) {
  std::mt19937 rng(3);
  for (int64_t cols : {1001, 2048}) {
    for (DType t : {DType::f32, DType::bf16, DType::f16}) {
      for (bool with_grad : {true, false}) {
        const int64_t rows = 4;
        const size_t n = static_cast<size_t>(rows * cols);
        const std::string where = "cols " + std::to_string(cols) + " " + name(t) + (with_grad ? " grad" : "");
        Buffer logits(t, n);
        for (size_t i = 0; i < n; ++i) logits.set(i, randn(1, rng, 3.f)[0]);
        const Buffer before = logits;
        std::vector<int64_t> targets = {0, cols - 1, 17, cols};  // the last is out of range
        std::vector<float> loss(rows, -1.f);
        const float scale = 0.25f;
        ASSERT_EQ(softmax_cross_entropy(logits.data(), t, targets.data(), loss.data(), scale, with_grad, rows, cols,
                                        nullptr),
                  nullptr);
        for (int64_t i = 0; i < rows; ++i) {
          double mx = -INFINITY, sum = 0;
          for (int64_t c = 0; c < cols; ++c) mx = std::max<double>(mx, before.get(i * cols + c));
          for (int64_t c = 0; c < cols; ++c) sum += std::exp(before.get(i * cols + c) - mx);
          const double lse = mx + std::log(sum);
          const bool valid = targets[i] < cols;
          if (valid) {
            EXPECT_NEAR(loss[i], lse - before.get(i * cols + targets[i]), 1e-4) << where << " row " << i;
          } else {
            EXPECT_TRUE(std::isnan(loss[i])) << where << ": out-of-range target gives NaN";
          }
          for (int64_t c = 0; c < cols; ++c) {
            const size_t k = i * cols + c;
            if (!with_grad) {
              ASSERT_EQ(logits.get(k), before.get(k)) << where << ": logits changed without with_grad";
              continue;
            }
            const double g = scale * (std::exp(before.get(k) - lse) - (valid && c == targets[i] ? 1.0 : 0.0));
            ASSERT_NEAR(logits.get(k), g, tol(t, g, 1e-7)) << where << " grad at row " << i << " col " << c;
          }
        }
      }
    }
  }
}

TEST(KernelsEmu, EmptyInputsLaunchNothingAndBadLaunchesReportAnError) {
  EXPECT_EQ(bias_gelu_forward(nullptr, nullptr, nullptr, DType::f32, 0, 8, nullptr), nullptr);
  EXPECT_EQ(softmax_cross_entropy(nullptr, DType::f32, nullptr, nullptr, 1.f, true, 0, 8, nullptr), nullptr);
  // A launch the emulator refuses (as the runtime would an invalid configuration) is reported.
  cuda_emu::launch(dim3(1), dim3(33), [] {});
  EXPECT_NE(launch_status(), nullptr);
  EXPECT_EQ(launch_status(), nullptr);  // and cleared once read
}
