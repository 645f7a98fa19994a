// CUDA kernels for the elementwise work of a GPT block and of the classifier's loss
// (src/model/kernels/fused_kernels.cu), behind a torch-free C++ interface so that nvcc never sees
// libtorch's headers. Built only when CMake finds a CUDA compiler (MPITRAIN_FUSED_KERNELS is then
// defined for the callers); src/model/fused_ops.cpp and linear_cross_entropy (src/model/model.cpp) call them
// and keep an ATen reference implementation of the same formulas for the CPU, for shapes the
// kernels do not take, and for the tests.
//
// Layout: every tensor is contiguous and row-major; `rows` x `cols` (LayerNorm: cols = C, the
// normalised size; GELU: cols = the MLP's hidden width). Statistics, LayerNorm parameters, the
// GELU bias and all accumulations are fp32. Every function enqueues its kernels on `stream` (a
// cudaStream_t) and returns nullptr, or a static string naming the CUDA error of the launch.
#pragma once

#include <cstdint>

namespace mpitrain::kernels {

enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };

// residual = x + delta (delta == nullptr: residual = x), normed = (residual - mean) * rstd *
// gamma + beta in `normed_t`; mean and rstd ([rows], fp32) are kept for the backward pass.
// x and residual are fp32; delta is `delta_t`.
const char* add_layernorm_forward(const float* x, const void* delta, DType delta_t, const float* gamma,
                                  const float* beta, float eps, float* residual, void* normed, DType normed_t,
                                  float* mean, float* rstd, int64_t rows, int64_t cols, void* stream);

// The gradient reaching the residual stream: d_residual = d_out (may be nullptr: zero) +
// LayerNorm-backward(d_normed) (may be nullptr: zero, and the partials are zeroed), written as
// fp32 to d_x and, when d_delta != nullptr, also in `delta_t` to d_delta (the same value:
// residual = x + delta). `partials` (fp32, 2 x blocks x cols, blocks =
// layernorm_param_grad_blocks(rows)) receives per-block sums of d_normed * xhat (d_gamma) and
// d_normed (d_beta); the caller sums them over the blocks (a fixed order: deterministic).
const char* add_layernorm_backward(const float* residual, const float* mean, const float* rstd, const float* gamma,
                                   const void* d_normed, DType normed_t, const float* d_out, float* d_x,
                                   void* d_delta, DType delta_t, float* partials, int64_t rows, int64_t cols,
                                   void* stream);
int64_t layernorm_param_grad_blocks(int64_t rows);

// out = gelu_tanh(pre + bias) in `t` (pre and out have the same dtype; bias fp32 [cols]).
const char* bias_gelu_forward(const void* pre, const float* bias, void* out, DType t, int64_t rows,
                              int64_t cols, void* stream);

// d_pre = d_out * gelu_tanh'(pre + bias) in `t`; `partials` (fp32, blocks x cols, blocks =
// bias_gelu_grad_blocks(rows)) receives per-block column sums of d_pre (d_bias once summed).
const char* bias_gelu_backward(const void* pre, const float* bias, const void* d_out, void* d_pre, DType t,
                               float* partials, int64_t rows, int64_t cols, void* stream);
int64_t bias_gelu_grad_blocks(int64_t rows);

// Per row of `logits` ([rows, cols] in `t`): loss[row] = logsumexp(row) - row[targets[row]]
// (fp32; NaN for a target outside [0, cols)). With with_grad the row is then overwritten, in
// place and in `t`, by scale * (softmax(row) - onehot(targets[row])), the gradient of
// scale * sum(loss) with respect to the logits.
const char* softmax_cross_entropy(void* logits, DType t, const int64_t* targets, float* loss, float scale,
                                  bool with_grad, int64_t rows, int64_t cols, void* stream);

}  // namespace mpitrain::kernels
