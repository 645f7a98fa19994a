// Fused elementwise ops of the GPT-2 and Llama blocks (model.fused_kernels, docs/config.md) as
// autograd functions with hand-written backward passes, and the classifier's fused softmax
// cross-entropy (model.fused_loss). On CUDA they run the kernels of
// fused_kernels.h when those were built and the tensors suit them (contiguous fp32 residual
// stream and parameters, activations fp32/bf16/fp16); elsewhere an ATen reference
// implementation of the same formulas runs, which the CPU tests check against libtorch's own
// autograd of the plain formulas (layer_norm, gelu, RMSNorm, silu, rotate_half) and the GPU
// tests check the kernels against.
#pragma once

#include <torch/torch.h>

#include <utility>
#include <vector>

namespace mpitrain {

enum class FusedImpl { automatic, reference };  // automatic: the CUDA kernel where it applies

// F::apply(args...) for a torch::autograd::Function F. GCC 14 with libtorch 2.x reports
// -Warray-bounds / -Wstringop-overflow inside std::vector<bool>::reserve when it inlines into
// Function::apply (custom_function.h): a false positive of GCC's in library code, silenced here,
// at the one place this project calls apply. GCC honours such a pragma only where the warned
// code is inlined into the lines it covers, so `flatten` inlines Function::apply (and what it
// calls, where the bodies are visible) into this wrapper: without it the warning is reported from
// an out-of-line Function<TpCopy>::apply, out of the pragma's reach (measured with GCC 14.2).
template <class F, class... Args>
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((flatten))
#endif
auto apply_autograd_function(Args&&... args) {
#if defined(__GNUC__) && !defined(__clang__)  // clang has neither warning
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
  return F::apply(std::forward<Args>(args)...);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
}

// True when this build has the CUDA kernels (a CUDA compiler was found at configure time).
bool fused_kernels_built();
// Whether `t` is where the kernels run: a CUDA tensor in a build with the kernels (a CPU tensor
// in the CPU-emulation test build, tests/test_fused_emu.cpp); false otherwise.
bool fused_kernel_device(const torch::Tensor& t);

// residual = x + delta (delta undefined: residual = x) and normed = layer_norm(residual) *
// weight + bias, cast to out_dtype. Returns {residual, normed}; gradients flow to x, delta,
// weight and bias from either output. x, weight, bias: fp32; delta: any float dtype, x's shape.
// The LayerNorm is over the last dimension, with the biased variance.
std::pair<torch::Tensor, torch::Tensor> add_layernorm(const torch::Tensor& x, const torch::Tensor& delta,
                                                      const torch::Tensor& weight, const torch::Tensor& bias,
                                                      double eps, c10::ScalarType out_dtype,
                                                      FusedImpl impl = FusedImpl::automatic);

// The same with RMSNorm (Llama; Hugging Face's LlamaRMSNorm): normed = residual *
// rsqrt(mean(residual^2) + eps) * weight, in fp32, cast to out_dtype. No bias.
std::pair<torch::Tensor, torch::Tensor> add_rmsnorm(const torch::Tensor& x, const torch::Tensor& delta,
                                                    const torch::Tensor& weight, double eps, c10::ScalarType out_dtype,
                                                    FusedImpl impl = FusedImpl::automatic);

// gelu_tanh(pre + bias) over the last dimension (bias fp32 [pre.size(-1)]), in pre's dtype.
torch::Tensor bias_gelu(const torch::Tensor& pre, const torch::Tensor& bias, FusedImpl impl = FusedImpl::automatic);

// SwiGLU's gate (Llama's MLP): silu(gate) * up, computed in fp32 and rounded once to gate's dtype
// (gate and up: the same shape and dtype; the outputs of gate_proj and up_proj).
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up, FusedImpl impl = FusedImpl::automatic);

// Rotary position embedding, Hugging Face's half-split layout: x * cos + rotate_half(x) * sin for
// x [B, T, heads, head_dim] (position t = index 1), cos and sin fp32 tables [>= T, head_dim]
// (Rotary's, model.h) rounded to x's dtype, the products and the sum each rounded to x's dtype
// as the unfused ATen ops round them (bit for bit the same result). The backward pass rotates the
// gradient by the negative angle. The tables get no gradient.
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                     FusedImpl impl = FusedImpl::automatic);

// sum over the tensors of sum(t^2), accumulated in fp64: a [1] fp64 tensor on their device (on
// `device` when the list is empty). The kernel reads each fp32 CUDA tensor once (sum_squares in
// fused_kernels.h); the reference is one fp64 vector norm per tensor. Gradient clipping's global
// norm (optim.cpp): fp64 keeps it the same, to fp32 rounding, however the elements are split.
torch::Tensor sum_of_squares(const std::vector<torch::Tensor>& ts, const torch::Device& device,
                             FusedImpl impl = FusedImpl::automatic);

// The classifier's softmax cross-entropy over one chunk of logits, by the CUDA kernel (only in
// builds with the kernels; elsewhere an Error): loss[r] = logsumexp(logits[r]) -
// logits[r][targets[r]], and with with_grad the logits are overwritten in place by
// grad_scale * (softmax - onehot), the gradient of grad_scale * sum(loss). logits: contiguous
// CUDA [rows, vocab], fp32/bf16/fp16; targets int64 [rows]; loss fp32 [rows]. Used by
// linear_cross_entropy (model.h), whose ATen path is the reference the GPU tests compare with.
void fused_softmax_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, const torch::Tensor& loss,
                                 double grad_scale, bool with_grad);
// Whether fused_softmax_cross_entropy takes these logits (kernels built, on their device,
// contiguous 2-D fp32/bf16/fp16); linear_cross_entropy uses its ATen path otherwise.
bool softmax_cross_entropy_kernel_applies(const torch::Tensor& logits);

}  // namespace mpitrain
