// CUDA kernels for the elementwise work of a GPT-2 or Llama block and of the classifier's loss
// (src/model/kernels/fused_kernels.cu), behind a torch-free C++ interface so that nvcc never sees
// libtorch's headers. Built only when CMake finds a CUDA compiler (MPITRAIN_FUSED_KERNELS is then
// defined for the callers); src/model/fused_ops.cpp and linear_cross_entropy (src/model/model.cpp) call them
// and keep an ATen reference implementation of the same formulas for the CPU, for shapes the
// kernels do not take, and for the tests.
//
// Layout: every tensor is contiguous and row-major; `rows` x `cols` (norms: cols = C, the
// normalised size; GELU: cols = the MLP's hidden width). Statistics, norm parameters, the
// GELU bias and all accumulations are fp32. Every function enqueues its kernels on `stream` (a
// cudaStream_t) and returns nullptr, or a static string naming the CUDA error of the launch.
#pragma once

#include <cstdint>

namespace mpitrain::kernels {

enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };

// The pre-norm of a block with the residual add before it, as LayerNorm (GPT-2) or RMSNorm
// (Llama): residual = x + delta (delta == nullptr: residual = x), then per row
//   layer: normed = (residual - mean) * rstd * gamma + beta,  rstd = 1 / sqrt(var + eps)
//   rms:   normed = residual * rstd * gamma,                  rstd = 1 / sqrt(mean(residual^2) + eps)
// in `normed_t`; mean (layer only) and rstd ([rows], fp32) are kept for the backward pass. x and
// residual are fp32; delta is `delta_t`. For rms, beta and mean are unused (pass nullptr).
enum class NormKind : int { layer = 0, rms = 1 };
const char* add_norm_forward(NormKind kind, const float* x, const void* delta, DType delta_t, const float* gamma,
                             const float* beta, float eps, float* residual, void* normed, DType normed_t,
                             float* mean, float* rstd, int64_t rows, int64_t cols, void* stream);

// The gradient reaching the residual stream: d_residual = d_out (may be nullptr: zero) +
// norm-backward(d_normed) (may be nullptr: zero, and the partials are zeroed), written as fp32
// to d_x and, when d_delta != nullptr, also in `delta_t` to d_delta (the same value: residual =
// x + delta). `partials` (fp32, P x blocks x cols, blocks = norm_param_grad_blocks(rows); P = 2
// for layer, 1 for rms) receives per-block sums of d_normed * xhat (d_gamma) and, for layer,
// d_normed (d_beta); the caller sums them over the blocks (a fixed order: deterministic).
// mean: layer only (nullptr for rms).
const char* add_norm_backward(NormKind kind, const float* residual, const float* mean, const float* rstd,
                              const float* gamma, const void* d_normed, DType normed_t, const float* d_out,
                              float* d_x, void* d_delta, DType delta_t, float* partials, int64_t rows, int64_t cols,
                              void* stream);
int64_t norm_param_grad_blocks(int64_t rows);

// out = gelu_tanh(pre + bias) in `t` (pre and out have the same dtype; bias fp32 [cols]).
const char* bias_gelu_forward(const void* pre, const float* bias, void* out, DType t, int64_t rows,
                              int64_t cols, void* stream);

// d_pre = d_out * gelu_tanh'(pre + bias) in `t`; `partials` (fp32, blocks x cols, blocks =
// bias_gelu_grad_blocks(rows)) receives per-block column sums of d_pre (d_bias once summed).
const char* bias_gelu_backward(const void* pre, const float* bias, const void* d_out, void* d_pre, DType t,
                               float* partials, int64_t rows, int64_t cols, void* stream);
int64_t bias_gelu_grad_blocks(int64_t rows);

// SwiGLU's gate (Llama's MLP): out = silu(gate) * up, silu(g) = g / (1 + exp(-g)), over `n`
// elements of `t` (gate, up and out alike).
const char* swiglu_forward(const void* gate, const void* up, void* out, DType t, int64_t n, void* stream);
// d_gate = d_out * up * s * (1 + gate * (1 - s)) and d_up = d_out * silu(gate), s = sigmoid(gate).
const char* swiglu_backward(const void* gate, const void* up, const void* d_out, void* d_gate, void* d_up, DType t,
                            int64_t n, void* stream);

// Rotary position embedding in Hugging Face's half-split layout: x [rows, head_dim] with row r
// the head of position t = (r / heads) % seq (x is [batch, seq, heads, head_dim]), and cos/sin
// fp32 tables [>= seq, head_dim] (row t, contiguous). With h = head_dim / 2 and i < h:
//   out[i]     = x[i] * cos[t][i]         - x[i + h] * sin[t][i]
//   out[i + h] = x[i + h] * cos[t][i + h] + x[i] * sin[t][i + h]
// (x cos + rotate_half(x) sin), in `t` with Hugging Face's roundings: cos and sin are rounded to
// `t`, each product and the sum rounded to `t` (fp32: no fused multiply-add), so the result is
// the unfused ATen ops' bit for bit. With inverse, the transpose (rotation by -angle: the
// backward pass, d_x from d_out): out[i] = x[i] cos[t][i] + x[i + h] sin[t][i + h], out[i + h] =
// x[i + h] cos[t][i + h] - x[i] sin[t][i]. head_dim even; x and out may not overlap.
const char* rotary(const void* x, const float* cos, const float* sin, void* out, DType t, bool inverse, int64_t rows,
                   int64_t seq, int64_t heads, int64_t head_dim, void* stream);

// Per row of `logits` ([rows, cols] in `t`): loss[row] = logsumexp(row) - row[targets[row]]
// (fp32; NaN for a target outside [0, cols)). With with_grad the row is then overwritten, in
// place and in `t`, by scale * (softmax(row) - onehot(targets[row])), the gradient of
// scale * sum(loss) with respect to the logits.
const char* softmax_cross_entropy(void* logits, DType t, const int64_t* targets, float* loss, float scale,
                                  bool with_grad, int64_t rows, int64_t cols, void* stream);

// The sum of squares of n fp32 tensors (x[i] holding numel[i] elements; empty ones skipped), in
// fp64: `partials` (sum_squares_partials(numel, n) doubles) receives one partial sum per block of
// 65536 elements of one tensor, in tensor order; the caller adds them (a fixed order: deterministic).
const char* sum_squares(const float* const* x, const int64_t* numel, int n, double* partials, void* stream);
int64_t sum_squares_partials(const int64_t* numel, int n);

}  // namespace mpitrain::kernels
