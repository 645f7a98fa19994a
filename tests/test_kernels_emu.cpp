// The CUDA kernels of src/model/kernels/fused_kernels.cu, launchers included, run on CPU threads under
// tests/cuda_emu.h (one fiber per CUDA thread, real barriers for __syncthreads and warp
// shuffles) and checked against straightforward double-precision loops written here. This
// checks the kernels' indexing, reductions, vectorised and scalar paths, dtype conversions and
// partial-sum layouts on machines without a GPU; it says nothing about their speed, and the
// nvcc-compiled code is checked against the ATen reference only by tests/test_gpu.cpp on a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
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

// LayerNorm and RMSNorm (one kernel template; RMSNorm: mean taken as 0, no beta, m1 = 0).
TEST(KernelsEmu, AddNormForwardAndBackwardMatchDoublePrecisionLoops) {
  std::mt19937 rng(1);
  const float eps = 1e-5f;
  for (NormKind kind : {NormKind::layer, NormKind::rms}) {
    const bool layer = kind == NormKind::layer;
    for (int64_t cols : {100, 33, 64}) {
      for (int64_t rows : {int64_t{1}, int64_t{37}}) {
        for (int delta_case = 0; delta_case < 4; ++delta_case) {  // none, f32, bf16, f16
          for (DType out_t : {DType::f32, DType::bf16, DType::f16}) {
            const bool has_delta = delta_case > 0;
            const DType delta_t = has_delta ? static_cast<DType>(delta_case - 1) : DType::f32;
            const size_t n = static_cast<size_t>(rows * cols);
            const std::string where = std::string(layer ? "layer" : "rms") + " cols " + std::to_string(cols) +
                                      " rows " + std::to_string(rows) + " delta " +
                                      (has_delta ? name(delta_t) : "none") + " out " + name(out_t);
            auto x = randn(n, rng, 3.f, 1.f), gamma = randn(cols, rng), beta = randn(cols, rng);
            Buffer delta(delta_t, n);
            for (size_t i = 0; i < n; ++i) delta.set(i, randn(1, rng)[0]);
            std::vector<float> residual(n), mean(rows, -1.f), rstd(rows);
            Buffer normed(out_t, n);
            ASSERT_EQ(add_norm_forward(kind, x.data(), has_delta ? delta.data() : nullptr, delta_t, gamma.data(),
                                       layer ? beta.data() : nullptr, eps, residual.data(), normed.data(), out_t,
                                       layer ? mean.data() : nullptr, rstd.data(), rows, cols, nullptr),
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
              m = layer ? m / cols : 0.0;  // RMSNorm: the second moment about 0
              for (int64_t c = 0; c < cols; ++c) v += (r[i * cols + c] - m) * (r[i * cols + c] - m);
              rs[i] = 1.0 / std::sqrt(v / cols + eps);
              if (layer) {
                EXPECT_NEAR(mean[i], m, 1e-5 * (1 + std::fabs(m))) << where;
              } else {
                EXPECT_EQ(mean[i], -1.f) << where << ": RMSNorm wrote a mean";
              }
              EXPECT_NEAR(rstd[i], rs[i], 1e-5 * rs[i]) << where;
              for (int64_t c = 0; c < cols; ++c) {
                const size_t k = i * cols + c;
                xhat[k] = (r[k] - m) * rs[i];
                EXPECT_NEAR(residual[k], r[k], 1e-6 * (1 + std::fabs(r[k]))) << where;
                const double want = xhat[k] * gamma[c] + (layer ? beta[c] : 0.0);
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
              const int64_t blocks = norm_param_grad_blocks(rows);
              // RMSNorm writes one partial sum per block and column (d_gamma): the second half
              // must stay as it was.
              std::vector<float> partials(static_cast<size_t>(2 * blocks * cols), -1.f);
              ASSERT_EQ(add_norm_backward(kind, residual.data(), layer ? mean.data() : nullptr, rstd.data(),
                                          gamma.data(), has_dn ? dn.data() : nullptr, out_t,
                                          has_dout ? dout.data() : nullptr, dx.data(),
                                          has_delta ? ddelta.data() : nullptr, delta_t, partials.data(), rows, cols,
                                          nullptr),
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
                m1 = layer ? m1 / cols : 0.0;  // RMSNorm's output does not shift with the mean
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
                if (layer) {
                  EXPECT_NEAR(sb, dbeta[c], 1e-4 * (1 + std::fabs(dbeta[c])) * rows) << w2 << " d_beta " << c;
                } else {
                  for (int64_t b = 0; b < blocks; ++b)
                    ASSERT_EQ(partials[(blocks + b) * cols + c], -1.f) << w2 << ": RMSNorm wrote d_beta partials";
                }
              }
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

namespace {

// Unit roundoff (half an ulp at 1) of each dtype: a correctly rounded result is within u |v|.
double unit_roundoff(DType t) {
  return t == DType::f32 ? std::ldexp(1.0, -24) : t == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
}
// Below fp16's normal range (2^-14) its rounding is absolute: half the subnormal spacing 2^-24.
double underflow_floor(DType t) { return t == DType::f16 ? std::ldexp(1.0, -25) : 1e-37; }

double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

}  // namespace

// SwiGLU against double-precision loops. Error bounds, per element: the kernel evaluates the
// formula in fp32 from the stored inputs (exact in double), then rounds once to the dtype. A
// forward error analysis of an fp32 evaluation bounds its error by k u32 M, M the same formula
// evaluated on absolute values (every intermediate's magnitude) and k the number of rounded
// operations on the longest path: sigmoid = exp (glibc/CUDA: within 2 ulp, counted 2), add,
// divide: 4, and its error is not magnified (|ds/s| <= |de/e|); then 1 - s, * g, + 1 and
// three products: k = 12 covers every output. The final rounding adds u_T |want|.
//   out    = g s u                     M = |g s u|
//   d_up   = d g s                     M = |d g s|
//   d_gate = d u s (1 + g (1 - s))     M = |d u| s (1 + |g| (1 + s))   (1 - s cancels for g >> 0)
TEST(KernelsEmu, SwigluForwardAndBackwardMatchDoublePrecisionLoops) {
  std::mt19937 rng(4);
  const double u32 = unit_roundoff(DType::f32), k = 12;
  // 1200: 16-byte packs for every dtype; 1001 and one element off the aligned start: the
  // scalar path. Gates up to ~8 in magnitude reach both tails of the sigmoid.
  for (int64_t n : {1200, 1001}) {
    for (DType t : {DType::f32, DType::bf16, DType::f16}) {
      for (bool aligned : {true, false}) {
        const size_t off = aligned ? 0 : 1, len = static_cast<size_t>(n);
        const std::string where = "n " + std::to_string(n) + " " + name(t) + (aligned ? "" : " unaligned");
        Buffer gate(t, len + 1), up(t, len + 1), dout(t, len + 1), out(t, len + 1), dgate(t, len + 1),
            dup(t, len + 1);
        for (size_t i = 0; i < len; ++i) {
          gate.set(off + i, randn(1, rng, 3.f)[0]);
          up.set(off + i, randn(1, rng)[0]);
          dout.set(off + i, randn(1, rng)[0]);
        }
        const size_t bytes = t == DType::f32 ? 4 : 2;
        auto at = [&](Buffer& b) { return static_cast<char*>(b.data()) + off * bytes; };
        ASSERT_EQ(swiglu_forward(at(gate), at(up), at(out), t, n, nullptr), nullptr);
        ASSERT_EQ(swiglu_backward(at(gate), at(up), at(dout), at(dgate), at(dup), t, n, nullptr), nullptr);
        double worst = 0;  // the largest |error| / bound, reported
        auto check = [&](double got, double want, double m, const char* what, size_t i) {
          const double bound = k * u32 * m + unit_roundoff(t) * std::fabs(want) + underflow_floor(t);
          worst = std::max(worst, std::fabs(got - want) / bound);
          ASSERT_LE(std::fabs(got - want), bound) << where << " " << what << " at " << i << ": got " << got
                                                  << ", want " << want;
        };
        for (size_t i = off; i < off + len; ++i) {
          const double g = gate.get(i), u = up.get(i), d = dout.get(i), sg = sigmoid(g);
          check(out.get(i), g * sg * u, std::fabs(g * sg * u), "out", i);
          check(dup.get(i), d * g * sg, std::fabs(d * g * sg), "d_up", i);
          check(dgate.get(i), d * u * sg * (1 + g * (1 - sg)), std::fabs(d * u) * sg * (1 + std::fabs(g) * (1 + sg)),
                "d_gate", i);
        }
        const size_t outside = aligned ? len : 0;
        EXPECT_EQ(out.get(outside), 0.f) << where << ": wrote outside the tensor";
        EXPECT_EQ(dgate.get(outside), 0.f) << where << ": wrote outside the tensor";
        EXPECT_EQ(dup.get(outside), 0.f) << where << ": wrote outside the tensor";
        std::cout << "swiglu " << where << ": max |error| / bound " << worst << "\n";
      }
    }
  }
}

// Rotary embedding against (a) the same roundings written out here (cos and sin rounded to the
// dtype, each product and the sum rounded to it: the kernel's stated contract, which makes it
// equal to the unfused ATen ops) -- exact equality; and (b) the exact rotation in double, within
// what those five roundings allow. With c' = c (1 + e1), s' = s (1 + e2), a = x_i c' (1 + e3),
// b = +-x_p s' (1 + e4), out = (a + b)(1 + e5), |e| <= u_T:
//   |out - exact| <= (|x_i c| + |x_p s|) ((2 u + u^2) + u (1 + u)^2) <= 3.1 u (|x_i c| + |x_p s|)
// (3 u^2 + u^3 <= 0.1 u for u <= 2^-8). In fp16's subnormal range a rounding is absolute instead,
// up to 2^-25 each: the table roundings times |x|, the other three once each.
// Random tables (the two halves differ) check which half's cos and sin each output reads; the
// table has more rows than the sequence (row stride = head_dim, row t read for position t).
TEST(KernelsEmu, RotaryMatchesItsRoundingsAndTheExactRotation) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> unit(-1.f, 1.f);
  const int64_t batch = 2, seq = 5, heads = 3, table_rows = 7;
  // head_dim 16: 16-byte packs of both halves for every dtype; 12 (half 6, no whole pack) and
  // one element off the aligned start: the scalar path.
  for (int64_t head_dim : {16, 12, 64}) {
    for (DType t : {DType::f32, DType::bf16, DType::f16}) {
      for (bool inverse : {false, true}) {
        for (bool aligned : {true, false}) {
          const int64_t rows = batch * seq * heads, half = head_dim / 2;
          const size_t len = static_cast<size_t>(rows * head_dim), off = aligned ? 0 : 1;
          const std::string where = "head_dim " + std::to_string(head_dim) + " " + name(t) +
                                    (inverse ? " inverse" : "") + (aligned ? "" : " unaligned");
          Buffer x(t, len + 1), out(t, len + 1);
          for (size_t i = 0; i < len; ++i) x.set(off + i, randn(1, rng, 2.f)[0]);
          std::vector<float> cos(static_cast<size_t>(table_rows * head_dim)), sin(cos.size());
          for (auto& v : cos) v = unit(rng);
          for (auto& v : sin) v = unit(rng);
          const size_t bytes = t == DType::f32 ? 4 : 2;
          ASSERT_EQ(rotary(static_cast<char*>(x.data()) + off * bytes, cos.data(), sin.data(),
                           static_cast<char*>(out.data()) + off * bytes, t, inverse, rows, seq, heads, head_dim,
                           nullptr),
                    nullptr);
          Buffer rounder(t, 1);
          auto rt = [&](float v) {  // v rounded to the dtype
            rounder.set(0, v);
            return rounder.get(0);
          };
          const double u = unit_roundoff(t);
          double worst = 0;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t pos = (r / heads) % seq;
            for (int64_t i = 0; i < head_dim; ++i) {
              const bool first = i < half;
              const int64_t p = first ? i + half : i - half;  // the partner in the pair
              // forward: out_i = x_i cos_i -/+ x_p sin_i; inverse: out_i = x_i cos_i +/- x_p sin_p
              const int64_t si = inverse ? p : i;
              const double sign = (first != inverse) ? -1.0 : 1.0;
              const size_t k = off + static_cast<size_t>(r * head_dim + i);
              const size_t kp = off + static_cast<size_t>(r * head_dim + p);
              const float xi = x.get(k), xp = x.get(kp);
              const float c = cos[pos * head_dim + i], sn = sin[pos * head_dim + si];
              const float a = rt(xi * rt(c)), b = rt(static_cast<float>(sign) * (xp * rt(sn)));
              ASSERT_EQ(out.get(k), rt(a + b)) << where << " row " << r << " i " << i << ": not the stated roundings";
              const double exact = static_cast<double>(xi) * c + sign * static_cast<double>(xp) * sn;
              const double bound = 3.1 * u * (std::fabs(xi * double{c}) + std::fabs(xp * double{sn})) +
                                   underflow_floor(t) * (3 + std::fabs(xi) + std::fabs(xp));
              worst = std::max(worst, std::fabs(out.get(k) - exact) / bound);
              ASSERT_LE(std::fabs(out.get(k) - exact), bound) << where << " row " << r << " i " << i;
            }
          }
          EXPECT_EQ(out.get(aligned ? len : 0), 0.f) << where << ": wrote outside the tensor";
          std::cout << "rotary " << where << ": max |error vs exact| / bound " << worst << "\n";
        }
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

// Gradient clipping's sum of squares: 53 tensors (more than one launch's 48), among them empty ones
// (skipped: no partial) and ones of several 65536-element chunks. Each partial is its chunk's
// sum of squares (fp32 values squared exactly in fp64; the block's tree adds in another order than
// the loop here, so within a few fp64 roundings), in tensor and chunk order, and nothing is written
// past the last partial.
TEST(KernelsEmu, SumSquaresWritesOnePartialPerChunkInOrder) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::vector<std::vector<float>> xs;
  for (int i = 0; i < 53; ++i) {
    const int64_t n = i % 17 == 5 ? 0 : i == 3 ? 3 * 65536 + 11 : i == 50 ? 65536 : 1 + (i * 7919) % 900;
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& v : x) v = normal(rng);
    xs.push_back(std::move(x));
  }
  std::vector<const float*> ptrs;
  std::vector<int64_t> numel;
  for (const auto& x : xs) ptrs.push_back(x.data()), numel.push_back(static_cast<int64_t>(x.size()));
  const int64_t blocks = sum_squares_partials(numel.data(), static_cast<int>(xs.size()));
  std::vector<double> partials(static_cast<size_t>(blocks) + 1, -1.0);  // one sentinel past the end
  ASSERT_EQ(sum_squares(ptrs.data(), numel.data(), static_cast<int>(xs.size()), partials.data(), nullptr), nullptr);
  size_t b = 0;
  for (const auto& x : xs)
    for (size_t begin = 0; begin < x.size(); begin += 65536, ++b) {
      double want = 0;
      for (size_t i = begin; i < std::min(x.size(), begin + 65536); ++i) want += static_cast<double>(x[i]) * x[i];
      ASSERT_LT(b, static_cast<size_t>(blocks));
      EXPECT_NEAR(partials[b], want, 1e-13 * want) << "partial " << b;
    }
  EXPECT_EQ(b, static_cast<size_t>(blocks)) << "one partial per non-empty chunk";
  EXPECT_EQ(blocks, 48 + 4 + 1) << "48 small tensors one chunk each (3 empty ones none), tensor 3 four, tensor 50 one";
  EXPECT_EQ(partials.back(), -1.0) << "written past the last partial";
}
